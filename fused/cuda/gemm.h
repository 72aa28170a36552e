// The three GEMMs of the fused algorithm, through cuBLASLt: operands in the inputs' dtype (bf16 or f16 on the tensor
// cores, f32 as plain fp32 FMAs: CUBLAS_COMPUTE_32F never takes TF32 unless asked), fp32 compute, fp32 output.
// Everything here is row-major [rows, ld]; cuBLAS is column-major, so each call computes C^T = op(B)^T op(A)^T
// with the operands swapped (spelled out at each call site in gemm.cu).
//
// Leading dimensions are whatever the caller padded to (multiples of 8 elements keep every row 16-byte
// aligned, which cuBLASLt's tensor-core kernels want); m, n and k may be any size. When cuBLASLt's heuristic
// offers no algorithm for a shape or alignment, the call falls back to cublasGemmEx, which handles every case.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>

namespace simpo::fused::cuda {

class Gemms {
 public:
  // `workspace` (device, `workspace_bytes`) is cuBLASLt's and cuBLAS's scratch: both stay inside the budget.
  Gemms(cudaStream_t stream, void* workspace, std::size_t workspace_bytes);
  ~Gemms();
  // Moves the scratch (a runner's workspace reallocated for another problem size) without making new handles:
  // cublasCreate costs milliseconds, and a sweep runs thousands of sizes. Cached algorithm choices are kept
  // while the scratch size is unchanged (they were chosen for it).
  void set_workspace(void* workspace, std::size_t workspace_bytes);
  Gemms(const Gemms&) = delete;
  Gemms& operator=(const Gemms&) = delete;

  // logits[rows, ld_logits] = x[rows, ld_h] weight[V, ld_h]^T, first V columns; k runs over ld_h (the
  // padding columns of x and weight are zero). k_splits > 1 cuts k into that many slices, one GEMM each, summed
  // in the fp32 epilogue (beta = 1): the tensor cores' fp32 accumulation rounds toward zero, a bias that grows
  // with the length of k (bench/gemm_accuracy.cu measures it), so slices of k/s leave ~1/s of it, for s - 1
  // extra passes over the fp32 logits.
  // T: __nv_bfloat16, __half or float (the operands' type; explicit instantiations in gemm.cu).
  template <class T>
  void logits(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const T* x, const T* weight, float* logits,
              std::int64_t ld_logits, int k_splits = 1);
  // grad_x[rows, ld_h] (+)= alpha dz[rows, V] weight[V, ld_h] (all ld_h columns; the padding ones come out zero);
  // accumulate: beta = 1 (the low-memory schedule sums it over slices of the vocabulary). alpha undoes a scaled dz
  // (CoefficientParams::dz_scale).
  template <class T>
  void grad_x(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const T* dz, std::int64_t ld_dz, const T* weight,
              float* grad_x, bool accumulate = false, float alpha = 1.0f);
  // grad_weight[V, ld_h] (+)= dz[rows, V]^T x[rows, ld_h]: the fp32 accumulator across chunks (beta = 1), or
  // its first term (beta = 0, `overwrite`), which saves clearing V*H*4 bytes beforehand.
  template <class T>
  void accumulate_grad_weight(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const T* dz, std::int64_t ld_dz,
                              const T* x, float* grad_weight, bool overwrite = false, float alpha = 1.0f);

  // How many calls took the cublasGemmEx fallback (tests and the benchmark report it).
  int fallback_calls() const { return fallback_calls_; }

 private:
  // Column-major C[m, n] (ldc) = alpha op(A) op(B) + beta C, A and B of cuBLAS type `type`.
  void gemm(cudaDataType type, bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k,
            const void* A, std::int64_t lda, const void* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc,
            float alpha = 1.0f);

  cudaStream_t stream_;
  void* workspace_;
  std::size_t workspace_bytes_;
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  // Heuristic answers per (type, transa, transb, m, n, k, lda, ldb, ldc, alignments): asking costs
  // tens of microseconds, and a run repeats the same few shapes chunk after chunk.
  using Key = std::tuple<int, bool, bool, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, int, int, int>;
  struct Choice {
    bool found = false;
    cublasLtMatmulAlgo_t algo{};
  };
  std::map<Key, Choice> choices_;
  int fallback_calls_ = 0;
};

}  // namespace simpo::fused::cuda
