// rapidcheck's view of a verifier::Case: the sweep's own distribution (verifier/case.h: random_case and its
// pieces), with every choice drawn from a rapidcheck generator instead of the sweep's Rng. So the rapidcheck
// tests explore exactly the space the sweep does, and rapidcheck shrinks each choice toward 0, which the
// distribution's pieces map to their simplest value (P = 1, T = 1, H = 1, V = 1, default beta, no chunk cap, ...).
#pragma once

#include "verifier/properties.h"

#include <rapidcheck.h>

namespace simpo::property_tests {

class RapidcheckChooser : public verifier::Chooser {
 public:
  double uniform() override {
    constexpr std::int64_t steps = std::int64_t{1} << 24;
    return static_cast<double>(*rc::gen::inRange<std::int64_t>(0, steps)) / static_cast<double>(steps);
  }
  std::int64_t below(std::int64_t n) override { return *rc::gen::inRange<std::int64_t>(0, n); }
  std::uint64_t seed() override { return *rc::gen::inRange<std::uint64_t>(0, 1000000); }
};

inline rc::Gen<verifier::Case> gen_case(verifier::CaseDistribution distribution = {}) {
  return rc::gen::exec([distribution] {
    RapidcheckChooser chooser;
    verifier::Case c = verifier::random_case(chooser, distribution);
    c.spec.description = "property test case: " + c.to_string();
    return c;
  });
}

}  // namespace simpo::property_tests

// How rapidcheck prints a case in its counterexample report (found by argument-dependent lookup).
namespace simpo::verifier {
inline void showValue(const Case& c, std::ostream& os) { os << c.to_string(); }
}  // namespace simpo::verifier
