// The mutation catalogue: every deliberate fault in fused::all_mutants() must be caught by the sweep within
// the default budget (the budget `simpo-verify mutants` uses). A mutant that survives means a property or the
// error model lost its teeth.
#include "verifier/properties.h"

#include <gtest/gtest.h>

namespace simpo::fused {
// Names the mutant in test output (found by argument-dependent lookup).
inline void PrintTo(Mutant m, std::ostream* os) { *os << mutant_name(m); }
}  // namespace simpo::fused

namespace simpo::property_tests {
namespace {

constexpr std::int64_t default_mutant_budget = 400;  // cases; `simpo-verify mutants --cases` default

class MutantIsKilled : public ::testing::TestWithParam<fused::Mutant> {};

TEST_P(MutantIsKilled, WithinTheDefaultBudget) {
  const verifier::Implementation impl = verifier::fused_implementation(fused::Backend::cpu, GetParam());
  verifier::SweepOptions options;
  options.max_cases = default_mutant_budget;
  options.time_budget_s = 0;
  options.stop_at_first_failure = true;
  options.shrink = false;  // the CLI shrinks; here only the kill matters
  const verifier::SweepResult r = verifier::run_sweep(impl, options);
  ASSERT_FALSE(r.failures.empty()) << impl.name << " survived " << r.cases << " cases";
  const auto& ce = r.failures.front();
  std::printf("%s killed by %s after %lld cases: %s\n", impl.name.c_str(), ce.outcome.property.c_str(),
              static_cast<long long>(ce.case_index + 1), ce.outcome.detail.substr(0, 200).c_str());
}

INSTANTIATE_TEST_SUITE_P(AllMutants, MutantIsKilled, ::testing::ValuesIn(fused::all_mutants()),
                         [](const auto& info) { return fused::mutant_name(info.param); });

// Specificity on the same stream of cases: the correct backend fails none of the first cases the mutants died on.
TEST(CorrectBackend, PassesTheMutantSweepCases) {
  verifier::SweepOptions options;
  options.max_cases = 60;
  options.time_budget_s = 0;
  options.shrink = false;
  const verifier::SweepResult r = verifier::run_sweep(verifier::fused_implementation(fused::Backend::cpu), options);
  for (const auto& ce : r.failures)
    ADD_FAILURE() << ce.outcome.property << " on " << ce.original.to_string() << ": " << ce.outcome.detail;
  EXPECT_EQ(r.cases, 60);
}

}  // namespace
}  // namespace simpo::property_tests
