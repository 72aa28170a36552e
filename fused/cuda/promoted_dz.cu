// The promoted logits GEMM storing dz (promoted_dz.h). Mainloop: promoted_gemm.cu's default (128x192x64 tile,
// staggered promotion, promoted_mainloop.cuh). Epilogue: CUTLASS's TMA warp-specialized one with bf16 D,
// entered through DzEpilogue, which first rewrites the accumulator tile in registers, each logit into its dz
// (the row's max, lse and coefficient loaded once per row; a thread holds two rows of its warpgroup's 64), so
// CUTLASS's store converts and writes dz rather than logits. Its parameters ride on an EpilogueParams node.
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/promoted_dz.h"
#include "fused/cuda/promoted_gemm.h"

#include <string>

#if defined(SIMPO_HAVE_CUTLASS_SM90)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "fused/cuda/epilogue_params.cuh"
#include "fused/cuda/promoted_mainloop.cuh"
#include "fused/simpo_math.h"
#endif

namespace simpo::fused::cuda {

#if defined(SIMPO_HAVE_CUTLASS_SM90)
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;
namespace m = ::simpo::fused::math;

template <class Base>
struct DzEpilogue : Base {
  DzTile dz;
  CUTLASS_HOST_DEVICE DzEpilogue(typename Base::Params const& params, typename Base::TensorStorage& storage)
      : Base(params, storage), dz(params.thread.op_1) {}

  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState, class ProblemShapeMNKL,
            class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout, class TiledMma>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadState load_state, StorePipeline store_pipeline,
                            StoreState store_state, ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, typename Base::TensorStorage& shared_tensors,
                            int subtile_idx = -1) {
    to_dz(problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, accumulators, tiled_mma, thread_idx);
    return Base::store(load_pipeline, load_state, store_pipeline, store_state, problem_shape_mnkl, tile_shape_MNK,
                       tile_coord_mnkl, accumulators, tiled_mma, thread_idx, shared_tensors, subtile_idx);
  }

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccTensor, class TiledMma>
  CUTLASS_DEVICE void to_dz(ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, AccTensor& acc, TiledMma tiled_mma, int thread_idx) {
    // acc: ((2 columns, 2 rows, TileN / 8 column groups), MMA_M, MMA_N), wgmma's F32 accumulator layout.
    static_assert(decltype(rank<0>(acc))::value == 3 && decltype(size<0, 0>(acc))::value == 2 &&
                      decltype(size<0, 1>(acc))::value == 2,
                  "DzEpilogue: not the wgmma accumulator layout");
    constexpr int kGroups = decltype(size<0, 2>(acc))::value;
    constexpr int kMmaM = decltype(size<1>(acc))::value, kMmaN = decltype(size<2>(acc))::value;
    auto [M, N, K, L] = problem_shape_mnkl;
    auto [m_tile, n_tile, k_tile, l_tile] = tile_coord_mnkl;
    const int m0 = static_cast<int>(m_tile) * decltype(size<0>(tile_shape_MNK))::value;
    const int n0 = static_cast<int>(n_tile) * decltype(size<1>(tile_shape_MNK))::value;
    auto coords = tiled_mma.get_thread_slice(thread_idx)
                      .partition_C(make_identity_tensor(make_shape(size<0>(tile_shape_MNK), size<1>(tile_shape_MNK))));
    const __nv_bfloat16* bias = dz.bias;

    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        auto at = [&](int c, int g, int mn) { return make_coord(make_coord(c, r, g), mm, mn); };
        const int row = m0 + static_cast<int>(get<0>(coords(at(0, 0, 0))));
        if (row >= static_cast<int>(M)) continue;  // the store masks these rows
        const std::int64_t global = dz.row_begin + row;
        const float k = dz.row_k[global], shift = dz.row_max[global], row_lse = dz.lse[global];
        // The target's column in this GEMM (maybe outside it): 0 there, its value is target_coef's.
        const std::int64_t t = dz.target[global] - dz.column_begin;
        CUTLASS_PRAGMA_UNROLL
        for (int mn = 0; mn < kMmaN; ++mn)
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < kGroups; ++g)
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < 2; ++c) {
              const int column = n0 + static_cast<int>(get<1>(coords(at(c, g, mn))));
              float z = acc(at(c, g, mn));
              if (bias != nullptr) z += __bfloat162float(bias[column < static_cast<int>(N) ? column : 0]);
              // k == 0 (ignored rows, empty sequences): a zero row, no exponentials, as in dz_kernel
              acc(at(c, g, mn)) = (k == 0.0f || column == t) ? 0.0f : m::softmax_gradient(k, z - shift, row_lse);
            }
      }
    }
  }
};

struct DzGemm {
  using TileShape = cute::Shape<_128, _192, _64>;  // promoted_gemm.cu's variant 0
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using Element = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Callbacks = fusion::Sm90EVT<EpilogueParams<DzTile>, fusion::Sm90AccFetch>;

  using StockEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, 8, Element, LayoutD, 8,
      cutlass::epilogue::TmaWarpSpecializedCooperative, Callbacks>::CollectiveOp;
  using Epilogue = DzEpilogue<StockEpilogue>;

  using Plain = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Mainloop = StaggeredMainloop<PromotingCollective<Plain, TileShape, ClusterShape, Schedule>>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kMmaK = 16;
  static_assert(size<2>(TileShape{}) == promoted_k_granule, "promoted_k_granule is the k tile");

  static void run(std::int64_t rows, std::int64_t columns, std::int64_t ld_h, const __nv_bfloat16* x,
                  const __nv_bfloat16* weight, __nv_bfloat16* out, std::int64_t ld_dz, std::int64_t promotion_k,
                  const DzTile& tile, cudaStream_t stream, void* workspace, std::size_t workspace_bytes) {
    const std::uint32_t interval =
        promotion_k > 0 ? static_cast<std::uint32_t>(promotion_k / kMmaK) : (std::uint32_t{1} << 30);
    typename Plain::StrideA stride_a{ld_h, Int<1>{}, 0};
    typename Plain::StrideB stride_b{ld_h, Int<1>{}, 0};
    typename Epilogue::StrideD stride_d{ld_dz, Int<1>{}, 0};
    static const int sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    cutlass::KernelHardwareInfo hw{0, sm_count};
    cudaGetDevice(&hw.device_id);
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(rows), static_cast<int>(columns), static_cast<int>(ld_h), 1},
        {reinterpret_cast<const Element*>(x), stride_a, reinterpret_cast<const Element*>(weight), stride_b, interval},
        {{{}, tile}, nullptr, stride_d, reinterpret_cast<Element*>(out), stride_d},
        hw};
    args.scheduler.max_swizzle_size = 1;
    Gemm gemm;
    if (Gemm::get_workspace_size(args) > workspace_bytes)
      throw CudaError("promoted dz GEMM: needs " + std::to_string(Gemm::get_workspace_size(args)) +
                      " bytes of scratch, has " + std::to_string(workspace_bytes));
    cutlass::Status status = gemm.can_implement(args);
    if (status != cutlass::Status::kSuccess)
      throw CudaError(std::string("promoted dz GEMM cannot run rows=") + std::to_string(rows) + " columns=" +
                      std::to_string(columns) + " ld_h=" + std::to_string(ld_h) + ": " +
                      cutlass::cutlassGetStatusString(status));
    status = gemm.initialize(args, workspace, stream);
    if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
    if (status != cutlass::Status::kSuccess)
      throw CudaError(std::string("promoted dz GEMM: ") + cutlass::cutlassGetStatusString(status));
    SIMPO_CUDA_CHECK_LAUNCH();
  }
};

}  // namespace

bool promoted_dz_available() { return promoted_logits_available(); }

void promoted_logits_dz(std::int64_t rows, std::int64_t columns, std::int64_t ld_h, const __nv_bfloat16* x,
                        const __nv_bfloat16* weight, __nv_bfloat16* dz, std::int64_t ld_dz,
                        std::int64_t promotion_k, const DzTile& tile, cudaStream_t stream, void* workspace,
                        std::size_t workspace_bytes) {
  if (rows == 0 || columns == 0) return;
  if (promotion_k < 0 || promotion_k % promoted_k_granule != 0)
    throw CudaError("promoted dz GEMM: promotion_k " + std::to_string(promotion_k) + " is not a multiple of " +
                    std::to_string(promoted_k_granule));
  if (columns % 8 != 0 || ld_dz % 8 != 0 || ld_dz < columns)
    throw CudaError("promoted dz GEMM: columns " + std::to_string(columns) + " and ld_dz " + std::to_string(ld_dz) +
                    " must be multiples of 8, ld_dz >= columns");
  if (!tile.valid()) throw CudaError("promoted dz GEMM: a row array or the targets are missing");
  DzGemm::run(rows, columns, ld_h, x, weight, dz, ld_dz, promotion_k, tile, stream, workspace, workspace_bytes);
}

#else  // without CUTLASS or an sm_90a target: the low-memory schedule's dz comes from dz_kernel

bool promoted_dz_available() { return false; }
void promoted_logits_dz(std::int64_t, std::int64_t, std::int64_t, const __nv_bfloat16*, const __nv_bfloat16*,
                        __nv_bfloat16*, std::int64_t, std::int64_t, const DzTile&, cudaStream_t, void*, std::size_t) {
  throw CudaError("promoted dz GEMM: not built (needs CUTLASS and an sm_90a target)");
}

#endif

}  // namespace simpo::fused::cuda
