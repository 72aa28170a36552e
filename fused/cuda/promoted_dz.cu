// The promoted logits GEMM storing dz (promoted_dz.h): register_epilogue.cuh's GEMM (promoted_gemm.cu's default
// mainloop) with DzPass, which rewrites the accumulator tile in registers, each logit into its dz (the row's max,
// lse and coefficient loaded once per row; a thread holds two rows of its warpgroup's 64), so CUTLASS's store
// converts and writes bf16 dz rather than logits.
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/promoted_dz.h"
#include "fused/cuda/promoted_gemm.h"

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

// Per accumulator: z = logit + bias, then 0 at the target column and on rows of k = 0, else dz_kernel's
// -k exp((z - row_max) - lse) (m::softmax_gradient), left in the register for the store to round to bf16.
// Straight-line code that fits the registers, for the reasons promoted_stats.cu gives: the bias is the host's
// choice, one kernel each, added in place a column at a time; a thread's columns are its first column plus offsets
// every thread shares (constants once unrolled), so the target test compares a constant with one register per row;
// rows past M read row M - 1's values (the store masks them), and the zeros are selects, so no logit sits in a
// branch of its own and the exps of a thread's 96 logits overlap.
template <bool kBias>
struct DzPass {
  using Params = DzTile;
  DzTile dz;

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccTensor, class TiledMma>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK,
                                 TileCoordMNKL tile_coord_mnkl, AccTensor& acc, TiledMma tiled_mma,
                                 int thread_idx) const {
    constexpr int kRows = accumulator_rows<AccTensor>;
    auto [M, N, K, L] = problem_shape_mnkl;
    auto [m_tile, n_tile, k_tile, l_tile] = tile_coord_mnkl;
    const int m0 = static_cast<int>(m_tile) * decltype(size<0>(TileShapeMNK{}))::value;
    const int n0 = static_cast<int>(n_tile) * decltype(size<1>(TileShapeMNK{}))::value;
    const AccumulatorCoordinates<TiledMma, TileShapeMNK> place(tiled_mma, thread_idx, n0);

    float k[kRows], shift[kRows], row_lse[kRows];
    std::int64_t t[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int row = m0 + place.row(i);
      const std::int64_t global = dz.row_begin + (row < static_cast<int>(M) ? row : static_cast<int>(M) - 1);
      k[i] = dz.row_k[global];
      shift[i] = dz.row_max[global];
      row_lse[i] = dz.lse[global];
      // The target's offset among this thread's columns (maybe outside them): 0 there, its value is target_coef's.
      t[i] = dz.target[global] - dz.column_begin - place.first_column;
    }
    if constexpr (kBias)
      for_each_accumulator_column(acc, [&](int c, int g, int mn) {
        const int column = place.column(c, g, mn);
        const float b = column < static_cast<int>(N) ? __bfloat162float(dz.bias[column]) : 0.0f;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kRows; ++i) acc(accumulator_at(i, c, g, mn)) += b;
      });
    for_each_accumulator(acc, [&](int i, int c, int g, int mn) {
      float& z = acc(accumulator_at(i, c, g, mn));
      const float gradient = m::softmax_gradient(k[i], z - shift[i], row_lse[i]);
      // k == 0 (ignored rows, empty sequences): a zero row, as in dz_kernel (the select also drops the
      // exponential's value there, whatever the row's statistics are)
      z = (k[i] == 0.0f || place.offset(c, g, mn) == t[i]) ? 0.0f : gradient;
    });
  }
};

template <bool kBias> using DzGemm = RegisterEpilogueGemm<DzPass<kBias>, cutlass::bfloat16_t, 8>;

}  // namespace

bool promoted_dz_available() { return promoted_logits_available(); }

void promoted_logits_dz(std::int64_t rows, std::int64_t columns, std::int64_t ld_h, const __nv_bfloat16* x,
                        const __nv_bfloat16* weight, __nv_bfloat16* dz, std::int64_t ld_dz,
                        std::int64_t promotion_k, const DzTile& tile, cudaStream_t stream, void* workspace,
                        std::size_t workspace_bytes) {
  if (rows == 0 || columns == 0) return;
  if (promotion_k < 0 || promotion_k % promotion_k_granule != 0)
    throw CudaError("promoted dz GEMM: promotion_k " + std::to_string(promotion_k) + " is not a multiple of " +
                    std::to_string(promotion_k_granule));
  if (columns % 8 != 0 || ld_dz % 8 != 0 || ld_dz < columns)
    throw CudaError("promoted dz GEMM: columns " + std::to_string(columns) + " and ld_dz " + std::to_string(ld_dz) +
                    " must be multiples of 8, ld_dz >= columns");
  if (!tile.valid()) throw CudaError("promoted dz GEMM: a row array or the targets are missing");
  (tile.bias != nullptr ? DzGemm<true>::run : DzGemm<false>::run)("promoted dz GEMM", rows, columns, ld_h, x, weight,
                                                                   dz, ld_dz, promotion_k, tile, stream, workspace,
                                                                   workspace_bytes);
}

#else  // without CUTLASS or an sm_90a target: the low-memory schedule's dz comes from dz_kernel

bool promoted_dz_available() { return false; }
void promoted_logits_dz(std::int64_t, std::int64_t, std::int64_t, const __nv_bfloat16*, const __nv_bfloat16*,
                        __nv_bfloat16*, std::int64_t, std::int64_t, const DzTile&, cudaStream_t, void*, std::size_t) {
  throw CudaError("promoted dz GEMM: not built (needs CUTLASS and an sm_90a target)");
}

#endif

}  // namespace simpo::fused::cuda
