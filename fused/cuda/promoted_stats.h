// The promoted logits GEMM (promoted_gemm.h, its default 128x192 tile) with the row statistics reduced in its
// epilogue while each logits tile is still in registers: per row and per 192-column tile, the max, the sum of
// exp(z - that max) and the sum of z, plus the target logit; merge_tile_stats (kernels.h) folds the tiles of a
// row into fused/forward_outputs.h's RowStats. The forward then never writes fp32 logits (`logits` = nullptr:
// a GEMM with no output but the statistics); the full step still stores them for dz, and drops the separate
// statistics pass that read them back.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "fused/cuda/plan.h"

#include <cstddef>
#include <climits>
#include <cstdint>

namespace simpo::fused::cuda {

// Where the epilogue puts one GEMM's statistics. Partial arrays are [tiles, ld] (row fastest: a warp's writes
// and the merge's reads are coalesced); the GEMM's row m lands at column m.
struct LogitTileStats {
  const __nv_bfloat16* bias = nullptr;   // [V] or nullptr: added to every logit for the statistics only
  const std::int64_t* target = nullptr;  // [rows] the GEMM's rows' targets
  std::int64_t ignore_index = -100;
  std::int64_t ld = 0;                   // >= rows
  float* tile_max = nullptr;             // [tiles, ld] the row's max over the tile's columns
  float* tile_sum_exp = nullptr;         // [tiles, ld] sum of exp(z - tile_max)
  double* tile_sum = nullptr;            // [tiles, ld] sum of z
  float* z_target = nullptr;             // [rows] z at the target (bias added); untouched where ignored
  // A GEMM over two row ranges stacked (a three_pass chunk's chosen and rejected rows, gathered): GEMM rows at or
  // past `split` are `second` rows further on in target and z_target. One GEMM over the chunk instead of one per
  // part: W streams through once per chunk, and the larger M fills the last wave better.
  std::int64_t split = INT64_MAX, second = 0;
  bool valid() const {
    return target != nullptr && tile_max != nullptr && tile_sum_exp != nullptr && tile_sum != nullptr &&
           z_target != nullptr;
  }
};

// Built (CUTLASS, sm_90a) and the device runs it: promoted_logits_available().
bool promoted_stats_available();

// The statistics of x weight^T (the logits promoted_logits computes, bit for bit) into `stats`, no logits
// stored. V must be a multiple of 4 (the promoted GEMM's column unit; the runner keeps the separate statistics
// pass otherwise). Throws CudaError when it cannot run the shape.
void promoted_logits_stats(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                           const __nv_bfloat16* weight, std::int64_t promotion_k, const LogitTileStats& stats,
                           cudaStream_t stream, void* workspace, std::size_t workspace_bytes);

// Logit distances (fused/simpo_math.h, "logit distances"): what the full step's dz needs of a logit, in 16 bits.
// After the statistics, each logit z (bias included) is stored as math::logit_distance(m, z), its distance below
// m, its row's max over the tile (`tile_max`, which the statistics write anyway); dz_from_distances (kernels.h) reads
// z back from it. Half the bytes of fp32 logits: half the store, half dz's read, no separate statistics pass, and
// twice the rows per chunk in the same memory (README, "Logit distances").
// distances[rows, ld_distances] (uint16, V columns; V and ld_distances multiples of 8: the TMA store's 16 bytes) and
// the statistics into `stats`, from one promoted logits GEMM. Throws CudaError when it cannot run the shape.
void promoted_logits_distances(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                               const __nv_bfloat16* weight, std::uint16_t* distances, std::int64_t ld_distances,
                               std::int64_t promotion_k, const LogitTileStats& stats, cudaStream_t stream,
                               void* workspace, std::size_t workspace_bytes);

}  // namespace simpo::fused::cuda
