// A pass-through node of CUTLASS's epilogue visitor tree that carries one struct of parameters, P, from the
// GEMM's arguments to the epilogue collective. The promoted GEMMs whose epilogues work on the whole accumulator
// tile in registers before CUTLASS's store (StatsEpilogue, promoted_stats.cu; DzEpilogue, promoted_dz.cu) read
// their parameters from it (`params.thread.op_1`); the tree itself hands the accumulator to the store
// unchanged. Needs CUTLASS (include after its epilogue fusion headers).
#pragma once

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

}  // namespace simpo::fused::cuda
