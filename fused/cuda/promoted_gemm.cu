// The promoted logits GEMM (promoted_gemm.h), after CUTLASS's examples 48/54 (Hopper warp-specialized GEMM,
// FP8 with promotion). The CollectiveBuilder picks the bf16 tile layouts, TMA copies and wgmma atoms as for any
// bf16 GEMM; the mainloop is then re-instantiated with the dispatch policy of CUTLASS's FP8 mainloop
// (MainloopSm90TmaGmmaWarpSpecializedFP8), whose GmmaFP8Accumulation lets the wgmmas accumulate into a
// temporary fragment and adds that fragment into the fp32 accumulator every `mma_promotion_interval` wgmmas.
// Nothing in that collective is FP8-specific but its name. Epilogue: fp32 D, no C, TMA store.
//
// The default variant replaces that collective's mma() with one whose two consumer warpgroups promote half an
// interval apart (StaggeredMainloop, promoted_mainloop.cuh), so their drains do not coincide.
//
// Register budget: each of the two consumer warpgroups holds its 64 x TileN accumulator twice (the running
// sum and the block in flight), TileN fp32 registers per thread; TileN = 128 leaves room, 256 would not.
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/promoted_gemm.h"

#include <string>

#if defined(SIMPO_HAVE_CUTLASS_SM90)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "fused/cuda/promoted_mainloop.cuh"
#endif

namespace simpo::fused::cuda {

#if defined(SIMPO_HAVE_CUTLASS_SM90)
namespace {

using namespace cute;

enum class MainloopForm { fp8_collective, split_n, staggered };

template <class TileShape, class ClusterShape, MainloopForm kForm = MainloopForm::fp8_collective,
          class EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto>
struct PromotedGemm {
  using Element = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;     // x[rows, ld_h]: k contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // weight[V, ld_h] as B (k x V, column-major): k contiguous
  using LayoutD = cutlass::layout::RowMajor;     // logits[rows, ld_logits]
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, float, float,
      void, LayoutD, 4, float, LayoutD, 4,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

  using Plain = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;

  // Split-N: the 64x128 wgmma atom, two warpgroups along M, so each warpgroup's tile has two N blocks.
  using SplitMma = decltype(make_tiled_mma(SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{},
                                           cute::Layout<cute::Shape<_2, _1, _1>>{}));
  static constexpr bool kSplitN = kForm == MainloopForm::split_n;
  using TiledMma = cute::conditional_t<kSplitN, SplitMma, typename Plain::TiledMma>;
  using Promoting = PromotingCollective<Plain, TileShape, ClusterShape, Schedule, TiledMma>;
  using Mainloop = cute::conditional_t<
      kSplitN, SplitNMainloop<Promoting>,
      cute::conditional_t<kForm == MainloopForm::staggered, StaggeredMainloop<Promoting>, Promoting>>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // wgmma instructions per k tile: the promotion interval is counted in them.
  static constexpr int kMmaK = 16;  // bf16 wgmma's k
  static_assert(size<2>(TileShape{}) == promoted_k_granule, "promoted_k_granule is the k tile");

  static typename Gemm::Arguments arguments(std::int64_t rows, std::int64_t V, std::int64_t ld_h,
                                            const __nv_bfloat16* x, const __nv_bfloat16* weight, float* logits,
                                            std::int64_t ld_logits, std::int64_t promotion_k,
                                            const PromotedSchedule& schedule = {}) {
    // 0: never promote inside the loop (the residue promotion at the end adds the one block); the interval
    // must stay a multiple of the wgmmas per k tile.
    const std::uint32_t interval =
        promotion_k > 0 ? static_cast<std::uint32_t>(promotion_k / kMmaK) : (std::uint32_t{1} << 30);
    typename Plain::StrideA stride_a{ld_h, Int<1>{}, 0};
    typename Plain::StrideB stride_b{ld_h, Int<1>{}, 0};
    typename Epilogue::StrideD stride_d{ld_logits, Int<1>{}, 0};
    static const int sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    cutlass::KernelHardwareInfo hw{0, sm_count};
    cudaGetDevice(&hw.device_id);
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(rows), static_cast<int>(V), static_cast<int>(ld_h), 1},
        {reinterpret_cast<const Element*>(x), stride_a, reinterpret_cast<const Element*>(weight), stride_b, interval},
        {{}, nullptr, stride_d, logits, stride_d},
        hw};
    using Raster = decltype(args.scheduler.raster_order);
    args.scheduler.max_swizzle_size = schedule.swizzle;
    args.scheduler.raster_order = schedule.raster == PromotedSchedule::Raster::along_m   ? Raster::AlongM
                                  : schedule.raster == PromotedSchedule::Raster::along_n ? Raster::AlongN
                                                                                         : Raster::Heuristic;
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    return args;
  }

  static std::size_t workspace(std::int64_t rows, std::int64_t V, std::int64_t ld_h) {
    return Gemm::get_workspace_size(arguments(rows, V, ld_h, nullptr, nullptr, nullptr, V, 256));
  }

  static void run(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                  const __nv_bfloat16* weight, float* logits, std::int64_t ld_logits, std::int64_t promotion_k,
                  cudaStream_t stream, void* workspace, std::size_t workspace_bytes, const PromotedSchedule& schedule) {
    const auto args = arguments(rows, V, ld_h, x, weight, logits, ld_logits, promotion_k, schedule);
    Gemm gemm;
    if (Gemm::get_workspace_size(args) > workspace_bytes)
      throw CudaError("promoted logits GEMM: needs " + std::to_string(Gemm::get_workspace_size(args)) +
                      " bytes of scratch, has " + std::to_string(workspace_bytes));
    cutlass::Status status = gemm.can_implement(args);
    if (status != cutlass::Status::kSuccess)
      throw CudaError(std::string("promoted logits GEMM cannot run rows=") + std::to_string(rows) + " V=" +
                      std::to_string(V) + " ld_h=" + std::to_string(ld_h) + " promotion_k=" +
                      std::to_string(promotion_k) + ": " + cutlass::cutlassGetStatusString(status));
    status = gemm.initialize(args, workspace, stream);
    if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
    if (status != cutlass::Status::kSuccess)
      throw CudaError(std::string("promoted logits GEMM: ") + cutlass::cutlassGetStatusString(status));
    SIMPO_CUDA_CHECK_LAUNCH();
  }
};

using Tile128x128 = PromotedGemm<cute::Shape<_128, _128, _64>, cute::Shape<_1, _1, _1>>;
using Tile128x128Cluster2 = PromotedGemm<cute::Shape<_128, _128, _64>, cute::Shape<_2, _1, _1>>;
using Tile128x192 = PromotedGemm<cute::Shape<_128, _192, _64>, cute::Shape<_1, _1, _1>>;
using Tile128x192Staggered =
    PromotedGemm<cute::Shape<_128, _192, _64>, cute::Shape<_1, _1, _1>, MainloopForm::staggered>;
using Tile128x256SplitN =
    PromotedGemm<cute::Shape<_128, _256, _64>, cute::Shape<_2, _1, _1>, MainloopForm::split_n>;
// The store's fp32 subtiles 128x16 instead of CUTLASS's automatic 128x32: 16 KiB of epilogue shared memory
// instead of 32, so the mainloop gets a fifth 40 KiB stage (twice the store iterations).
using Tile128x192StaggeredFiveStages = PromotedGemm<cute::Shape<_128, _192, _64>, cute::Shape<_1, _1, _1>,
                                                    MainloopForm::staggered, cute::Shape<_128, _16>>;

// 128x192 staggered with 128x16 store subtiles first: the fastest at the workload's shapes on the H200
// (fused/cuda/BENCHMARKS.md: the sixth round for the tile and the staggering, a 2x1 cluster on it no faster; the
// eighth for the fifth stage, full step 1.13-1.20x against 1.14-1.20x with CUTLASS's automatic 128x32 subtiles,
// now variant 5). promoted_stats.cu runs variant 0's mainloop with its own epilogue.
constexpr const char* kNames[] = {"128x192x64 cluster 1x1 staggered, 128x16 store subtiles (5 stages)",
                                  "128x192x64 cluster 1x1 in step", "128x128x64 cluster 2x1",
                                  "128x128x64 cluster 1x1", "128x256x64 cluster 2x1 split-N (promotes every 64 k)",
                                  "128x192x64 cluster 1x1 staggered, 128x32 store subtiles (4 stages)"};

template <class F>
decltype(auto) dispatch(int variant, F&& f) {
  switch (variant) {
    case 0: return f(Tile128x192StaggeredFiveStages{});
    case 1: return f(Tile128x192{});
    case 2: return f(Tile128x128Cluster2{});
    case 3: return f(Tile128x128{});
    case 4: return f(Tile128x256SplitN{});
    case 5: return f(Tile128x192Staggered{});
  }
  throw CudaError("promoted logits GEMM: no variant " + std::to_string(variant));
}

}  // namespace

bool promoted_logits_available() {
  static const bool available = [] {
    int device = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return prop.major == 9 && prop.minor == 0;  // sm_90a code runs on compute capability 9.0 alone
  }();
  return available;
}

int promoted_variant_count() { return static_cast<int>(sizeof(kNames) / sizeof(kNames[0])); }
const char* promoted_variant_name(int variant) {
  return variant >= 0 && variant < promoted_variant_count() ? kNames[variant] : "none";
}

void promoted_logits(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                     const __nv_bfloat16* weight, float* logits, std::int64_t ld_logits, std::int64_t promotion_k,
                     cudaStream_t stream, void* workspace, std::size_t workspace_bytes,
                     const PromotedSchedule& schedule) {
  if (rows == 0 || V == 0) return;
  if (promotion_k < 0 || promotion_k % promoted_k_granule != 0)
    throw CudaError("promoted logits GEMM: promotion_k " + std::to_string(promotion_k) + " is not a multiple of " +
                    std::to_string(promoted_k_granule));
  if (V % 4 != 0)
    throw CudaError("promoted logits GEMM: V = " + std::to_string(V) + " is not a multiple of 4 (fp32 TMA store)");
  dispatch(schedule.variant, [&](auto gemm) {
    decltype(gemm)::run(rows, V, ld_h, x, weight, logits, ld_logits, promotion_k, stream, workspace, workspace_bytes,
                        schedule);
  });
}

std::size_t promoted_workspace_bytes(std::int64_t rows, std::int64_t V, std::int64_t ld_h, int variant) {
  return dispatch(variant, [&](auto gemm) { return decltype(gemm)::workspace(rows, V, ld_h); });
}

#else  // built without CUTLASS or without an sm_90a target: the sliced cuBLAS path is the only one

bool promoted_logits_available() { return false; }
int promoted_variant_count() { return 0; }
const char* promoted_variant_name(int) { return "none"; }
void promoted_logits(std::int64_t, std::int64_t, std::int64_t, const __nv_bfloat16*, const __nv_bfloat16*, float*,
                     std::int64_t, std::int64_t, cudaStream_t, void*, std::size_t, const PromotedSchedule&) {
  throw CudaError("promoted logits GEMM: not built (needs CUTLASS and an sm_90a target)");
}
std::size_t promoted_workspace_bytes(std::int64_t, std::int64_t, std::int64_t, int) { return 0; }

#endif

}  // namespace simpo::fused::cuda
