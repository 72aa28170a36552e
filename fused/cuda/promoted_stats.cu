// The promoted logits GEMM with the row statistics in its epilogue (promoted_stats.h): register_epilogue.cuh's
// GEMM (promoted_gemm.cu's default mainloop) with StatsPass, which reduces each row of the accumulator tile in
// registers (a max, then one exp per logit against it, a sum; the four lanes sharing a row merge by shuffles; one
// lane per row writes the tile's partials), then stores nothing (ElementD = void: the forward) or each logit's
// 16-bit distance below its tile's max (the full step). The first version reduced inside an epilogue visitor node,
// one fragment at a time with an online (branching) max: slower than storing the logits and reading them back
// (BENCHMARKS.md, "Row statistics").
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/promoted_gemm.h"
#include "fused/cuda/promoted_stats.h"

#include <string>

#if defined(SIMPO_HAVE_CUTLASS_SM90)
#include "fused/cuda/register_epilogue.cuh"
#include "fused/simpo_math.h"
#endif

namespace simpo::fused::cuda {

#if defined(SIMPO_HAVE_CUTLASS_SM90)
namespace {

using namespace cute;
namespace m = ::simpo::fused::math;

// The row statistics straight from the accumulator registers in the wgmma layout: a thread holds two rows (r,
// r + 8) of each 64-row slab of its warpgroup, the same TileN / 4 columns of each, and the quad of lanes sharing
// those rows holds all TileN. Per row: the max of the thread's logits, a quad max by shuffles, then one exp per
// logit against that max, a sum of exp and a sum of z, merged across the quad; one lane writes the tile's partials.
//
// Why it is written as straight-line code: the pass runs on the mainloop's warps, two per scheduler, after the
// tile's MMAs and before the next tile's (CUTLASS's cooperative kernel), so its latency shows. A per-logit `if`
// (bias present, column inside N) made ptxas put every logit in its own branch with a convergence barrier, and the
// ~50-cycle dependent chain of each exp then ran one logit at a time (BENCHMARKS.md, "Row statistics"). Here the
// rows of a thread are reduced side by side, and the only branch left is around the target logit (rows whose
// target falls in this tile).
//
// kDistances: after the statistics, each accumulator becomes its logit distance below the row's tile max
// (promoted_stats.h), a whole number as a float that CUTLASS's store converts to uint16 exactly.
//
// kBias (a bias is added to each logit) and kMask (V is not a multiple of the tile width, so the last tile reaches
// past column N) are the host's choice, one kernel each: a kernel holding several reductions, or a bias value or a
// column held per logit across the passes, spills beside the accumulators. Both are applied in place first, so
// the passes read plain logits. A spill would cost the tensor cores' time (measured: BENCHMARKS.md, "Row
// statistics"); ctest promoted_stats_kernels_fit_registers holds every kernel here to none.
template <bool kDistances, bool kBias, bool kMask>
struct StatsPass {
  using Params = LogitTileStats;
  LogitTileStats stats;

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccTensor, class TiledMma>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK,
                                 TileCoordMNKL tile_coord_mnkl, AccTensor& acc, TiledMma tiled_mma,
                                 int thread_idx) const {
    constexpr int kRows = accumulator_rows<AccTensor>;
    constexpr int kTileN = decltype(size<1>(TileShapeMNK{}))::value;
    auto [M, N, K, L] = problem_shape_mnkl;
    auto [m_tile, n_tile, k_tile, l_tile] = tile_coord_mnkl;
    const int m0 = static_cast<int>(m_tile) * decltype(size<0>(TileShapeMNK{}))::value;
    const int n0 = static_cast<int>(n_tile) * kTileN;
    // A column inside N is one whose offset is below the thread's `limit` (AccumulatorCoordinates).
    const AccumulatorCoordinates<TiledMma, TileShapeMNK> place(tiled_mma, thread_idx, n0);
    const int limit = static_cast<int>(N) - place.first_column;
    auto column_of = [&](int c, int g, int mn) { return place.column(c, g, mn); };
    auto inside = [&](int c, int g, int mn) { return !kMask || place.offset(c, g, mn) < limit; };
    // The bias added in place and the columns past N set to -inf, a column at a time (the bias value and the
    // predicate die at once): the max and the exps below then read plain logits (exp(-inf - max) = 0), and only
    // the sum of z keeps a select (a real -inf logit must still reach it: SPEC's NaN/Inf rule reads the sums).
    if constexpr (kBias || kMask)
      for_each_accumulator_column(acc, [&](int c, int g, int mn) {
        const bool in = inside(c, g, mn);
        float b = 0.0f;
        if constexpr (kBias) b = in ? __bfloat162float(stats.bias[column_of(c, g, mn)]) : 0.0f;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kRows; ++i) {
          float& z = acc(accumulator_at(i, c, g, mn));
          z = in ? z + b : -INFINITY;
        }
      });
    auto logit = [&](int i, int c, int g, int mn) { return acc(accumulator_at(i, c, g, mn)); };

    int row[kRows];
    std::int64_t at[kRows];  // the row's index in target and z_target (LogitTileStats::split)
    std::int64_t target[kRows];
    float row_max[kRows], sum_exp[kRows], sum[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      row[i] = m0 + place.row(i);
      at[i] = row[i] + (row[i] >= stats.split ? stats.second : 0);
      // Loaded first: its latency hides behind the two passes.
      target[i] = row[i] < static_cast<int>(M) ? stats.target[at[i]] : stats.ignore_index;
      row_max[i] = -INFINITY;
      sum_exp[i] = sum[i] = 0.0f;
    }
    for_each_accumulator(acc, [&](int i, int c, int g, int mn) {
      row_max[i] = fmaxf(row_max[i], logit(i, c, g, mn));
    });
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = fmaxf(row_max[i], __shfl_xor_sync(0xffffffffu, row_max[i], 1));
      row_max[i] = fmaxf(row_max[i], __shfl_xor_sync(0xffffffffu, row_max[i], 2));
    }
    for_each_accumulator(acc, [&](int i, int c, int g, int mn) {
      const float z = logit(i, c, g, mn);
      // exp(z - max) by the SFU's 2^x alone (__expf), not expf's accurate range reduction, a third of the
      // instructions in the pass that the tensor cores wait for. Its error grows with |z - max|: the terms that
      // dominate the tile's sum (z near its max) keep near-fp32 accuracy, and the rest carry weights too small
      // to move lse by more than a fraction of the GEMM's own promotion bias.
      const float e = __expf(z - row_max[i]);
      sum_exp[i] += e;
      sum[i] += inside(c, g, mn) ? z : 0.0f;
    });
    const bool writer = (thread_idx % 4) == 0;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      double total = sum[i];
      sum_exp[i] += __shfl_xor_sync(0xffffffffu, sum_exp[i], 1);
      sum_exp[i] += __shfl_xor_sync(0xffffffffu, sum_exp[i], 2);
      total += __shfl_xor_sync(0xffffffffu, total, 1);
      total += __shfl_xor_sync(0xffffffffu, total, 2);
      if (writer && row[i] < static_cast<int>(M)) {
        const std::int64_t j = static_cast<std::int64_t>(n_tile) * stats.ld + row[i];
        stats.tile_max[j] = row_max[i];
        stats.tile_sum_exp[j] = sum_exp[i];
        stats.tile_sum[j] = total;
      }
    }
    // The target logit: one tile in the whole grid holds it, one thread of that tile writes it.
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const std::int64_t t = target[i];
      if (row[i] < static_cast<int>(M) && t != stats.ignore_index && t >= n0 && t < n0 + kTileN)
        for_each_accumulator(acc, [&](int j, int c, int g, int mn) {
          if (j == i && column_of(c, g, mn) == t) stats.z_target[at[i]] = logit(i, c, g, mn);
        });
    }
    // Last, since the logits above read the accumulators. Columns past N are computed too; the store drops them.
    if constexpr (kDistances)
      for_each_accumulator(acc, [&](int i, int c, int g, int mn) {
        acc(accumulator_at(i, c, g, mn)) = m::logit_distance(row_max[i], logit(i, c, g, mn));
      });
  }
};

// No output at all (the forward, the low-memory schedule's statistics) or the logit distances (the full step); each
// with and without a bias and a partial last tile (StatsPass).
template <bool kB, bool kM> using StatsOnlyGemm = RegisterEpilogueGemm<StatsPass<false, kB, kM>, void, 4>;
template <bool kB, bool kM> using DistancesGemm = RegisterEpilogueGemm<StatsPass<true, kB, kM>, std::uint16_t, 8>;
static_assert(cute::size<1>(StatsOnlyGemm<false, false>::TileShape{}) == statistics_tile_columns &&
                  statistics_tile_columns == m::logit_distance_tile,
              "the partials' tiles, and the distances' tiles (the cpu backend's too), are the GEMM's column tiles");

}  // namespace

bool promoted_stats_available() { return promoted_logits_available(); }

namespace {
// What both statistics GEMMs check before they run; `what` names the GEMM in the errors.
void check_statistics_gemm(const char* what, std::int64_t rows, std::int64_t promotion_k, const LogitTileStats& stats) {
  if (promotion_k < 0 || promotion_k % promotion_k_granule != 0)
    throw CudaError(std::string(what) + ": promotion_k " + std::to_string(promotion_k) + " is not a multiple of " +
                    std::to_string(promotion_k_granule));
  if (stats.ld < rows)
    throw CudaError(std::string(what) + ": ld " + std::to_string(stats.ld) + " < rows " + std::to_string(rows));
}

// The kernel for a bias or none, and for a last tile reaching past V or none (StatsPass).
template <template <bool, bool> class Gemm>
auto pick(std::int64_t V, const LogitTileStats& stats) {
  const bool bias = stats.bias != nullptr, mask = V % statistics_tile_columns != 0;
  return bias ? (mask ? Gemm<true, true>::run : Gemm<true, false>::run)
              : (mask ? Gemm<false, true>::run : Gemm<false, false>::run);
}
}  // namespace

void promoted_logits_stats(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                           const __nv_bfloat16* weight, std::int64_t promotion_k, const LogitTileStats& stats,
                           cudaStream_t stream, void* workspace, std::size_t workspace_bytes) {
  if (rows == 0 || V == 0) return;
  constexpr const char* what = "promoted logits GEMM with statistics";
  check_statistics_gemm(what, rows, promotion_k, stats);
  if (V % 4 != 0) throw CudaError(std::string(what) + ": V = " + std::to_string(V) + " is not a multiple of 4");
  pick<StatsOnlyGemm>(V, stats)(what, rows, V, ld_h, x, weight, nullptr, V, promotion_k, stats, stream, workspace,
                                workspace_bytes);
}

void promoted_logits_distances(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                               const __nv_bfloat16* weight, std::uint16_t* distances, std::int64_t ld_distances,
                               std::int64_t promotion_k, const LogitTileStats& stats, cudaStream_t stream,
                               void* workspace, std::size_t workspace_bytes) {
  if (rows == 0 || V == 0) return;
  constexpr const char* what = "promoted logits GEMM with distances";
  check_statistics_gemm(what, rows, promotion_k, stats);
  if (V % 8 != 0 || ld_distances % 8 != 0 || ld_distances < V)
    throw CudaError(std::string(what) + ": V = " + std::to_string(V) + " and ld " + std::to_string(ld_distances) +
                    " must be multiples of 8, ld >= V");
  pick<DistancesGemm>(V, stats)(what, rows, V, ld_h, x, weight, distances, ld_distances, promotion_k, stats, stream,
                                workspace, workspace_bytes);
}

#else  // without CUTLASS or an sm_90a target: the runner keeps the separate statistics pass

bool promoted_stats_available() { return false; }
void promoted_logits_stats(std::int64_t, std::int64_t, std::int64_t, const __nv_bfloat16*, const __nv_bfloat16*,
                           std::int64_t, const LogitTileStats&, cudaStream_t, void*, std::size_t) {
  throw CudaError("promoted logits GEMM with statistics: not built (needs CUTLASS and an sm_90a target)");
}
void promoted_logits_distances(std::int64_t, std::int64_t, std::int64_t, const __nv_bfloat16*, const __nv_bfloat16*,
                               std::uint16_t*, std::int64_t, std::int64_t, const LogitTileStats&, cudaStream_t, void*,
                               std::size_t) {
  throw CudaError("promoted logits GEMM with distances: not built (needs CUTLASS and an sm_90a target)");
}

#endif

}  // namespace simpo::fused::cuda
