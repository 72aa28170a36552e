// The promoting mainloops of the logits GEMMs (promoted_gemm.cu, promoted_stats.cu): CUTLASS's FP8 collective
// (MainloopSm90TmaGmmaWarpSpecializedFP8, instantiated with bf16 operands) with its mma() replaced: by one whose two
// consumer warpgroups promote out of step. Included only where CUTLASS is (SIMPO_HAVE_CUTLASS_SM90).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "fused/cuda/plan.h"

namespace simpo::fused::cuda {

// What each mma() below starts from: the calling thread's consumer warpgroup and that warpgroup's wgmma fragments
// of the A and B stage buffers (shared-memory descriptors over every pipeline stage), as CUTLASS's collective
// makes them.
template <class Base>
CUTLASS_DEVICE auto consumer_fragments(typename Base::TensorStorage& shared_tensors, int thread_idx) {
  using namespace cute;
  auto sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
  auto sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
  typename Base::TiledMma tiled_mma;
  constexpr int kWarpGroups = size(typename Base::TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
  const auto warp_group_thread_layout = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
  const int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
  auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
  return make_tuple(warp_group_idx, thread_mma.make_fragment_A(thread_mma.partition_A(sA)),
                    thread_mma.make_fragment_B(thread_mma.partition_B(sB)));
}

// Staggered promotion. In the cooperative kernel both consumer warpgroups work through the same k tiles in step,
// so with CUTLASS's FP8 mainloop they reach each promotion (drain the wgmmas with warpgroup_wait<0>, then add the
// block into the running sum) at about the same time, and the tensor cores wait on both. Here the second
// warpgroup closes its first block half an interval early, so its drains fall between the first's: while one
// warpgroup drains and adds, the other still has a batch queued. The arithmetic is the same promotion (every
// `interval` k tiles, the first block of warpgroup 1 half as long); the release protocol is the base's
// (K_PIPE_MMAS = 1: each stage is released one k tile late, mma_tail releases the last).
template <class Base>
struct StaggeredMainloop : Base {
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(typename Base::MainloopPipeline pipeline, typename Base::PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          typename Base::TensorStorage& shared_tensors, typename Base::Params const& params) {
    using namespace cute;
    typename Base::TiledMma tiled_mma;
    auto fragments = consumer_fragments<Base>(shared_tensors, thread_idx);
    const int warp_group_idx = get<0>(fragments);
    auto& tCrA = get<1>(fragments);  // (MMA, MMA_M, MMA_K, PIPE)
    auto& tCrB = get<2>(fragments);  // (MMA, MMA_N, MMA_K, PIPE)
    auto block = make_fragment_like(accum);  // the block of k in flight
    clear(accum);

    // The interval in k tiles (mma_promotion_interval counts wgmmas, size<2>(tCrA) of them per k tile).
    const int interval = cute::max(1, static_cast<int>(params.mma_promotion_interval / size<2>(tCrA)));
    // k tiles until this warpgroup promotes; whether the block holds products not yet promoted.
    int left = warp_group_idx % 2 == 0 ? interval : cute::max(1, interval / 2);
    bool open = false;
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    auto smem_pipe_release = smem_pipe_read;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int k_tile = 0; k_tile < k_tile_count; ++k_tile) {
      auto token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, token);
      const int stage = smem_pipe_read.index();
      warpgroup_fence_operand(block);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < size<2>(tCrA); ++k) {
        cute::gemm(tiled_mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), block);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      open = true;
      if (--left == 0) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(block);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(block); ++i) accum(i) += block(i);
        tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
        left = interval;
        open = false;
      } else {
        warpgroup_wait<1>();  // the previous k tile's batch is done: its stage can go back
        warpgroup_fence_operand(block);
      }
      if (k_tile > 0) {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
      ++smem_pipe_read;
    }
    if (open) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(block);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(block); ++i) accum(i) += block(i);
    }
    warpgroup_fence_operand(accum);
  }
};

// The logits GEMMs' operands, tiling and mainloop, one description for the plain promoted GEMM (promoted_gemm.cu)
// and the register-epilogue ones (register_epilogue.cuh). x[rows, ld_h] is A and weight[V, ld_h] is B (k x V,
// column-major), both k-contiguous bf16; tile 128x192x64, cluster 1x1 (BENCHMARKS.md). `Plain` is the ordinary bf16
// CollectiveBuilder's collective for an epilogue of `kEpilogueSmem` bytes of shared memory (its tile layouts, copies,
// wgmma atoms and stage count); `Mainloop` re-instantiates it with the dispatch policy of CUTLASS's FP8 mainloop
// (whose GmmaFP8Accumulation promotes; nothing in it is FP8-specific but its name) and the staggered mma() above.
struct LogitsGemmShape {
  using TileShape = cute::Shape<cute::_128, cute::_192, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Element = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  static constexpr int kMmaK = 16;  // bf16 wgmma's k: the promotion interval is counted in wgmmas
  static_assert(cute::size<2>(TileShape{}) == promotion_k_granule, "promotion_k_granule is the k tile");

  template <int kEpilogueSmem>
  using Plain = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8, float, TileShape,
      ClusterShape, cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmem>, Schedule>::CollectiveOp;

  template <int kEpilogueSmem, class P = Plain<kEpilogueSmem>>
  using Mainloop = StaggeredMainloop<cutlass::gemm::collective::CollectiveMma<
      cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedFP8<P::DispatchPolicy::Stages, ClusterShape, Schedule>,
      TileShape, Element, typename P::StrideA, Element, typename P::StrideB, typename P::TiledMma,
      typename P::GmemTiledCopyA, typename P::SmemLayoutAtomA, typename P::SmemCopyAtomA, typename P::TransformA,
      typename P::GmemTiledCopyB, typename P::SmemLayoutAtomB, typename P::SmemCopyAtomB, typename P::TransformB>>;

  // The persistent kernel of that mainloop and `Epilogue`, whose shared memory sets the mainloop's stage count.
  template <class Epilogue>
  using KernelWith =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                           Mainloop<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
                                           Epilogue, cutlass::gemm::PersistentScheduler>;
};

}  // namespace simpo::fused::cuda
