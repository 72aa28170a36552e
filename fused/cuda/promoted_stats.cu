// The promoted logits GEMM with the row statistics in its epilogue (promoted_stats.h). The mainloop is
// promoted_gemm.cu's default (128x192x64 tile, cluster 1x1, CUTLASS's FP8-style promotion with bf16 operands);
// the epilogue is CUTLASS's TMA warp-specialized one with an epilogue visitor tree: AccFetch -> RowStats, the
// node below, written after CUTLASS's Sm90ColReduction (a per-row reduction along N): each thread folds the
// logits it holds into per-row registers (online max and sum of exp, a sum, the target logit), the lanes
// sharing a row merge by shuffles, and one lane per row writes the tile's partials. The logits pass through
// unchanged to the fp32 TMA store, or to no store at all (ElementD = void) for the forward.
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/promoted_gemm.h"
#include "fused/cuda/promoted_stats.h"

#include <string>

#if defined(SIMPO_HAVE_CUTLASS_SM90)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "fused/simpo_math.h"
#endif

namespace simpo::fused::cuda {

#if defined(SIMPO_HAVE_CUTLASS_SM90)
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;
namespace m = ::simpo::fused::math;

// The visitor node. Its input is the accumulator fragment (AccFetch), returned unchanged. Registers: per
// thread, one (max, sum of exp, sum, target column) per row it holds, as Sm90ColReduction keeps them: a
// register tensor shaped like the thread's partition of the tile with stride 0 along N, so every element of a
// row folds into the same registers whatever the epilogue subtile.
struct RowStats {
  using ElementAux = float;  // lets the void-D epilogue builder name its (unused) output type
  struct SharedStorage {};
  using Arguments = LogitTileStats;
  using Params = LogitTileStats;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.target != nullptr && args.tile_max != nullptr && args.tile_sum_exp != nullptr &&
           args.tile_sum != nullptr && args.z_target != nullptr;
  }
  template <class ProblemShape>
  static std::size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  CUTLASS_HOST_DEVICE RowStats() {}
  CUTLASS_HOST_DEVICE RowStats(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::detail::ProducerLoadArgs<Args...> const&) {
    return fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class ArgsTuple>
  struct ConsumerStoreCallbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(ArgsTuple&& args_tuple, Params const& params)
        : args_tuple(cute::forward<ArgsTuple>(args_tuple)), params(params) {}
    ArgsTuple args_tuple;
    Params const& params;

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
                              cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      auto& [r_max, r_sum_exp, r_sum, r_target, tCcD, residue_tCcD, base_m, base_n, lane_layout_MN, lane_mn, cD,
             residue_cD, n_tile, M] = args_tuple;
      auto max_mn = r_max(_, _, _, epi_m, epi_n);
      auto sum_exp_mn = r_sum_exp(_, _, _, epi_m, epi_n);
      auto sum_mn = r_sum(_, _, _, epi_m, epi_n);
      auto target_mn = r_target(_, _, _, epi_m, epi_n);
      auto c_mn = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const int idx = epi_v * FragmentSize + i;
        const auto coord = c_mn(idx);
        if (elem_less(coord, residue_tCcD)) {
          const int n = base_n + static_cast<int>(get<1>(coord));
          float z = static_cast<float>(frg_input[i]);
          if (params.bias != nullptr) z += __bfloat162float(params.bias[n]);
          const m::LogSumExp<float> s = m::lse_add(m::LogSumExp<float>{max_mn(idx), sum_exp_mn(idx)}, z);
          max_mn(idx) = s.max;
          sum_exp_mn(idx) = s.sum;
          sum_mn(idx) += z;
          // One element of the whole grid matches a row's target: a single writer.
          if (n == target_mn(idx)) params.z_target[base_m + static_cast<int>(get<0>(coord))] = z;
        }
      }
      return frg_input;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration, VTensor) {
      if (!is_last_iteration) return;
      auto& [r_max, r_sum_exp, r_sum, r_target, tCcD, residue_tCcD, base_m, base_n, lane_layout_MN, lane_mn, cD,
             residue_cD, n_tile, M] = args_tuple;
      if (!elem_less(cD(_0{}, _0{}), residue_cD)) return;  // a tile wholly past the problem

      auto max_flt = filter_zeros(r_max);
      auto sum_exp_flt = filter_zeros(r_sum_exp);
      auto sum_flt = filter_zeros(r_sum);
      auto c_flt = make_tensor(tCcD.data(), make_layout(max_flt.shape(), tCcD.stride()));
      const bool writer = get<1>(lane_mn) == 0;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(max_flt); ++i) {
        m::LogSumExp<float> s{max_flt(i), sum_exp_flt(i)};
        double total = sum_flt(i);
        // The lanes holding the same rows (along N) merge by shuffles; lane column 0 ends with the row's.
        CUTLASS_PRAGMA_UNROLL
        for (int lanes = size<1>(lane_layout_MN) / 2; lanes > 0; lanes /= 2) {
          const int delta = lane_layout_MN(_0{}, lanes);
          const m::LogSumExp<float> other{__shfl_down_sync(0xffffffffu, s.max, delta),
                                          __shfl_down_sync(0xffffffffu, s.sum, delta)};
          total += __shfl_down_sync(0xffffffffu, total, delta);
          s = m::lse_merge(s, other);
        }
        const int row = base_m + static_cast<int>(get<0>(c_flt(i)));
        if (writer && row < M) {
          const std::int64_t at = static_cast<std::int64_t>(n_tile) * params.ld + row;
          params.tile_max[at] = s.max;
          params.tile_sum_exp[at] = s.sum;
          params.tile_sum[at] = total;
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    // The lanes that share rows, as Sm90ColReduction finds them.
    auto ref_layout_MN = [&]() {
      auto mn_shape = shape(typename decltype(args.tiled_copy)::Tiler_MN{});
      if constexpr (ReferenceSrc) return right_inverse(args.tiled_copy.get_layoutS_TV()).with_shape(mn_shape);
      else return right_inverse(args.tiled_copy.get_layoutD_TV()).with_shape(mn_shape);
    }();
    using W = Int<decltype(args.tiled_copy)::TiledNumThr::value / cutlass::NumThreadsPerWarp>;
    auto tv2lane = cute::Layout<cute::Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, cute::Stride<_1, _0, _0>>{};
    auto ref2lane = composition(tv2lane, ref_layout_MN);
    auto lane_layout_MN = make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));
    auto inv_lane_layout_MN = right_inverse(lane_layout_MN);
    const int lane_idx = cutlass::canonical_lane_idx();
    auto lane_mn = idx2crd(inv_lane_layout_MN(lane_idx), shape(lane_layout_MN));
    // Every row of a warp's part of the tile is whole inside that warp (the wgmma accumulator layout): no
    // reduction across warps is needed, so none is written.
    auto tv2warp = cute::Layout<cute::Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, cute::Stride<_0, _1, _0>>{};
    auto ref2warp = composition(tv2warp, ref_layout_MN);
    auto warp_layout_MN = make_layout(filter(get<0>(ref2warp)), filter(get<1>(ref2warp)));
    static_assert(decltype(size<1>(warp_layout_MN))::value == 1, "RowStats: a row spans several warps");

    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    // A stand-in (M, N) tensor with stride 0 along N: only its partition's shape is used (never dereferenced).
    auto mRow = make_tensor(make_gmem_ptr(static_cast<float*>(nullptr)),
                              make_layout(make_shape(M, N), make_stride(_1{}, _0{})));
    auto gRow = local_tile(mRow, take<0, 2>(args.tile_shape_mnk), make_coord(m, n));
    auto tCgRow = fusion::detail::sm90_partition_for_epilogue<ReferenceSrc>(gRow, args.epi_tile, args.tiled_copy,
                                                                              args.thread_idx);
    auto r_max = make_tensor_like<float>(tCgRow);
    auto r_sum_exp = make_tensor_like<float>(tCgRow);
    auto r_sum = make_tensor_like<float>(tCgRow);
    auto r_target = make_tensor_like<int>(tCgRow);
    fill(r_max, -INFINITY);
    fill(r_sum_exp, 0.0f);
    fill(r_sum, 0.0f);

    // tCcD holds coordinates relative to this thread's first element; residue_tCcD = (M, N) minus that
    // element's absolute coordinate, which gives the absolute one back.
    const int base_m = static_cast<int>(M) - static_cast<int>(get<0>(args.residue_tCcD));
    const int base_n = static_cast<int>(N) - static_cast<int>(get<1>(args.residue_tCcD));
    auto target_flt = filter_zeros(r_target);
    auto c_flt = make_tensor(args.tCcD.data(), make_layout(target_flt.shape(), args.tCcD.stride()));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(target_flt); ++i) {
      const int row = base_m + static_cast<int>(get<0>(c_flt(i)));
      int column = -1;  // never matches: rows past M, ignored rows
      if (row < static_cast<int>(M)) {
        const std::int64_t t = params.target[row];
        if (t != params.ignore_index) column = static_cast<int>(t);
      }
      target_flt(i) = column;
    }

    auto args_tuple = make_tuple(cute::move(r_max), cute::move(r_sum_exp), cute::move(r_sum), cute::move(r_target),
                                 args.tCcD, args.residue_tCcD, base_m, base_n, lane_layout_MN, lane_mn, args.cD,
                                 args.residue_cD, static_cast<int>(n), static_cast<int>(M));
    return ConsumerStoreCallbacks<decltype(args_tuple)>(cute::move(args_tuple), params);
  }
};

template <bool kStoreLogits>
struct StatsGemm {
  using TileShape = cute::Shape<_128, _192, _64>;  // promoted_gemm.cu's variant 0
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using Element = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using ElementD = cute::conditional_t<kStoreLogits, float, void>;
  using Callbacks = fusion::Sm90EVT<RowStats, fusion::Sm90AccFetch>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, 4, ElementD, LayoutD, 4,
      cutlass::epilogue::TmaWarpSpecializedCooperative, Callbacks>::CollectiveOp;

  using Plain = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Mainloop = cutlass::gemm::collective::CollectiveMma<
      cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedFP8<Plain::DispatchPolicy::Stages, ClusterShape, Schedule>,
      TileShape, Element, typename Plain::StrideA, Element, typename Plain::StrideB, typename Plain::TiledMma,
      typename Plain::GmemTiledCopyA, typename Plain::SmemLayoutAtomA, typename Plain::SmemCopyAtomA,
      typename Plain::TransformA, typename Plain::GmemTiledCopyB, typename Plain::SmemLayoutAtomB,
      typename Plain::SmemCopyAtomB, typename Plain::TransformB>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kMmaK = 16;
  static_assert(size<2>(TileShape{}) == promoted_k_granule, "promoted_k_granule is the k tile");

  static typename Gemm::Arguments arguments(std::int64_t rows, std::int64_t V, std::int64_t ld_h,
                                            const __nv_bfloat16* x, const __nv_bfloat16* weight, float* logits,
                                            std::int64_t ld_logits, std::int64_t promotion_k,
                                            const LogitTileStats& stats) {
    const std::uint32_t interval =
        promotion_k > 0 ? static_cast<std::uint32_t>(promotion_k / kMmaK) : (std::uint32_t{1} << 30);
    typename Plain::StrideA stride_a{ld_h, Int<1>{}, 0};
    typename Plain::StrideB stride_b{ld_h, Int<1>{}, 0};
    typename Epilogue::StrideD stride_d{ld_logits, Int<1>{}, 0};
    static const int sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    cutlass::KernelHardwareInfo hw{0, sm_count};
    cudaGetDevice(&hw.device_id);
    using D = cute::conditional_t<kStoreLogits, float, void>;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(rows), static_cast<int>(V), static_cast<int>(ld_h), 1},
        {reinterpret_cast<const Element*>(x), stride_a, reinterpret_cast<const Element*>(weight), stride_b, interval},
        {{{}, stats}, nullptr, stride_d, reinterpret_cast<D*>(logits), stride_d},
        hw};
    args.scheduler.max_swizzle_size = 1;
    return args;
  }

  static void run(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                  const __nv_bfloat16* weight, float* logits, std::int64_t ld_logits, std::int64_t promotion_k,
                  const LogitTileStats& stats, cudaStream_t stream, void* workspace, std::size_t workspace_bytes) {
    const auto args = arguments(rows, V, ld_h, x, weight, logits, ld_logits, promotion_k, stats);
    Gemm gemm;
    if (Gemm::get_workspace_size(args) > workspace_bytes)
      throw CudaError("promoted logits GEMM with statistics: needs " + std::to_string(Gemm::get_workspace_size(args)) +
                      " bytes of scratch, has " + std::to_string(workspace_bytes));
    cutlass::Status status = gemm.can_implement(args);
    if (status != cutlass::Status::kSuccess)
      throw CudaError(std::string("promoted logits GEMM with statistics cannot run rows=") + std::to_string(rows) +
                      " V=" + std::to_string(V) + " ld_h=" + std::to_string(ld_h) + ": " +
                      cutlass::cutlassGetStatusString(status));
    status = gemm.initialize(args, workspace, stream);
    if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
    if (status != cutlass::Status::kSuccess)
      throw CudaError(std::string("promoted logits GEMM with statistics: ") + cutlass::cutlassGetStatusString(status));
    SIMPO_CUDA_CHECK_LAUNCH();
  }
};

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
  if (logits != nullptr)
    StatsGemm<true>::run(rows, V, ld_h, x, weight, logits, ld_logits, promotion_k, stats, stream, workspace,
                         workspace_bytes);
  else
    StatsGemm<false>::run(rows, V, ld_h, x, weight, nullptr, V, promotion_k, stats, stream, workspace,
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
