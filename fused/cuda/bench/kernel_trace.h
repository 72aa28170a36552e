// A kernel-by-kernel timeline of a stretch of host code, from CUPTI's activity records (what nsys and
// torch.profiler read, here without either: the lent GPU machine has no nsys). Used by cuda_bench --kernels:
//
//   KernelTrace trace;          // starts recording kernels and copies on every stream
//   ... run the step n times ...
//   trace.stop();               // flushes the records
//   trace.print(stdout, n);     // per kernel name: device ms per step and launches; idle gaps by neighbours;
//                               // host API calls by time
//
// One trace at a time in a process (CUPTI's activity buffers are process-wide).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace simpo::fused::cuda {

struct TraceRecord {
  std::uint64_t start = 0, end = 0;  // ns, device timestamps
  std::string name;                  // demangled kernel name, or "memcpy ..."/"memset"
};

class KernelTrace {
 public:
  KernelTrace();
  ~KernelTrace();
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  void stop();
  const std::vector<TraceRecord>& records() const { return records_; }
  // Device time per kernel name (shortened: CUTLASS kernels by what they compute, cuBLAS's by its kernel name)
  // divided by `steps`, the sum, the span from the first start to the last end, and the largest idle gaps.
  void print(std::FILE* out, int steps) const;

 private:
  std::vector<TraceRecord> records_;       // kernels, copies, memsets (device timestamps)
  std::vector<TraceRecord> host_records_;  // runtime and driver API calls (host timestamps, same clock)
  bool stopped_ = false;
};

}  // namespace simpo::fused::cuda
