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

#include "fused/cuda/plan.h"

#include <cstddef>
#include <cstdint>

namespace simpo::fused::cuda {

// Built with the sm_90a kernels, and the current device runs them (compute capability 9.0).
bool promoted_logits_available();
// Built with the sm_90a kernels (CUTLASS found at configure time), whatever the device.
bool promoted_kernels_built();

// Enqueues the GEMM on `stream`. Requirements (the fused runner's layout meets them): ld_h and ld_logits
// multiples of 8, x, weight and logits 16-byte aligned, promotion_k a multiple of promotion_k_granule.
// `workspace` (workspace_bytes) is the kernel's scratch. Throws CudaError when the
// kernel cannot run the shape or was not built.
void promoted_logits(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                     const __nv_bfloat16* weight, float* logits, std::int64_t ld_logits, std::int64_t promotion_k,
                     cudaStream_t stream, void* workspace, std::size_t workspace_bytes);

}  // namespace simpo::fused::cuda
