// The in-process collectives: G ranks on one GPU, each with its own stream and buffers. An all-reduce makes rank
// 0's stream wait for every rank's (events), reduces the G buffers element by element in rank order with one
// kernel, and makes every rank's stream wait for that kernel: the ordering a real collective gives, and the
// summation order of the cpu ranks (cpu_ranks.cpp).
#include "fused/cuda/cuda_check.h"
#include "fused/vocab_parallel/collectives.h"
#include "problem/problem.h"

#include <algorithm>
#include <string>

namespace simpo::fused::vocab_parallel {
namespace {

// The kernel takes the ranks' pointers by value: no device array to upload per call.
constexpr int kMaxRanks = 64;
template <class T> struct RankPointers {
  T* p[kMaxRanks];
};

template <class T, bool kMax>
__global__ void reduce_in_rank_order(RankPointers<T> buffers, int ranks, std::size_t count) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < count;
       i += std::size_t(gridDim.x) * blockDim.x) {
    T acc = buffers.p[0][i];
    for (int g = 1; g < ranks; ++g) {
      const T v = buffers.p[g][i];
      if constexpr (kMax) acc = v > acc ? v : acc;
      else acc += v;
    }
    for (int g = 0; g < ranks; ++g) buffers.p[g][i] = acc;
  }
}

template <class T>
void launch(std::span<const Collectives::Buffer> buffers, std::size_t count, Collectives::Op op, cudaStream_t stream) {
  RankPointers<T> p{};
  for (std::size_t g = 0; g < buffers.size(); ++g) p.p[g] = static_cast<T*>(buffers[g].data);
  const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((count + 255) / 256, 4096));
  const int ranks = static_cast<int>(buffers.size());
  if (op == Collectives::Op::max)
    reduce_in_rank_order<T, true><<<blocks, 256, 0, stream>>>(p, ranks, count);
  else
    reduce_in_rank_order<T, false><<<blocks, 256, 0, stream>>>(p, ranks, count);
  SIMPO_CUDA_CHECK_LAUNCH();
}

class InProcess final : public Collectives {
 public:
  InProcess(int ranks, int device) : ranks_(ranks), device_(device), events_(static_cast<std::size_t>(ranks)) {
    if (ranks < 1 || ranks > kMaxRanks)
      throw InputError("in-process collectives: " + std::to_string(ranks) + " ranks on one GPU; they hold 1 to " +
                       std::to_string(kMaxRanks));
    SIMPO_CUDA_CHECK(cudaSetDevice(device));
    for (cudaEvent_t& e : events_) SIMPO_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  ~InProcess() override {
    for (cudaEvent_t e : events_)
      if (e) cudaEventDestroy(e);
  }
  std::string name() const override { return "in-process"; }
  int ranks() const override { return ranks_; }
  int device(int) const override { return device_; }

  void all_reduce(std::span<const Buffer> buffers, std::size_t count, Type type, Op op) override {
    if (static_cast<int>(buffers.size()) != ranks_)
      throw InputError("in-process all_reduce: " + std::to_string(buffers.size()) + " buffers for " +
                       std::to_string(ranks_) + " ranks");
    if (count == 0) return;
    SIMPO_CUDA_CHECK(cudaSetDevice(device_));
    const cudaStream_t root = buffers[0].stream;
    for (int g = 1; g < ranks_; ++g) {  // rank 0's stream waits for every rank's work so far
      SIMPO_CUDA_CHECK(cudaEventRecord(events_[g], buffers[g].stream));
      SIMPO_CUDA_CHECK(cudaStreamWaitEvent(root, events_[g], 0));
    }
    if (type == Type::f32) launch<float>(buffers, count, op, root);
    else launch<double>(buffers, count, op, root);
    SIMPO_CUDA_CHECK(cudaEventRecord(events_[0], root));  // and every rank's stream waits for the reduction
    for (int g = 1; g < ranks_; ++g) SIMPO_CUDA_CHECK(cudaStreamWaitEvent(buffers[g].stream, events_[0], 0));
  }

 private:
  int ranks_, device_;
  std::vector<cudaEvent_t> events_;
};

}  // namespace

std::unique_ptr<Collectives> make_in_process_collectives(int ranks, int device) {
  return std::make_unique<InProcess>(ranks, device);
}

}  // namespace simpo::fused::vocab_parallel
