// The promoted logits GEMM with the row statistics in its epilogue (promoted_stats.h): register_epilogue.cuh's
// GEMM (promoted_gemm.cu's default mainloop) with StatsPass, which reduces each row of the accumulator tile in
// registers (a max, then one exp per logit against it, a sum; the four lanes sharing a row merge by shuffles; one
// lane per row writes the tile's partials) before CUTLASS's store of the fp32 logits, or no store at all (ElementD
// = void) for the forward. The first version reduced inside an epilogue visitor node, one fragment at a time with
// an online (branching) max: slower than storing the logits and reading them back (BENCHMARKS.md, second round).
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
// r + 8) of its warpgroup's 64-row slab, the same TileN / 4 columns of each, and the quad of lanes sharing those
// rows holds all TileN. Per row: the max of the
// thread's logits, a quad max by shuffles, then one exp per logit against that max, a sum of exp and a sum of
// z, merged across the quad; no per-logit branch, no online rescaling, and the coordinates are constants added
// to one base. The visitor loop of CUTLASS's store then stores the fp32 logits unchanged, or nothing (void D).
struct StatsPass {
  using Params = LogitTileStats;
  LogitTileStats stats;

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccTensor, class TiledMma>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                                 TileCoordMNKL tile_coord_mnkl, AccTensor const& acc, TiledMma tiled_mma,
                                 int thread_idx) const {
    // acc: ((2 columns, 2 rows, TileN / 8 column groups), MMA_M, MMA_N), wgmma's F32 accumulator layout.
    static_assert(decltype(rank<0>(acc))::value == 3 && decltype(size<0, 0>(acc))::value == 2 &&
                      decltype(size<0, 1>(acc))::value == 2,
                  "StatsPass: not the wgmma accumulator layout");
    constexpr int kGroups = decltype(size<0, 2>(acc))::value;
    constexpr int kMmaM = decltype(size<1>(acc))::value, kMmaN = decltype(size<2>(acc))::value;
    constexpr int kTileN = decltype(size<1>(tile_shape_MNK))::value;
    auto [M, N, K, L] = problem_shape_mnkl;
    auto [m_tile, n_tile, k_tile, l_tile] = tile_coord_mnkl;
    const int m0 = static_cast<int>(m_tile) * decltype(size<0>(tile_shape_MNK))::value;
    const int n0 = static_cast<int>(n_tile) * kTileN;
    // (row, column) of every accumulator inside the tile.
    auto coords = tiled_mma.get_thread_slice(thread_idx)
                      .partition_C(make_identity_tensor(make_shape(size<0>(tile_shape_MNK), size<1>(tile_shape_MNK))));
    const bool whole_columns = n0 + kTileN <= static_cast<int>(N);  // edge tiles mask columns >= N
    const __nv_bfloat16* bias = stats.bias;
    const bool writer = (thread_idx % 4) == 0;

    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        auto at = [&](int c, int g, int mn) { return make_coord(make_coord(c, r, g), mm, mn); };
        const int row = m0 + static_cast<int>(get<0>(coords(at(0, 0, 0))));
        // Loaded first: its latency hides behind the two passes.
        const std::int64_t t = row < static_cast<int>(M) ? stats.target[row] : stats.ignore_index;
        auto logit = [&](int c, int g, int mn, int& column) {
          column = n0 + static_cast<int>(get<1>(coords(at(c, g, mn))));
          float z = acc(at(c, g, mn));
          if (bias != nullptr) z += __bfloat162float(bias[column < static_cast<int>(N) ? column : 0]);
          return z;
        };
        float row_max = -INFINITY;
        CUTLASS_PRAGMA_UNROLL
        for (int mn = 0; mn < kMmaN; ++mn)
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < kGroups; ++g)
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < 2; ++c) {
              int column;
              const float z = logit(c, g, mn, column);
              if (whole_columns || column < static_cast<int>(N)) row_max = fmaxf(row_max, z);
            }
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));

        float sum_exp = 0.0f, sum = 0.0f;
        CUTLASS_PRAGMA_UNROLL
        for (int mn = 0; mn < kMmaN; ++mn)
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < kGroups; ++g)
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < 2; ++c) {
              int column;
              const float z = logit(c, g, mn, column);
              if (whole_columns || column < static_cast<int>(N)) {
                sum_exp += m::exp_(z - row_max);
                sum += z;
              }
            }
        double total = sum;
        sum_exp += __shfl_xor_sync(0xffffffffu, sum_exp, 1);
        sum_exp += __shfl_xor_sync(0xffffffffu, sum_exp, 2);
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        if (row >= static_cast<int>(M)) continue;

        // The target logit: one tile in the whole grid holds it, one thread of that tile writes it.
        if (t != stats.ignore_index && t >= n0 && t < n0 + kTileN) {
          CUTLASS_PRAGMA_UNROLL
          for (int mn = 0; mn < kMmaN; ++mn)
            CUTLASS_PRAGMA_UNROLL
            for (int g = 0; g < kGroups; ++g)
              CUTLASS_PRAGMA_UNROLL
              for (int c = 0; c < 2; ++c) {
                int column;
                const float z = logit(c, g, mn, column);
                if (column == t) stats.z_target[row] = z;
              }
        }
        if (writer) {
          const std::int64_t i = static_cast<std::int64_t>(n_tile) * stats.ld + row;
          stats.tile_max[i] = row_max;
          stats.tile_sum_exp[i] = sum_exp;
          stats.tile_sum[i] = total;
        }
      }
    }
  }
};

// The fp32 logits stored after the statistics (the full step), or no output at all (the forward).
using StatsGemm = RegisterEpilogueGemm<StatsPass, float, 4>;
using StatsOnlyGemm = RegisterEpilogueGemm<StatsPass, void, 4>;

}  // namespace

bool promoted_stats_available() { return promoted_logits_available(); }
std::int64_t promoted_stats_tiles(std::int64_t V) { return (V + 191) / 192; }

void promoted_logits_stats(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                           const __nv_bfloat16* weight, float* logits, std::int64_t ld_logits,
                           std::int64_t promotion_k, const LogitTileStats& stats, cudaStream_t stream,
                           void* workspace, std::size_t workspace_bytes) {
  if (rows == 0 || V == 0) return;
  if (promotion_k < 0 || promotion_k % promoted_k_granule != 0)
    throw CudaError("promoted logits GEMM: promotion_k " + std::to_string(promotion_k) + " is not a multiple of " +
                    std::to_string(promoted_k_granule));
  if (V % 4 != 0)
    throw CudaError("promoted logits GEMM with statistics: V = " + std::to_string(V) + " is not a multiple of 4");
  if (stats.ld < rows)
    throw CudaError("promoted logits GEMM with statistics: ld " + std::to_string(stats.ld) + " < rows " +
                    std::to_string(rows));
  constexpr const char* what = "promoted logits GEMM with statistics";
  if (logits != nullptr)
    StatsGemm::run(what, rows, V, ld_h, x, weight, logits, ld_logits, promotion_k, stats, stream, workspace,
                   workspace_bytes);
  else
    StatsOnlyGemm::run(what, rows, V, ld_h, x, weight, nullptr, V, promotion_k, stats, stream, workspace,
                       workspace_bytes);
}

#else  // without CUTLASS or an sm_90a target: the runner keeps the separate statistics pass

bool promoted_stats_available() { return false; }
std::int64_t promoted_stats_tiles(std::int64_t V) { return (V + 191) / 192; }
void promoted_logits_stats(std::int64_t, std::int64_t, std::int64_t, const __nv_bfloat16*, const __nv_bfloat16*,
                           float*, std::int64_t, std::int64_t, const LogitTileStats&, cudaStream_t, void*,
                           std::size_t) {
  throw CudaError("promoted logits GEMM with statistics: not built (needs CUTLASS and an sm_90a target)");
}

#endif

}  // namespace simpo::fused::cuda
