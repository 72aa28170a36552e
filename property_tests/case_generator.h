// rapidcheck's view of a verifier::Case: every field drawn from its own generator, so a failure shrinks field by
// field (smaller shapes, default hyperparameters, no bias, no ignore pattern, no chunk cap). The distribution
// follows the issue: B even 2..16, T 1..300 (mostly small), H and V with primes and non-multiples of 8 (V up
// to ~3000), every hyperparameter over SPEC's range, every ignore pattern (the empty-sequence one included,
// which SPEC makes an error unless empty_sequence = zero), logit scales 0.1..30, bias on and off, grad_scale.
#pragma once

#include "verifier/properties.h"

#include <rapidcheck.h>

#include <cmath>

namespace simpo::property_tests {

// A double in [lo, hi] on a log scale, in 1000 steps (shrinks toward lo).
inline rc::Gen<double> log_range(double lo, double hi) {
  return rc::gen::map(rc::gen::inRange(0, 1001), [lo, hi](int k) { return lo * std::pow(hi / lo, k / 1000.0); });
}
inline rc::Gen<double> linear_range(double lo, double hi) {
  return rc::gen::map(rc::gen::inRange(0, 1001), [lo, hi](int k) { return lo + (hi - lo) * (k / 1000.0); });
}
template <class T> rc::Gen<T> mostly(T usual, rc::Gen<T> other, std::size_t usual_weight = 1, std::size_t other_weight = 1) {
  return rc::gen::weightedOneOf<T>({{usual_weight, rc::gen::just(usual)}, {other_weight, other}});
}

inline rc::Gen<verifier::Case> gen_case() {
  return rc::gen::exec([] {
    verifier::Case c;
    CaseSpec& s = c.spec;
    s.shape.B = 2 * *rc::gen::inRange<std::int64_t>(1, 9);
    s.shape.T = *rc::gen::weightedOneOf<std::int64_t>(
        {{6, rc::gen::inRange<std::int64_t>(1, 17)}, {3, rc::gen::inRange<std::int64_t>(17, 65)},
         {1, rc::gen::inRange<std::int64_t>(65, 301)}});
    s.shape.H = *rc::gen::oneOf(rc::gen::inRange<std::int64_t>(1, 161),
                                rc::gen::element<std::int64_t>(1, 3, 7, 13, 31, 33, 61, 97, 127, 131));
    s.shape.V = *rc::gen::weightedOneOf<std::int64_t>(
        {{4, rc::gen::inRange<std::int64_t>(1, 33)}, {4, rc::gen::inRange<std::int64_t>(33, 513)},
         {2, rc::gen::element<std::int64_t>(509, 1021, 1031, 2039, 2053, 3001)}});
    // A few milliseconds per case: the reference does ~6 N H V flops.
    while (s.shape.T > 1 && s.shape.N() * s.shape.H * s.shape.V > 4'000'000) s.shape.T /= 2;
    while (s.shape.H > 1 && s.shape.N() * s.shape.H * s.shape.V > 4'000'000) s.shape.H /= 2;

    const Hyperparameters defaults;
    Hyperparameters& hp = s.hp;
    hp.beta = *mostly(defaults.beta, log_range(0.01, 10.0));
    hp.gamma = *mostly(defaults.gamma, linear_range(-3.0, 3.0));
    hp.alpha = *mostly(defaults.alpha, linear_range(0.0, 2.0));
    hp.label_smoothing = *mostly(defaults.label_smoothing, linear_range(0.0, 0.5));
    hp.compute_nll_loss = *mostly(true, rc::gen::just(false), 4, 1);
    hp.grad_scale = *mostly(defaults.grad_scale, rc::gen::oneOf(linear_range(-4.0, 4.0), rc::gen::just(0.0)));
    hp.ignore_index = *mostly(defaults.ignore_index,
                              rc::gen::oneOf(rc::gen::inRange<std::int64_t>(-1000, -1),
                                             rc::gen::inRange<std::int64_t>(0, s.shape.V)),
                              4, 1);
    hp.empty_sequence = *mostly(EmptySequence::error, rc::gen::just(EmptySequence::zero), 5, 1);
    s.bias = *rc::gen::arbitrary<bool>();
    s.logit_scale = *mostly(2.0, rc::gen::oneOf(log_range(0.1, 30.0), rc::gen::element(0.1, 30.0)));
    s.ignore = *rc::gen::element(IgnorePattern::none, IgnorePattern::random, IgnorePattern::prompt_prefix,
                                 IgnorePattern::all_but_one, IgnorePattern::empty_sequence);
    s.seed = *rc::gen::inRange<std::uint64_t>(0, 1000000);
    const std::int64_t N = s.shape.N();
    c.max_chunk_rows = *mostly<std::int64_t>(0, rc::gen::inRange<std::int64_t>(1, N + 1));
    c.workspace_bytes = *mostly(fused::default_workspace_bytes, rc::gen::just(fused::min_workspace_bytes), 9, 1);
    s.description = "property test case: " + c.to_string();
    return c;
  });
}

}  // namespace simpo::property_tests

// How rapidcheck prints a case in its counterexample report (found by argument-dependent lookup).
namespace simpo::verifier {
inline void showValue(const Case& c, std::ostream& os) { os << c.to_string(); }
}  // namespace simpo::verifier
