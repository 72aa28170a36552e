// The logits GEMM that promotes: logits[rows, ld_logits] (fp32) = x[rows, ld_h] weight[V, ld_h]^T (bf16), where
// each `promotion_k`-wide block of the reduction is accumulated by the tensor cores in a fresh accumulator and
// then added into fp32 registers with ordinary FADDs (round to nearest). The tensor cores' own fp32
// accumulation truncates (a bias toward zero that grows with k: bench/gemm_accuracy.cu), so promoting every
// 128-256 k keeps only the bias of one short block, in one GEMM and with no extra pass over the logits.
//
// sm_90a only (wgmma + TMA, CUTLASS 3's Hopper mainloop with the promotion of its FP8 collective, instantiated
// with bf16 operands): compiled when CMake finds CUTLASS (SIMPO_CUTLASS_DIR), and used only on a device of
// compute capability 9.0. Everywhere else promoted_logits_available() is false and the caller keeps the
// sliced cuBLAS path (Gemms::logits with k_splits).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace simpo::fused::cuda {

// Built with the sm_90a kernels, and the current device runs them (compute capability 9.0).
bool promoted_logits_available();

// Compiled variants (tile shapes, clusters), for the benchmark; variant 0 is the default.
int promoted_variant_count();
const char* promoted_variant_name(int variant);

// The multiple `promotion_k` must be of (the mainloop's k tile); promotion_k = 0 means "never promote" (one
// tensor-core accumulation over all of k, as cuBLAS does; for measuring what promotion costs).
inline constexpr std::int64_t promoted_k_granule = 64;

// The tile scheduler's run-time knobs (CUTLASS's persistent scheduler): consecutive tiles grouped `swizzle`
// (1, 2, 4, 8) at a time, and the order tiles are visited in.
struct PromotedSchedule {
  int variant = 0;
  int swizzle = 1;
  enum class Raster { heuristic, along_m, along_n } raster = Raster::heuristic;
};

// Enqueues the GEMM on `stream`. Requirements (the fused runner's layout meets them): ld_h and ld_logits
// multiples of 8, x, weight and logits 16-byte aligned, promotion_k a multiple of promoted_k_granule.
// `workspace` (workspace_bytes) is the kernel's scratch (promoted_workspace_bytes). Throws CudaError when the
// kernel cannot run the shape or was not built.
void promoted_logits(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                     const __nv_bfloat16* weight, float* logits, std::int64_t ld_logits, std::int64_t promotion_k,
                     cudaStream_t stream, void* workspace, std::size_t workspace_bytes,
                     const PromotedSchedule& = {});
std::size_t promoted_workspace_bytes(std::int64_t rows, std::int64_t V, std::int64_t ld_h, int variant = 0);

}  // namespace simpo::fused::cuda
