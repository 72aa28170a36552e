// The promoted logits GEMM (LogitsGemmShape in promoted_mainloop.cuh: the tile, cluster and staggered promotion
// of promoted_gemm.cu's) with a pass over the accumulator tile in registers before CUTLASS's TMA
// store: the epilogues of promoted_stats.cu (the row statistics, then no store or the 16-bit logit distances) and
// promoted_dz.cu (each logit rewritten into its dz, then a bf16 store). A Pass is a struct of its parameters,
// `Params`, with
//   template <...> CUTLASS_DEVICE void operator()(problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl,
//                                                 accumulators&, tiled_mma, thread_idx) const;
// It runs in CUTLASS's cooperative kernel after the tile's MMAs, while the tensor cores wait, so a spill costs
// their time: each pass fits the registers (ctest promoted_*_kernels_fit_registers). Its parameters ride from the
// GEMM's arguments to the epilogue on a pass-through node of CUTLASS's epilogue visitor tree (EpilogueParams),
// which hands the accumulator to the store unchanged.
// Included only where CUTLASS is (SIMPO_HAVE_CUTLASS_SM90).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/promoted_gemm.h"
#include "fused/cuda/promoted_mainloop.cuh"

#include <string>
#include <utility>

namespace simpo::fused::cuda {

template <class P>
struct EpilogueParams {
  using ElementAux = float;  // lets the void-D epilogue builder name its (unused) output type
  struct SharedStorage {};
  using Arguments = P;
  using Params = P;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.valid();
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
  CUTLASS_HOST_DEVICE EpilogueParams() {}
  CUTLASS_HOST_DEVICE EpilogueParams(Params const& params, SharedStorage const&) : params(params) {}
  Params params;  // not empty: CuTe hands an empty tuple element out by value, the visitor wants a reference

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::detail::EmptyProducerLoadCallbacks{};
  }
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks {
    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int, int, int,
                              cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      return frg_input;
    }
  };
  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const&) {
    return ConsumerStoreCallbacks{};
  }
};

// CUTLASS's TMA warp-specialized epilogue, entered through the pass: its parameters are the tree's node 1.
template <class Base, class Pass>
struct RegisterEpilogue : Base {
  Pass pass;
  CUTLASS_HOST_DEVICE RegisterEpilogue(typename Base::Params const& params, typename Base::TensorStorage& storage)
      : Base(params, storage), pass{params.thread.op_1} {}

  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState, class ProblemShapeMNKL,
            class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout, class TiledMma>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadState load_state, StorePipeline store_pipeline,
                            StoreState store_state, ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, typename Base::TensorStorage& shared_tensors,
                            int subtile_idx = -1) {
    pass(problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, accumulators, tiled_mma, thread_idx);
    // No output (ElementD void, no C): the pass was the whole epilogue, nothing is loaded or stored, so the
    // pipeline states go back unchanged. One barrier of both consumer warpgroups stays: it is the only point where
    // they meet. CUTLASS's store loop meets them at every subtile; without any meeting they drift apart over the
    // tiles, and since each mainloop stage returns to the producer only once both have read it, the one ahead
    // waits on the other's drains instead of overlapping them (StaggeredMainloop's half-interval offset is lost).
    // Measured: BENCHMARKS.md, "one barrier per tile in the statistics-only epilogue".
    if constexpr (cute::is_void_v<typename Base::ElementD>) {
      cutlass::arch::NamedBarrier::sync(cute::size(TiledMma{}), cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
      return cute::make_tuple(load_state, store_state);
    }
    else return Base::store(load_pipeline, load_state, store_pipeline, store_state, problem_shape_mnkl, tile_shape_MNK,
                       tile_coord_mnkl, accumulators, tiled_mma, thread_idx, shared_tensors, subtile_idx);
  }
};

// A pass's view of the accumulator tile a thread holds, in wgmma's F32 layout ((2 columns, 2 rows, TileN / 8 column
// groups), MMA_M, MMA_N): the thread holds 2 MMA_M rows (row i of them: the 2-row pair i % 2 of M block i / 2) and
// the same columns in each. accumulator_at(i, c, g, mn) is the coordinate of one accumulator; for_each_accumulator
// calls f(i, c, g, mn) for every one, unrolled, rows outermost.
CUTLASS_HOST_DEVICE auto accumulator_at(int i, int c, int g, int mn) {
  return cute::make_coord(cute::make_coord(c, i % 2, g), i / 2, mn);
}
template <class AccTensor>
inline constexpr int accumulator_rows = 2 * decltype(cute::size<1>(std::declval<AccTensor>()))::value;

template <class AccTensor, class F>
CUTLASS_DEVICE void for_each_accumulator(AccTensor const& acc, F&& f) {
  using namespace cute;
  static_assert(decltype(rank<0>(acc))::value == 3 && decltype(size<0, 0>(acc))::value == 2 &&
                    decltype(size<0, 1>(acc))::value == 2,
                "not the wgmma F32 accumulator layout");
  constexpr int kGroups = decltype(size<0, 2>(acc))::value, kMmaN = decltype(size<2>(acc))::value;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < accumulator_rows<AccTensor>; ++i)
    CUTLASS_PRAGMA_UNROLL
    for (int mn = 0; mn < kMmaN; ++mn)
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < kGroups; ++g)
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) f(i, c, g, mn);
}

// Where a thread's accumulators sit in the tile: row(i) of its rows, and column (c, g, mn) as `first_column` plus
// offset(c, g, mn), an offset every thread shares (thread 0's, constants once unrolled), so that a test against a
// column costs a compare with one register per thread, not a column held per accumulator. n0: the tile's first
// column; rows count from the tile's first row.
template <class TiledMma, class TileShapeMNK>
struct AccumulatorCoordinates {
  static CUTLASS_HOST_DEVICE auto identity() {
    return cute::make_identity_tensor(cute::make_shape(cute::size<0>(TileShapeMNK{}), cute::size<1>(TileShapeMNK{})));
  }
  using Coordinates = decltype(std::declval<TiledMma>().get_thread_slice(0).partition_C(identity()));
  Coordinates mine, shared;
  int first_column;
  CUTLASS_DEVICE AccumulatorCoordinates(TiledMma const& tiled_mma, int thread_idx, int n0)
      : mine(tiled_mma.get_thread_slice(thread_idx).partition_C(identity())),
        shared(tiled_mma.get_thread_slice(0).partition_C(identity())),
        first_column(n0 + static_cast<int>(cute::get<1>(mine(accumulator_at(0, 0, 0, 0))))) {}
  CUTLASS_DEVICE int row(int i) const { return static_cast<int>(cute::get<0>(mine(accumulator_at(i, 0, 0, 0)))); }
  CUTLASS_DEVICE int offset(int c, int g, int mn) const {
    return static_cast<int>(cute::get<1>(shared(accumulator_at(0, c, g, mn)))) -
           static_cast<int>(cute::get<1>(shared(accumulator_at(0, 0, 0, 0))));
  }
  CUTLASS_DEVICE int column(int c, int g, int mn) const { return first_column + offset(c, g, mn); }
};

// f(c, g, mn) once for each column a thread holds (the same in each of its rows), unrolled.
template <class AccTensor, class F>
CUTLASS_DEVICE void for_each_accumulator_column(AccTensor const& acc, F&& f) {
  using namespace cute;
  constexpr int kGroups = decltype(size<0, 2>(acc))::value, kMmaN = decltype(size<2>(acc))::value;
  CUTLASS_PRAGMA_UNROLL
  for (int mn = 0; mn < kMmaN; ++mn)
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < kGroups; ++g)
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 2; ++c) f(c, g, mn);
}

// out[rows, ld_out] of ElementD (void: no output) = what the pass leaves of x weight^T, kAlignD elements (16
// bytes) the store's unit.
template <class Pass, class ElementD, int kAlignD>
struct RegisterEpilogueGemm : LogitsGemmShape {
  using Params = typename Pass::Params;
  using LayoutD = cutlass::layout::RowMajor;
  using Callbacks = cutlass::epilogue::fusion::Sm90EVT<EpilogueParams<Params>, cutlass::epilogue::fusion::Sm90AccFetch>;

  // fp32 or no output: subtiles of 128x16, 16 KiB of epilogue shared memory for two (CUTLASS's automatic 128x32
  // takes 32 KiB, and reserves it even with no output, which RegisterEpilogue::store then never stores), so the
  // mainloop gets a fifth 40 KiB stage. bf16 (dz): the automatic subtile, which already leaves room for five.
  using EpilogueTile = cute::conditional_t<sizeof(cute::conditional_t<cute::is_void_v<ElementD>, float, ElementD>) == 4,
                                           cute::Shape<cute::_128, cute::_16>,
                                           cutlass::epilogue::collective::EpilogueTileAuto>;
  using StockEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      EpilogueTile, float, float, void, LayoutD, kAlignD, ElementD, LayoutD,
      kAlignD, cutlass::epilogue::TmaWarpSpecializedCooperative, Callbacks>::CollectiveOp;
  using Epilogue = RegisterEpilogue<StockEpilogue, Pass>;

  using Kernel = KernelWith<Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // `what` names the GEMM in the errors.
  static void run(const char* what, std::int64_t rows, std::int64_t columns, std::int64_t ld_h,
                  const __nv_bfloat16* x, const __nv_bfloat16* weight, void* out, std::int64_t ld_out,
                  std::int64_t promotion_k, const Params& params, cudaStream_t stream, void* workspace,
                  std::size_t workspace_bytes) {
    const std::uint32_t interval =
        promotion_k > 0 ? static_cast<std::uint32_t>(promotion_k / kMmaK) : (std::uint32_t{1} << 30);
    typename Kernel::StrideA stride_a{ld_h, cute::Int<1>{}, 0};
    typename Kernel::StrideB stride_b{ld_h, cute::Int<1>{}, 0};
    typename Epilogue::StrideD stride_d{ld_out, cute::Int<1>{}, 0};
    static const int sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    cutlass::KernelHardwareInfo hw{0, sm_count};
    cudaGetDevice(&hw.device_id);
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(rows), static_cast<int>(columns), static_cast<int>(ld_h), 1},
        {reinterpret_cast<const Element*>(x), stride_a, reinterpret_cast<const Element*>(weight), stride_b, interval},
        {{{}, params}, nullptr, stride_d, static_cast<ElementD*>(out), stride_d},
        hw};
    args.scheduler.max_swizzle_size = 1;
    Gemm gemm;
    const std::string name = what;
    if (Gemm::get_workspace_size(args) > workspace_bytes)
      throw CudaError(name + ": needs " + std::to_string(Gemm::get_workspace_size(args)) + " bytes of scratch, has " +
                      std::to_string(workspace_bytes));
    cutlass::Status status = gemm.can_implement(args);
    if (status != cutlass::Status::kSuccess)
      throw CudaError(name + " cannot run rows=" + std::to_string(rows) + " columns=" + std::to_string(columns) +
                      " ld_h=" + std::to_string(ld_h) + ": " + cutlass::cutlassGetStatusString(status));
    status = gemm.initialize(args, workspace, stream);
    if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
    if (status != cutlass::Status::kSuccess) throw CudaError(name + ": " + cutlass::cutlassGetStatusString(status));
    SIMPO_CUDA_CHECK_LAUNCH();
  }
};

}  // namespace simpo::fused::cuda
