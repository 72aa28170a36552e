// The row kernels the vocab-parallel step adds to the one-GPU cuda backend's (fused/cuda/kernels.h, which it
// also calls): a rank's partial row statistics over its shard of columns, their merge after the collectives, and
// the owner's target terms of grad_x before grad_x is reduced. All launches asynchronous on `stream`.
//
// Targets on a rank are shard-local (cuda_ranks.cu): t - shard.begin where the rank owns the target,
// kElsewhere where another rank does, kIgnored on ignored rows; so the one-GPU dz_kernel (LogitRows with
// ignore_index = kIgnored) writes its 0 only in the owner's target column and derives the same k on every rank.
#pragma once

#include "fused/cuda/kernels.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace simpo::fused::vocab_parallel {

inline constexpr std::int64_t kIgnored = -1, kElsewhere = -2;

// A chunk's per-row statistics buffers, indexed by the row's place in the chunk (0 .. rows-1). max and sum are
// reduced by the collectives in place; local_max keeps the rank's own max for the rescale.
struct ChunkStats {
  float* local_max;  // [rows] this rank's max over its columns
  float* max;        // [rows] -> all-reduce max: the row's max M
  float* sum_and_target;  // [2 * rows]: sum exp(z - max) (rescaled to M before the all-reduce sum), then at
                          // [rows + i] the raw target logit where this rank owns it, else 0
  double* rowsum;    // [rows] -> all-reduce sum: the row's sum of logits
  std::int64_t rows; // the chunk's rows (the stride of sum_and_target)
};

// Pass 1 on a rank, for one chunk part (`a`: the rank's logits, shard-local targets, a.V its shard's columns):
// the same online (max, sum exp) and double row sum per row as the one-GPU row_stats_kernel, written at chunk rows
// [at, at + a.rows).
void launch_shard_row_stats(const cuda::LogitRows& a, std::int64_t at, const ChunkStats&, cudaStream_t);
// After the all-reduce max: sum *= exp(local_max - M), so the ranks' sums share the row max M.
void launch_rescale_sums(const ChunkStats&, cudaStream_t);
// After the all-reduce sums, for one chunk part (global rows [row_begin, row_begin + rows) at chunk rows
// [at, ...)): the one-GPU backend's [N] row statistics relative to M (kernels.h's RowStats convention).
void launch_finish_stats(const ChunkStats&, std::int64_t at, std::int64_t rows, std::int64_t row_begin,
                         const std::int64_t* target, std::int64_t ignore_index, float* row_max, float* lse,
                         float* z_target, double* rowsum, cudaStream_t);
// Before the grad_x all-reduce, for one part: on rows whose target this rank owns, grad_x_part[row] +=
// target_coef[r] * weight[local target] in fp32 (the one-GPU grad_x_finish's term, before its rounding);
// own_coef[r] = target_coef[r] there and 0 elsewhere (launch_target_scatter's coefficient on this rank).
void launch_owner_target_terms(float* grad_x_part, std::int64_t rows, std::int64_t row_begin, std::int64_t H,
                               std::int64_t ld_h, const __nv_bfloat16* weight, const std::int64_t* local_target,
                               const float* target_coef, float* own_coef, cudaStream_t);

}  // namespace simpo::fused::vocab_parallel
