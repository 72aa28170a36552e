// The collectives of the vocab-parallel step, behind one small interface: in-place all-reduces over the ranks
// this process drives, each rank's buffer enqueued on that rank's stream (no host synchronization). Two forms:
//   nccl        one GPU per rank, ncclAllReduce in one ncclGroupStart/End over the local ranks (nccl_collectives.cu)
//   in process  G ranks on one GPU: a kernel reduces the G buffers in rank order and writes the result back to
//               each (local_collectives.cu); NCCL itself refuses two ranks of a communicator on one GPU
// Either way every rank ends with bit-identical reduced values, which gather() checks.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace simpo::fused::vocab_parallel {

class Collectives {
 public:
  enum class Type { f32, f64 };
  enum class Op { sum, max };
  struct Buffer {
    void* data;           // `count` elements of `Type` on the rank's device
    cudaStream_t stream;  // the rank's stream: the reduction is ordered after its earlier work there
  };

  virtual ~Collectives() = default;
  virtual std::string name() const = 0;  // "nccl", "in-process"
  virtual int ranks() const = 0;
  virtual int device(int rank) const = 0;  // the CUDA device rank `rank` runs on
  // buffers[g] is rank g's; afterwards (in each rank's stream order) every buffer holds the reduction.
  virtual void all_reduce(std::span<const Buffer> buffers, std::size_t count, Type, Op) = 0;
};

// G ranks on CUDA device `device`, reduced in rank order by a kernel on rank 0's stream (events order the others).
std::unique_ptr<Collectives> make_in_process_collectives(int ranks, int device);

// One rank per device in `devices` (distinct), one NCCL communicator of them all (ncclCommInitRank per rank in one
// group). Sets NCCL_NVLS_ENABLE=0 first: NVLink multicast stays off. InputError when NCCL was not built, or when
// a device repeats (NCCL's "Duplicate GPU").
std::unique_ptr<Collectives> make_nccl_collectives(const std::vector<int>& devices);

}  // namespace simpo::fused::vocab_parallel
