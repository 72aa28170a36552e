// Built instead of nccl_collectives.cu when CMake found no NCCL: the NCCL form is absent and says so by name.
#include "fused/vocab_parallel/collectives.h"
#include "fused/vocab_parallel/vocab_parallel.h"
#include "problem/problem.h"

namespace simpo::fused::vocab_parallel {

std::unique_ptr<Collectives> make_nccl_collectives(const std::vector<int>&) {
  throw InputError("the NCCL collectives are not in this build (CMake found no nccl.h / libnccl at configure "
                   "time); the in-process collectives run G ranks on one GPU");
}

bool nccl_built() { return false; }

}  // namespace simpo::fused::vocab_parallel
