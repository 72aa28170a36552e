// The cpu backend's own tests, beside the suite both backends pass (backend_suite.cpp, built into this
// executable as the CpuBackend* tests): plan() cutting chunks exactly where a budget allows, and the fused entry
// point (validation, names, backend resolution), which needs no backend-specific code.
#include "fused/fused.h"
#include "fused/schedule.h"
#include "fused/tests/backend_suite.h"
#include "problem/generate.h"
#include "reference/reference.h"

#include <gtest/gtest.h>

#include <cmath>

namespace simpo::fused {
namespace {

using namespace suite;

Options cpu_options() { return options_for(Backend::cpu); }

// ---- schedules and budgets: one result up to fp32 noise ----

TEST(CpuBackendSchedules, WorkspaceBudgetsGiveOneResult) {
  CaseSpec spec = spec_of({.B = 6, .T = 40, .H = 64, .V = 257}, 2.0, 41);
  spec.bias = true;
  const Problem problem = generate(spec);
  const TensorMap whole = compute(problem, cpu_options());
  const TensorMap exact = reference::compute(problem);
  const std::int64_t row_bytes = workspace_bytes_per_row(problem.shape, true);
  for (std::int64_t rows : {1, 7, 79, 80, 81, 160, 239}) {
    SCOPED_TRACE("budget of " + std::to_string(rows) + " rows");
    Options options = cpu_options();
    options.workspace_bytes = rows * row_bytes + row_bytes / 2;
    EXPECT_EQ(plan(problem.shape, options).chunk_rows, rows);
    expect_same_to_fp32_noise(compute(problem, options), whole, &exact);
  }
}

// ---- the entry point ----

TEST(FusedEntryPoint, ValidateOffSkipsOnlyTheValueScan) {
  Problem problem = generate(spec_of({.B = 2, .T = 4, .H = 8, .V = 16}, 2.0, 52));
  problem.x.as<bf16>()[5] = bf16(NAN);
  Options options = cpu_options();
  EXPECT_THROW(compute(problem, options), InputError);  // the scan names x and its first bad index
  options.validate = false;
  EXPECT_NO_THROW(compute(problem, options));  // the caller vouched for the values
  problem.shape.B = 3;  // shape rules are checked whatever the option
  EXPECT_THROW(compute(problem, options), InputError);
}

TEST(FusedEntryPoint, NamesRoundTrip) {
  for (Backend b : {Backend::automatic, Backend::cpu, Backend::cuda}) EXPECT_EQ(backend_from_name(backend_name(b)), b);
  EXPECT_THROW(backend_from_name("gpu"), InputError);
  EXPECT_EQ(all_mutants().size(), 17u);
  for (Mutant m : all_mutants()) {
    EXPECT_NE(m, Mutant::none);
    EXPECT_EQ(mutant_from_name(mutant_name(m)), m);
  }
  EXPECT_THROW(mutant_from_name("no_such_mutant"), InputError);
}

TEST(FusedEntryPoint, ResolveFollowsTheDevice) {
  EXPECT_EQ(resolve(Backend::cpu), Backend::cpu);
  EXPECT_EQ(resolve(Backend::automatic), cuda_available() ? Backend::cuda : Backend::cpu);
  if (!cuda_available()) {
    EXPECT_THROW(resolve(Backend::cuda), InputError);
  }
}

}  // namespace
}  // namespace simpo::fused
