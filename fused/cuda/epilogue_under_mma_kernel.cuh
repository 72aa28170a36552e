// The kernel of the register-epilogue GEMMs (register_epilogue.cuh): CUTLASS's persistent cooperative kernel
// (cutlass/gemm/kernel/sm90_gemm_tma_warpspecialized_cooperative.hpp, whose setup and producer this follows, trimmed
// to the static persistent scheduler and no epilogue load) with one change in the consumer warpgroups: a tile's
// epilogue runs under the next tile's first wgmmas. In CUTLASS's kernel the consumers finish a tile's MMAs, then run
// its epilogue while the tensor cores wait; the statistics pass (an exp per logit) is long enough to show in the
// step's time. Here the accumulators of tile t stay in their registers while the consumers issue the first block of
// tile t + 1 (StaggeredMainloop::mma's `under`: up to the first promotion, accumulated in the block's own registers,
// not waited on), and only then run t's epilogue; the block's sum replaces tile t's at that first promotion. The last
// tile's epilogue runs after the loop. Included only where CUTLASS is (SIMPO_HAVE_CUTLASS_SM90).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/pipeline/pipeline.hpp"

namespace simpo::fused::cuda {

template <class Base>
struct EpilogueUnderMmaKernel : Base {
  using typename Base::Params;
  using typename Base::SharedStorage;
  using typename Base::CollectiveMainloop;
  using typename Base::CollectiveEpilogue;
  using typename Base::TileScheduler;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  using typename Base::ClusterShape;
  static_assert(!Base::IsSchedDynamicPersistent, "the static persistent scheduler only");

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace cute;
    enum class WarpGroupRole { Producer = 0, Consumer0 = 1, Consumer1 = 2 };
    SharedStorage& shared_storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    const int thread_idx = int(threadIdx.x);
    const int lane_idx = cutlass::canonical_lane_idx();
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const int warp_idx_in_warp_group = warp_idx % cutlass::NumWarpsPerWarpGroup;
    const int warp_group_thread_idx = thread_idx % cutlass::NumThreadsPerWarpGroup;
    const int mma_thread_idx = thread_idx % Base::NumMMAThreads;
    const auto warp_group_role = WarpGroupRole(cutlass::canonical_warp_group_idx());
    const int lane_predicate = cute::elect_one_sync();
    const uint32_t block_rank_in_cluster = cute::block_rank_in_cluster();

    if (warp_idx == 0 && lane_predicate) {
      CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
      CollectiveEpilogue::prefetch_tma_descriptors(params.epilogue);
    }

    using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
    typename MainloopPipeline::Params mainloop_pipeline_params;
    if (warp_group_role == WarpGroupRole::Producer && warp_idx_in_warp_group == 0)
      mainloop_pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    if (warp_group_role == WarpGroupRole::Consumer0 || warp_group_role == WarpGroupRole::Consumer1)
      mainloop_pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    mainloop_pipeline_params.is_leader = warp_group_thread_idx == 0;
    mainloop_pipeline_params.num_consumers = Base::NumMMAThreads;
    mainloop_pipeline_params.num_producers = Base::NumProducerThreads;
    mainloop_pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline mainloop_pipeline(shared_storage.pipelines.mainloop, mainloop_pipeline_params, ClusterShape{});

    // No epilogue load (no C); the store pipeline is the TMA store's own (the consumer is the TMA unit).
    using EpiLoadPipeline = typename CollectiveEpilogue::LoadPipeline;
    typename EpiLoadPipeline::Params epi_load_pipeline_params;
    if (warp_group_role == WarpGroupRole::Consumer0 || warp_group_role == WarpGroupRole::Consumer1)
      epi_load_pipeline_params.role = EpiLoadPipeline::ThreadCategory::Consumer;
    epi_load_pipeline_params.dst_blockid = cute::block_rank_in_cluster();
    epi_load_pipeline_params.producer_arv_count = Base::NumEpilogueLoadThreads;
    epi_load_pipeline_params.consumer_arv_count = Base::NumMMAThreads;
    if constexpr (CollectiveEpilogue::RequiresTransactionBytes)
      epi_load_pipeline_params.transaction_bytes = params.epilogue.tma_transaction_bytes;
    EpiLoadPipeline epi_load_pipeline(shared_storage.pipelines.epi_load, epi_load_pipeline_params);
    using EpiStorePipeline = typename CollectiveEpilogue::StorePipeline;
    typename EpiStorePipeline::Params epi_store_pipeline_params;
    epi_store_pipeline_params.always_wait = true;
    EpiStorePipeline epi_store_pipeline(epi_store_pipeline_params);

    typename CollectiveMainloop::PipelineState mainloop_pipe_consumer_state;
    typename CollectiveEpilogue::LoadPipelineState epi_load_pipe_consumer_state;
    auto mainloop_pipe_producer_state = cutlass::make_producer_start_state<MainloopPipeline>();
    auto epi_store_pipe_producer_state = cutlass::make_producer_start_state<EpiStorePipeline>();

    // The pipelines' initialization visible to every thread (cluster-wide where there is a cluster).
    if constexpr (size(ClusterShape{}) > 1) {
      cute::cluster_arrive_relaxed();
      cute::cluster_wait();
    } else {
      __syncthreads();
    }

    auto problem_shape_MNKL = append<4>(params.problem_shape, Int<1>{});
    TiledMma tiled_mma;
    auto blk_shape = TileShape{};
    TileScheduler scheduler{params.scheduler};
    CollectiveMainloop collective_mainloop;
    auto load_inputs = collective_mainloop.load_init(problem_shape_MNKL, params.mainloop);
    auto gA_mkl = get<0>(load_inputs);
    auto gB_nkl = get<1>(load_inputs);
    auto work_tile_info = scheduler.initial_work_tile_info(ClusterShape{});
    auto tile_coord = [&](auto const& work) {
      return make_coord(idx2crd(work.M_idx, shape<2>(gA_mkl)), idx2crd(work.N_idx, shape<2>(gB_nkl)), _,
                        idx2crd(work.L_idx, shape<4>(gB_nkl)));
    };

    if (warp_group_role == WarpGroupRole::Producer) {
      cutlass::arch::warpgroup_reg_dealloc<Base::LoadRegisterRequirement>();
      if (warp_idx_in_warp_group == 0) {  // the mainloop's TMA loads; the other three warps have nothing to do
        while (work_tile_info.is_valid()) {
          const auto k_tiles = TileScheduler::get_work_k_tile_count(work_tile_info, problem_shape_MNKL, blk_shape);
          const auto k_start = TileScheduler::get_work_k_tile_start(work_tile_info);
          auto k_tile_iter = cute::make_coord_iterator(idx2crd(k_start, shape<3>(gA_mkl)), shape<3>(gA_mkl));
          collective_mainloop.load(params.mainloop, mainloop_pipeline, mainloop_pipe_producer_state, load_inputs,
                                   tile_coord(work_tile_info), k_tile_iter, k_tiles, lane_idx, block_rank_in_cluster,
                                   shared_storage.tensors.mainloop);
          mainloop_pipe_producer_state.advance(k_tiles);
          work_tile_info = get<0>(scheduler.fetch_next_work(work_tile_info));
        }
        collective_mainloop.load_tail(mainloop_pipeline, mainloop_pipe_producer_state);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Base::MmaRegisterRequirement>();
      CollectiveEpilogue collective_epilogue(params.epilogue, shared_storage.tensors.epilogue);
      // The accumulators of the tile whose epilogue is pending (held across the loop's iterations).
      auto accumulators = partition_fragment_C(tiled_mma, take<0, 2>(blk_shape));
      bool pending = false;
      auto pending_coord = tile_coord(work_tile_info);
      auto epilogue = [&] {
        auto [load_state, store_state] = collective_epilogue.store(
            epi_load_pipeline, epi_load_pipe_consumer_state, epi_store_pipeline, epi_store_pipe_producer_state,
            problem_shape_MNKL, blk_shape, pending_coord, accumulators, tiled_mma, mma_thread_idx,
            shared_storage.tensors.epilogue);
        epi_load_pipe_consumer_state = load_state;
        epi_store_pipe_producer_state = store_state;
      };
      while (work_tile_info.is_valid()) {
        const auto k_tiles = TileScheduler::get_work_k_tile_count(work_tile_info, problem_shape_MNKL, blk_shape);
        collective_mainloop.mma(mainloop_pipeline, mainloop_pipe_consumer_state, accumulators, k_tiles,
                                mma_thread_idx, shared_storage.tensors.mainloop, params.mainloop, [&] {
                                  if (pending) epilogue();
                                });
        collective_mainloop.mma_tail(mainloop_pipeline, mainloop_pipe_consumer_state, k_tiles);
        mainloop_pipe_consumer_state.advance(k_tiles);
        pending = true;
        pending_coord = tile_coord(work_tile_info);
        work_tile_info = get<0>(scheduler.fetch_next_work(work_tile_info));
      }
      if (pending) {
        epilogue();
        collective_epilogue.store_tail(epi_load_pipeline, epi_load_pipe_consumer_state, epi_store_pipeline,
                                       epi_store_pipe_producer_state);
      }
    }
#endif
  }
};

}  // namespace simpo::fused::cuda
