// The cases both vocab-parallel suites run (the cpu ranks in vocab_parallel_test.cpp, the cuda ranks in
// cuda_ranks_test.cpp): one small problem whose V no G > 1 divides, the features it is run with, and the strict
// verdict against the float64 reference.
#pragma once

#include "fused/fused.h"
#include "problem/generate.h"
#include "reference/reference.h"
#include "verifier/error_model.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace simpo::fused::vocab_parallel::shard_cases {

inline CaseSpec small_case(std::uint64_t seed) {
  CaseSpec spec;
  spec.shape = {4, 6, 24, 67};  // 67 is prime: no G > 1 divides it
  spec.seed = seed;
  return spec;
}

inline void expect_strict_pass(const Problem& problem, const TensorMap& candidate, bool gradients = true) {
  reference::Options ro;
  ro.gradients = gradients;
  const TensorMap exact = reference::compute(problem, ro);
  const verifier::Report report = verifier::compare(problem, exact, candidate, verifier::strict_profile());
  EXPECT_TRUE(report.passed()) << verifier::format_table(report);
}

struct Feature {
  const char* name;
  void (*apply)(CaseSpec&, Options&);
};

inline const std::vector<Feature>& features() {
  static const std::vector<Feature> all = {
      {"plain", [](CaseSpec&, Options&) {}},
      {"bias", [](CaseSpec& s, Options&) { s.bias = true; }},
      {"label_smoothing_bias", [](CaseSpec& s, Options&) { s.bias = true; s.hp.label_smoothing = 0.2; }},
      {"ignore_index_inside_vocab", [](CaseSpec& s, Options&) { s.hp.ignore_index = 5; }},
      {"logit_scale_30", [](CaseSpec& s, Options&) { s.logit_scale = 30; }},
      {"no_nll_grad_scale", [](CaseSpec& s, Options&) { s.hp.compute_nll_loss = false; s.hp.grad_scale = -2.5; }},
      {"three_pass_chunks", [](CaseSpec&, Options& o) { o.max_chunk_rows = 12; }},  // one pair a chunk
      {"two_pass_chunks", [](CaseSpec&, Options& o) { o.max_chunk_rows = 5; }},    // a pair does not fit
      {"single_token", [](CaseSpec& s, Options&) { s.shape.T = 1; s.ignore = IgnorePattern::none; }},
  };
  return all;
}

}  // namespace simpo::fused::vocab_parallel::shard_cases
