// Builders for the reference tests' problems: hyperparameters and seeded case specs in one line each.
#pragma once

#include "problem/generate.h"

#include <cstdint>
#include <string>

namespace simpo::reference::testing {

inline Hyperparameters hyperparameters(double beta, double gamma, double alpha, double ls, double grad_scale,
                                       bool nll = true, EmptySequence empty = EmptySequence::error) {
  Hyperparameters hp;
  hp.beta = beta;
  hp.gamma = gamma;
  hp.alpha = alpha;
  hp.label_smoothing = ls;
  hp.grad_scale = grad_scale;
  hp.compute_nll_loss = nll;
  hp.empty_sequence = empty;
  return hp;
}

inline CaseSpec case_spec(Shape shape, bool bias, IgnorePattern ignore, double logit_scale, std::uint64_t seed,
                          Hyperparameters hp = {}, std::string description = {}) {
  CaseSpec c;
  c.shape = shape;
  c.bias = bias;
  c.ignore = ignore;
  c.logit_scale = logit_scale;
  c.seed = seed;
  c.hp = hp;
  c.description = std::move(description);
  return c;
}

}  // namespace simpo::reference::testing
