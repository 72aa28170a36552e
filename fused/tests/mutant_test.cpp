// Every mutant of the cpu backend must be caught: on a case built to exercise its bug class, the mutant misses
// the accuracy bar against the reference on some output, while the unmutated backend meets it on the very same
// case and options (so the miss is the mutant's doing, not the case's).
#include "fused/fused.h"
#include "fused/mutant.h"
#include "fused/tests/accuracy.h"
#include "problem/generate.h"
#include "reference/reference.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <string>

namespace simpo::fused {
namespace {

struct MutantCase {
  Problem problem;
  Options options;
  double logit_scale = 2.0;
  // Judge the gradients alone. For sequences of confident tokens only (logps near 0) the 5e-7 relative bar on
  // logps is out of any fp32-logit method's reach: l ~ -sum_v exp(z_v - z_max) has the logits' absolute error
  // (~ulp(30) = 2e-6 at scale 30) as its relative error. The bar was set for the generator's random targets.
  bool gradients_only = false;
};

// Retarget every completion position to its row's argmax logit (computed in double), so p_target is near 1:
// where 1 - p is small and only an exact target term keeps it.
void target_the_argmax(Problem& p) {
  const Shape& s = p.shape;
  for (std::int64_t r = 0; r < s.N(); ++r) {
    if (p.target[static_cast<std::size_t>(r)] == p.hp.ignore_index) continue;
    std::int64_t best = 0;
    double best_z = -INFINITY;
    for (std::int64_t v = 0; v < s.V; ++v) {
      double z = p.has_bias() ? static_cast<double>(static_cast<float>(p.bias->as<bf16>()[static_cast<std::size_t>(v)])) : 0.0;
      for (std::int64_t h = 0; h < s.H; ++h)
        z += static_cast<double>(static_cast<float>(p.x.as<bf16>()[static_cast<std::size_t>(r * s.H + h)])) *
             static_cast<double>(static_cast<float>(p.weight.as<bf16>()[static_cast<std::size_t>(v * s.H + h)]));
      if (z > best_z) best_z = z, best = v;
    }
    p.target[static_cast<std::size_t>(r)] = best;
  }
}

// The default case has a bias, label smoothing, ignored prompt prefixes and uneven two_pass token chunks
// (N = 64 rows in chunks of 20: 20, 20, 20, 4); a few bug classes need more.
MutantCase case_for(Mutant mutant) {
  CaseSpec spec;
  spec.shape = {.B = 4, .T = 16, .H = 32, .V = 64};
  spec.bias = true;
  spec.hp.label_smoothing = 0.1;
  spec.ignore = IgnorePattern::prompt_prefix;
  spec.seed = 61;
  MutantCase c;
  c.options.backend = Backend::cpu;
  c.options.max_chunk_rows = 20;
  switch (mutant) {
    case Mutant::softmax_rounded_before_onehot:
    case Mutant::lse_without_max_shift:
      spec.logit_scale = 30.0;  // logits past fp32's exp range; confident predictions
      break;
    case Mutant::empty_sequence_nan:
      spec.ignore = IgnorePattern::empty_sequence;
      spec.hp.empty_sequence = EmptySequence::zero;
      break;
    case Mutant::grad_x_in_input_buffer:
      spec.shape.V = 1024;  // 64 tiles of 16 columns: 64 roundings of the running grad_x
      break;
    case Mutant::weight_grad_bf16_accumulation:
      c.options.max_chunk_rows = 4;  // 16 chunks: 16 bf16 roundings of the running sum
      break;
    default: break;
  }
  c.logit_scale = spec.logit_scale;
  c.problem = generate(spec);
  if (mutant == Mutant::softmax_rounded_before_onehot) {
    target_the_argmax(c.problem);
    c.gradients_only = true;
  }
  return c;
}

class EveryMutant : public ::testing::TestWithParam<Mutant> {};

TEST_P(EveryMutant, MissesTheBarWhereTheCorrectBackendMeetsIt) {
  const MutantCase c = case_for(GetParam());
  const TensorMap exact = reference::compute(c.problem);
  const double mean_tolerance = 1e-6 * c.logit_scale;  // as in cpu_backend_test.cpp
  auto misses = [&](const TensorMap& out) {
    auto all = testing::bar_violations(out, exact, mean_tolerance);
    if (c.gradients_only)
      std::erase_if(all, [](const std::string& m) { return !is_gradient_output(m.substr(0, m.find_first_of(":["))); });
    return all;
  };

  const auto correct_misses = misses(compute(c.problem, c.options));
  EXPECT_TRUE(correct_misses.empty()) << "the unmutated backend misses the bar: " << correct_misses.front();

  const auto mutant_misses = misses(compute_mutant(c.problem, c.options, GetParam()));
  ASSERT_FALSE(mutant_misses.empty()) << mutant_name(GetParam()) << " was not caught";
  for (const auto& m : mutant_misses) std::cout << "  " << mutant_name(GetParam()) << ": " << m << "\n";
}

INSTANTIATE_TEST_SUITE_P(CpuBackend, EveryMutant, ::testing::ValuesIn(all_mutants()),
                         [](const auto& info) { return mutant_name(info.param); });

}  // namespace
}  // namespace simpo::fused
