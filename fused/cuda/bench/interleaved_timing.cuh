// The benches' timer: CUDA events around each body, the bodies taking turns (a, b, a, b, ...) after `warmup` untimed
// rounds, so that a candidate and the floor it is a ratio to see the same clocks and temperature, which drift over a
// run by more than the differences measured. Static: each benchmark's translation unit has its own.
#pragma once

#include "fused/cuda/cuda_check.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

namespace simpo::fused::cuda::bench {

struct Timing {
  double median_ms = 0, min_ms = 0;
};

// Median and minimum of `reps` event-timed calls of each body, in turns, on `stream`.
static std::vector<Timing> time_interleaved(cudaStream_t stream, int warmup, int reps,
                                            const std::vector<std::function<void()>>& bodies) {
  for (int i = 0; i < warmup; ++i)
    for (const auto& body : bodies) body();
  SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  SIMPO_CUDA_CHECK(cudaEventCreate(&start));
  SIMPO_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<std::vector<double>> ms(bodies.size());
  for (int i = 0; i < reps; ++i)
    for (std::size_t b = 0; b < bodies.size(); ++b) {
      SIMPO_CUDA_CHECK(cudaEventRecord(start, stream));
      bodies[b]();
      SIMPO_CUDA_CHECK(cudaEventRecord(stop, stream));
      SIMPO_CUDA_CHECK(cudaEventSynchronize(stop));
      float elapsed = 0;
      SIMPO_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
      ms[b].push_back(elapsed);
    }
  SIMPO_CUDA_CHECK(cudaEventDestroy(start));
  SIMPO_CUDA_CHECK(cudaEventDestroy(stop));
  std::vector<Timing> out;
  for (auto& m : ms) {
    std::sort(m.begin(), m.end());
    out.push_back({m[m.size() / 2], m.front()});
  }
  return out;
}

// A GEMM table of time_interleaved's result: the shape, then per body its median, TFLOP/s and ratio to the first
// body's (the floor), names[i] naming bodies[i].
static inline void print_gemm_timings(std::int64_t M, std::int64_t N, std::int64_t K, int reps,
                                      const std::vector<const char*>& names, const std::vector<Timing>& t) {
  const double flop = 2.0 * double(M) * double(N) * double(K);
  std::printf("M = %lld, N = %lld, K = %lld, median of %d in turns\n", (long long)M, (long long)N, (long long)K, reps);
  for (std::size_t i = 0; i < t.size() && i < names.size(); ++i)
    std::printf("  %-28s %7.3f ms  %5.0f TFLOP/s  %.3fx floor\n", names[i], t[i].median_ms,
                flop / t[i].median_ms * 1e-9, t[i].median_ms / t[0].median_ms);
}

}  // namespace simpo::fused::cuda::bench
