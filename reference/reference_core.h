// The reference's arithmetic on double inputs. compute() widens the bf16 problem (exactly) and calls this; the
// finite-difference tests call it directly, on inputs perturbed by steps far smaller than any bf16 spacing.
#pragma once

#include "problem/problem.h"
#include "reference/reference.h"

#include <cstdint>
#include <span>
#include <vector>

namespace simpo::reference {

struct DoubleInputs {
  Shape shape;
  Hyperparameters hp;
  std::span<const double> x;             // [B, T, H]
  std::span<const double> weight;        // [V, H]
  std::span<const double> bias;          // [V], or empty: no bias
  std::span<const std::int64_t> target;  // [B, T]
};

// The forward outputs; the rewards are beta times the logps and are formed by compute().
struct ForwardOutputs {
  double loss = 0, nll_loss = 0, chosen_logits_mean = 0, rejected_logits_mean = 0;
  std::vector<double> chosen_logps, rejected_logps;  // [P]
};

// Where the gradients of grad_scale * loss go, each sized like its input (bias: empty without a bias). They are
// overwritten. Leave all three empty when Options::gradients is false.
struct GradientOutputs {
  std::span<double> x, weight, bias;
};

// Precondition: the problem these inputs describe passes simpo::validate (compute() checks it; the tests build
// inputs from validated problems). Only the sizes are checked here (InputError naming the span).
ForwardOutputs compute_core(const DoubleInputs&, const Options&, GradientOutputs = {});

// bf16 -> double is exact: every bf16 is a float, every float a double.
std::vector<double> widen(std::span<const bf16>);

}  // namespace simpo::reference
