// The fused algorithm in portable C++ (Eigen fp32 GEMMs on bf16-valued operands, OpenMP): the same chunk
// schedule (fused/schedule.h) and numerics as the cuda backend, for CI and machines without a GPU. It also
// carries every Mutant (fused/mutant.h: compute_mutant), each a small marked deviation, for the verifier's mutation
// tests.
#pragma once

#include "fused/fused.h"

namespace simpo::fused::cpu {

// SPEC's outputs; validates first (simpo::validate), like the cuda backend: each backend is an entry point.
TensorMap compute(const Problem&, const Options&);

}  // namespace simpo::fused::cpu
