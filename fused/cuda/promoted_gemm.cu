// The promoted logits GEMM (promoted_gemm.h), after CUTLASS's examples 48/54 (Hopper warp-specialized GEMM,
// FP8 with promotion). The CollectiveBuilder picks the bf16 tile layouts, TMA copies and wgmma atoms as for any
// bf16 GEMM; the mainloop is then re-instantiated with the dispatch policy of CUTLASS's FP8 mainloop
// (MainloopSm90TmaGmmaWarpSpecializedFP8), whose GmmaFP8Accumulation lets the wgmmas accumulate into a
// temporary fragment and adds that fragment into the fp32 accumulator every `mma_promotion_interval` wgmmas.
// Nothing in that collective is FP8-specific but its name. Epilogue: fp32 D, no C, TMA store.
//
// Its mma() is replaced by one whose two consumer warpgroups promote half an interval apart (StaggeredMainloop,
// promoted_mainloop.cuh), so their drains do not coincide. Tile 128x192x64, cluster 1x1, the epilogue's fp32 store
// in 128x16 subtiles (16 KiB of shared memory instead of CUTLASS's automatic 32, which buys the mainloop a fifth
// stage): the fastest of the tiles, clusters and mainloops measured (fused/cuda/BENCHMARKS.md).
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

struct PromotedGemm : LogitsGemmShape {
  using EpilogueTile = cute::Shape<_128, _16>;
  using LayoutD = cutlass::layout::RowMajor;  // logits[rows, ld_logits]

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, float, float,
      void, LayoutD, 4, float, LayoutD, 4,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = KernelWith<Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(std::int64_t rows, std::int64_t V, std::int64_t ld_h,
                                            const __nv_bfloat16* x, const __nv_bfloat16* weight, float* logits,
                                            std::int64_t ld_logits, std::int64_t promotion_k) {
    // The interval is counted in wgmmas: a multiple of the wgmmas per k tile.
    const auto interval = static_cast<std::uint32_t>(promotion_k / kMmaK);
    typename Kernel::StrideA stride_a{ld_h, Int<1>{}, 0};
    typename Kernel::StrideB stride_b{ld_h, Int<1>{}, 0};
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
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    return args;
  }

  static void run(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                  const __nv_bfloat16* weight, float* logits, std::int64_t ld_logits, std::int64_t promotion_k,
                  cudaStream_t stream, void* workspace, std::size_t workspace_bytes) {
    const auto args = arguments(rows, V, ld_h, x, weight, logits, ld_logits, promotion_k);
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

}  // namespace

bool promoted_kernels_built() { return true; }

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

void promoted_logits(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                     const __nv_bfloat16* weight, float* logits, std::int64_t ld_logits, std::int64_t promotion_k,
                     cudaStream_t stream, void* workspace, std::size_t workspace_bytes) {
  if (rows == 0 || V == 0) return;
  if (promotion_k <= 0 || promotion_k % promotion_k_granule != 0)
    throw CudaError("promoted logits GEMM: promotion_k " + std::to_string(promotion_k) + " is not a multiple of " +
                    std::to_string(promotion_k_granule));
  if (V % 4 != 0)
    throw CudaError("promoted logits GEMM: V = " + std::to_string(V) + " is not a multiple of 4 (fp32 TMA store)");
  PromotedGemm::run(rows, V, ld_h, x, weight, logits, ld_logits, promotion_k, stream, workspace, workspace_bytes);
}

#else  // built without CUTLASS or without an sm_90a target: the sliced cuBLAS path is the only one

bool promoted_kernels_built() { return false; }
bool promoted_logits_available() { return false; }
void promoted_logits(std::int64_t, std::int64_t, std::int64_t, const __nv_bfloat16*, const __nv_bfloat16*, float*,
                     std::int64_t, std::int64_t, cudaStream_t, void*, std::size_t) {
  throw CudaError("promoted logits GEMM: not built (needs CUTLASS and an sm_90a target)");
}

#endif

}  // namespace simpo::fused::cuda
