// Built instead of cuda_ranks.cu (and the collectives) when CMake found no CUDA compiler: the cuda ranks are
// absent and say so by name.
#include "fused/vocab_parallel/vocab_parallel.h"

namespace simpo::fused::vocab_parallel {

bool nccl_built() { return false; }

CudaPlan plan_cuda(int shards, Communication) {
  throw InputError("--vocab-shards " + std::to_string(shards) + " with the cuda backend: this build has no CUDA "
                   "support (no nvcc at configure time); --impl cpu runs the ranks' algebra on the CPU");
}

std::vector<RankOutputs> compute_ranks_cuda(const Problem& problem, const Options& options, int shards, Communication c) {
  validate(problem, {.scan_values = options.validate});
  plan_cuda(shards, c);
  return {};
}

}  // namespace simpo::fused::vocab_parallel
