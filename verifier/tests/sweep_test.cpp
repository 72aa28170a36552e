// The sweep judges cases on several threads when the implementation allows it (SweepOptions::threads): what it
// reports for a given seed and case count must not depend on how many.
#include "verifier/sweep.h"

#include <gtest/gtest.h>

namespace simpo::verifier {
namespace {

SweepResult sweep(const Implementation& impl, int threads, std::int64_t cases, bool stop_at_first_failure) {
  SweepOptions options;
  options.seed = 77;
  options.max_cases = cases;
  options.time_budget_s = 0;
  options.threads = threads;
  options.shrink = false;
  options.stop_at_first_failure = stop_at_first_failure;
  return run_sweep(impl, options);
}

TEST(Sweep, ThreadCountDoesNotChangeTheResult) {
  const Implementation cpu = fused_implementation(fused::Backend::cpu);
  ASSERT_TRUE(cpu.concurrent);
  const SweepResult one = sweep(cpu, 1, 30, false), four = sweep(cpu, 4, 30, false);
  EXPECT_EQ(one.cases, 30);
  EXPECT_EQ(four.cases, 30);
  EXPECT_EQ(one.passed, four.passed);
  EXPECT_EQ(one.failed, four.failed);
  EXPECT_EQ(one.skipped, four.skipped);
  EXPECT_EQ(one.worst_margin, four.worst_margin);
}

// A mutant's first failing case is the same case, and the cases after it in its batch are not counted.
TEST(Sweep, FirstFailureIsTheSameCaseOnAnyThreadCount) {
  const Implementation mutant = fused_implementation(fused::Backend::cpu, fused::Mutant::lse_without_max_shift);
  const SweepResult one = sweep(mutant, 1, 200, true), four = sweep(mutant, 4, 200, true);
  ASSERT_EQ(one.failures.size(), 1u);
  ASSERT_EQ(four.failures.size(), 1u);
  EXPECT_EQ(one.failures[0].case_index, four.failures[0].case_index);
  EXPECT_EQ(one.cases, four.cases);
  EXPECT_EQ(one.cases, one.failures[0].case_index + 1);
  EXPECT_EQ(one.passed, four.passed);
  EXPECT_EQ(one.failures[0].outcome.property, four.failures[0].outcome.property);
}

}  // namespace
}  // namespace simpo::verifier
