// The exact function of SPEC in float64 on the CPU: the oracle every other implementation is judged against.
// Reads the bf16 inputs exactly, computes in double, never holds all N x V logits at once.
#pragma once

#include "problem/problem.h"

#include <functional>

namespace simpo::reference {

struct Options {
  bool gradients = true;  // false: loss and auxiliary outputs only
  // Rows of logits held at once (bounds memory at rows * V * 8 bytes); 0 picks a size for ~256 MiB.
  std::int64_t chunk_rows = 0;
  // Called with the fraction done; the CLI prints it on stderr for long runs. May be empty.
  std::function<void(double)> progress;
};

// Validates (simpo::validate) and computes SPEC's outputs: every tensor F64, grad_bias only with a bias.
TensorMap compute(const Problem&, const Options& = {});

}  // namespace simpo::reference
