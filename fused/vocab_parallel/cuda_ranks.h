// The benchmark's view of the cuda ranks (bench/vocab_parallel_bench.cu): the step of cuda_ranks.cu with its
// inputs uploaded once and run several times.
#pragma once

#include "fused/vocab_parallel/vocab_parallel.h"

#include <string>
#include <vector>

namespace simpo::fused::vocab_parallel {

// One warm-up run, then `reps` timed runs of the whole step (every rank's work and collectives; each run ends
// with the ranks' streams synchronized and the row statistics on the host). Milliseconds per run, host clock.
// `schedule`, when given, receives the chunk plan the ranks followed (Schedule::to_string).
std::vector<double> time_ranks_cuda(const Problem&, const Options&, int shards, Communication, int reps,
                                    std::string* schedule = nullptr);

}  // namespace simpo::fused::vocab_parallel
