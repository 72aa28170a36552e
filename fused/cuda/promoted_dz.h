// The promoted logits GEMM (promoted_gemm.h, its default 128x192 tile) that stores dz instead of logits: its
// epilogue turns each accumulator into the row's softmax gradient while the tile is still in registers,
// dz[r, v] = -k_r exp((z[r, v] - row_max_r) - lse_r) with z = logit + bias, 0 in the target column (whose value
// travels in fp32 as target_coef, kernels.h) and on rows of k = 0, and CUTLASS's store writes it as bf16.
// dz_kernel computes the same from stored fp32 logits (the same expression, the same rounding). The low-memory
// schedule's backward runs it per tile (fused_runner.cu): no fp32 tile logits and no dz pass.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace simpo::fused::cuda {

// One GEMM's rows are global rows [row_begin, row_begin + rows) and its columns vocabulary columns
// [column_begin, column_begin + columns); the row arrays are indexed by global row.
struct DzTile {
  const __nv_bfloat16* bias = nullptr;   // [columns]: the slice's bias, or nullptr
  const std::int64_t* target = nullptr;  // [N]
  std::int64_t row_begin = 0;
  std::int64_t column_begin = 0;
  const float* row_max = nullptr;  // [N]
  const float* lse = nullptr;      // [N] log sum exp(z - row_max)
  const float* row_k = nullptr;    // [N] the row's coefficient (kernels.h, launch_row_coefficients)
  bool valid() const { return target != nullptr && row_max != nullptr && lse != nullptr && row_k != nullptr; }
};

// Built (CUTLASS, sm_90a) and the device runs it: promoted_logits_available().
bool promoted_dz_available();

// dz[rows, ld_dz] (bf16) = the softmax gradient of the logits x weight^T of `columns` columns, as above. columns
// must be a multiple of 8 (the bf16 TMA store's 16 bytes), ld_dz too. Throws CudaError when it cannot run.
void promoted_logits_dz(std::int64_t rows, std::int64_t columns, std::int64_t ld_h, const __nv_bfloat16* x,
                        const __nv_bfloat16* weight, __nv_bfloat16* dz, std::int64_t ld_dz,
                        std::int64_t promotion_k, const DzTile& tile, cudaStream_t stream, void* workspace,
                        std::size_t workspace_bytes);

}  // namespace simpo::fused::cuda
