// The low-memory schedule's grad_x GEMM: an fp32 accumulator that every vocabulary slice adds into,
//
//   acc[rows, N] (+)= dz[rows, K] w[K, N]     (dz: a tile's bf16 dz, K its slice columns; w: the slice's weight rows)
//
// as a CUTLASS sm_90a ping-pong kernel: each of its two consumer warpgroups owns a tile, and one's epilogue (the
// accumulator's 8 bytes per element read and written) runs while the other's MMAs do. A cooperative kernel, as
// cuBLASLt's, stops its MMAs for the epilogue; with K a slice's few thousand columns the read-modify-write is a large
// share of each tile (fused/cuda/BENCHMARKS.md).
//
// sm_90a only; built when CMake finds CUTLASS. Elsewhere accumulate_gemm_available() is false and the runner keeps
// cuBLASLt (gemm.h: Gemms::grad_x).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace simpo::fused::cuda {

// Built with the sm_90a kernels and the current device runs them (compute capability 9.0).
bool accumulate_gemm_available();

// Whether the kernel takes these strides and extents (TMA: 16-byte rows, so K, N and every leading dimension in
// whole 16-byte groups, pointers 16-byte aligned). Where it does not, the caller takes cuBLASLt.
bool accumulate_gemm_fits(std::int64_t K, std::int64_t N, std::int64_t ld_dz, std::int64_t ld_w, std::int64_t ld_acc,
                          const void* dz, const void* w, const void* acc);

// acc[rows, N] (row-major, ld_acc) = dz[rows, K] w[K, N] (`overwrite`: acc not read) or acc + that. dz row-major
// [rows, ld_dz], w row-major [K, ld_w]. fp32 tensor-core accumulation over K, then one fp32 add into acc. Throws
// CudaError when it cannot run the shape (accumulate_gemm_fits) or was not built.
void accumulate_grad_x(std::int64_t rows, std::int64_t K, std::int64_t N, const __nv_bfloat16* dz, std::int64_t ld_dz,
                       const __nv_bfloat16* w, std::int64_t ld_w, float* acc, std::int64_t ld_acc, bool overwrite,
                       cudaStream_t stream);

}  // namespace simpo::fused::cuda
