// The NCCL collectives: one communicator over one GPU per rank, every local rank's ncclAllReduce in one group
// (NCCL's way for one thread to drive several GPUs). The same code serves one process per GPU: a process would
// pass its one device and the shared unique id; this build drives all G ranks from the calling process.
#include "fused/cuda/cuda_check.h"
#include "fused/vocab_parallel/collectives.h"
#include "problem/problem.h"

#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <string>

namespace simpo::fused::vocab_parallel {
namespace {

void check_nccl(ncclResult_t status, const char* call) {
  if (status != ncclSuccess)
    throw cuda::CudaError(std::string("NCCL: ") + call + " failed: " + ncclGetErrorString(status) + " (" +
                          (ncclGetLastError(nullptr) ? ncclGetLastError(nullptr) : "") + ")");
}
#define SIMPO_NCCL_CHECK(call) check_nccl((call), #call)

class Nccl final : public Collectives {
 public:
  explicit Nccl(const std::vector<int>& devices) : devices_(devices), comms_(devices.size(), nullptr) {
    if (devices.empty()) throw InputError("NCCL collectives: no devices");
    std::vector<int> sorted = devices;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      throw InputError("NCCL collectives: a device holds two ranks; NCCL refuses that (\"Duplicate GPU\"): use the "
                       "in-process collectives for several ranks on one GPU");
    // NVLink multicast (NVLS) off, whatever the environment says: on a shared host it can take the GPUs down.
    // (Set only when not already "0": setenv races with other threads' getenv, e.g. case's concurrent reference.)
    const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
    if (nvls == nullptr || std::string(nvls) != "0") setenv("NCCL_NVLS_ENABLE", "0", 1);
    ncclUniqueId id;
    SIMPO_NCCL_CHECK(ncclGetUniqueId(&id));
    const int n = static_cast<int>(devices.size());
    SIMPO_NCCL_CHECK(ncclGroupStart());
    for (int g = 0; g < n; ++g) {
      SIMPO_CUDA_CHECK(cudaSetDevice(devices[g]));
      SIMPO_NCCL_CHECK(ncclCommInitRank(&comms_[g], n, id, g));
    }
    SIMPO_NCCL_CHECK(ncclGroupEnd());
  }
  ~Nccl() override {
    for (ncclComm_t c : comms_)
      if (c) ncclCommDestroy(c);
  }
  std::string name() const override { return "nccl"; }
  int ranks() const override { return static_cast<int>(devices_.size()); }
  int device(int rank) const override { return devices_[static_cast<std::size_t>(rank)]; }

  void all_reduce(std::span<const Buffer> buffers, std::size_t count, Type type, Op op) override {
    if (buffers.size() != comms_.size())
      throw InputError("NCCL all_reduce: " + std::to_string(buffers.size()) + " buffers for " +
                       std::to_string(comms_.size()) + " ranks");
    if (count == 0) return;
    const ncclDataType_t t = type == Type::f32 ? ncclFloat32 : ncclFloat64;
    const ncclRedOp_t o = op == Op::max ? ncclMax : ncclSum;
    SIMPO_NCCL_CHECK(ncclGroupStart());
    for (std::size_t g = 0; g < comms_.size(); ++g)
      SIMPO_NCCL_CHECK(ncclAllReduce(buffers[g].data, buffers[g].data, count, t, o, comms_[g], buffers[g].stream));
    SIMPO_NCCL_CHECK(ncclGroupEnd());
  }

 private:
  std::vector<int> devices_;
  std::vector<ncclComm_t> comms_;
};

}  // namespace

std::unique_ptr<Collectives> make_nccl_collectives(const std::vector<int>& devices) {
  return std::make_unique<Nccl>(devices);
}

bool nccl_built() { return true; }

}  // namespace simpo::fused::vocab_parallel
