// The shared pieces on their own: the chunk plan (coverage, modes, byte accounting, errors), the scalar math
// of simpo_math.h against long double at the extremes where a naive formula breaks, and forward_outputs'
// contract on the row stats.
#include "fused/forward_outputs.h"
#include "fused/schedule.h"
#include "fused/simpo_math.h"
#include "problem/generate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

namespace simpo::fused {
namespace {

// Every row in exactly one chunk; three_pass chunks hold whole pairs, chosen part first.
void expect_covers_every_row_once(const Shape& shape, const Schedule& s) {
  std::vector<int> seen(static_cast<std::size_t>(shape.N()), 0);
  for (const Chunk& c : s.chunks) {
    EXPECT_LE(c.rows(), s.chunk_rows);
    for (int p = 0; p < c.part_count; ++p)
      for (std::int64_t r = c.parts[p].begin; r < c.parts[p].end; ++r) ++seen[static_cast<std::size_t>(r)];
    if (s.mode == Mode::three_pass) {
      ASSERT_EQ(c.part_count, 2);
      EXPECT_EQ(c.parts[0], (RowRange{c.pair_begin * shape.T, c.pair_end * shape.T}));
      EXPECT_EQ(c.parts[1], (RowRange{(shape.P() + c.pair_begin) * shape.T, (shape.P() + c.pair_end) * shape.T}));
    }
  }
  for (std::size_t r = 0; r < seen.size(); ++r) ASSERT_EQ(seen[r], 1) << "row " << r;
}

const Shape shape{.B = 6, .T = 10, .H = 16, .V = 100};

TEST(Schedule, BytesPerRowFollowTheFormula) {
  EXPECT_EQ(workspace_bytes_per_row(shape, true), 100 * 4 + 100 * 2 + 16 * 4 + row_stats_bytes);
  EXPECT_EQ(workspace_bytes_per_row(shape, false), 100 * 4 + row_stats_bytes);
}

TEST(Schedule, ModesAndChunkSizes) {
  Options o;
  const Schedule whole = plan(shape, o);
  EXPECT_EQ(whole.mode, Mode::three_pass);
  EXPECT_EQ(whole.chunks.size(), 1u);
  expect_covers_every_row_once(shape, whole);

  o.max_chunk_rows = 45;  // two pairs (40 rows) per chunk: pairs {0,1}, {2}
  const Schedule pairs = plan(shape, o);
  EXPECT_EQ(pairs.mode, Mode::three_pass);
  ASSERT_EQ(pairs.chunks.size(), 2u);
  EXPECT_EQ(pairs.chunks[1].pair_begin, 2);
  expect_covers_every_row_once(shape, pairs);

  o.max_chunk_rows = 19;  // under one pair: two_pass token chunks 19, 19, 19, 3
  const Schedule tokens = plan(shape, o);
  EXPECT_EQ(tokens.mode, Mode::two_pass);
  ASSERT_EQ(tokens.chunks.size(), 4u);
  EXPECT_EQ(tokens.chunks.back().parts[0], (RowRange{57, 60}));
  expect_covers_every_row_once(shape, tokens);

  o.max_chunk_rows = 45;
  const Schedule forced = plan(shape, o, /*allow_three_pass=*/false);
  EXPECT_EQ(forced.mode, Mode::two_pass);
  expect_covers_every_row_once(shape, forced);

  o.gradients = false;
  const Schedule forward = plan(shape, o);
  EXPECT_EQ(forward.mode, Mode::forward_only);
  expect_covers_every_row_once(shape, forward);
}

TEST(Schedule, BudgetDecidesTheChunkRows) {
  Options o;
  const std::int64_t row = workspace_bytes_per_row(shape, true);
  o.workspace_bytes = 7 * row + row - 1;  // 7 rows and a bit
  EXPECT_EQ(plan(shape, o).chunk_rows, 7);
  EXPECT_EQ(plan(shape, o).mode, Mode::two_pass);
  o.workspace_bytes = row;
  EXPECT_EQ(plan(shape, o).chunk_rows, 1);
  o.workspace_bytes = row - 1;
  EXPECT_THROW(plan(shape, o), InputError);
  o.gradients = false;  // forward rows are smaller: the same budget holds one
  EXPECT_EQ(plan(shape, o).chunk_rows, 1);
  o.max_chunk_rows = -1;
  EXPECT_THROW(plan(shape, o), InputError);
}

TEST(Schedule, RowCountPlansLikeTheBudget) {
  // plan_rows (backends that size their own buffers) cuts where plan() does for the budget of that many rows.
  Options o;
  o.workspace_bytes = std::int64_t{1} << 40;  // unread by plan_rows
  for (const bool gradients : {true, false})
    for (const std::int64_t rows : {1, 7, 19, 20, 45, 60, 1000}) {
      o.gradients = gradients;
      Options budget = o;
      budget.workspace_bytes = rows * workspace_bytes_per_row(shape, gradients);
      const Schedule a = plan_rows(shape, rows, o), b = plan(shape, budget);
      EXPECT_EQ(a.mode, b.mode) << rows;
      EXPECT_EQ(a.chunk_rows, b.chunk_rows) << rows;
      EXPECT_EQ(a.chunks.size(), b.chunks.size()) << rows;
      expect_covers_every_row_once(shape, a);
    }
  o.max_chunk_rows = 5;
  EXPECT_EQ(plan_rows(shape, 45, o).chunk_rows, 5);
  EXPECT_THROW(plan_rows(shape, 0, o), InputError);
}

// walk() in each mode: the stages in the documented order, statistics_known once, right after the last row's
// statistics (the last forward) and before any gradient stage that follows it.
TEST(Schedule, WalkCallsStatisticsKnownOnceTheLastStatisticsExist) {
  std::string calls;
  const Stages stages{.forward = [&](const Chunk&, bool keep) { calls += keep ? 'F' : 'f'; },
                      .pair_math = [&](std::int64_t, std::int64_t) { calls += 'p'; },
                      .logits = [&](const Chunk&) { calls += 'l'; },
                      .backward = [&](const Chunk&) { calls += 'b'; },
                      .statistics_known = [&] { calls += 'S'; }};
  Options o;
  o.max_chunk_rows = 45;  // three_pass, 2 chunks
  walk(plan(shape, o), shape, stages);
  EXPECT_EQ(calls, "FpbFSpb");
  calls.clear();
  o.max_chunk_rows = 19;  // two_pass, 4 chunks
  walk(plan(shape, o), shape, stages);
  EXPECT_EQ(calls, "ffffSplblblblb");
  calls.clear();
  o.gradients = false;
  walk(plan(shape, o), shape, stages);
  EXPECT_EQ(calls, "ffffS");
  calls.clear();
  Stages without = stages;  // optional: a backend that does not ask is walked as before
  without.statistics_known = nullptr;
  walk(plan(shape, o), shape, without);
  EXPECT_EQ(calls, "ffff");
}

using math::log_sigmoid;
using math::sigmoid;

long double exact_log_sigmoid(long double x) { return -std::log1p(std::exp(-x)); }

TEST(SimpoMath, LogSigmoidIsAccurateAtTheExtremes) {
  for (double x : {-800.0, -40.0, -1.0, -1e-8, 0.0, 1e-8, 1.0, 20.0, 40.0, 700.0}) {
    const long double e = x < -700 ? static_cast<long double>(x) : exact_log_sigmoid(x);
    EXPECT_NEAR(log_sigmoid(x), static_cast<double>(e), 4e-16 * std::abs(static_cast<double>(e)) + 1e-300) << x;
    EXPECT_TRUE(std::isfinite(log_sigmoid(static_cast<float>(x)))) << x;
  }
  EXPECT_GT(log_sigmoid(40.0), -1e-17);  // ~ -4.2e-18, where log(sigmoid) rounds to exactly 0
  EXPECT_LT(log_sigmoid(40.0), 0.0);
}

TEST(SimpoMath, SigmoidNeverOverflows) {
  EXPECT_EQ(sigmoid(-1000.0), 0.0);
  EXPECT_EQ(sigmoid(1000.0), 1.0);
  EXPECT_NEAR(sigmoid(-30.0), 9.357622968839299e-14, 1e-27);  // 1 / (1 + e^30)
  EXPECT_DOUBLE_EQ(sigmoid(0.3) + sigmoid(-0.3), 1.0);
}

TEST(SimpoMath, OnlineLogSumExpMatchesTheDirectOneInAnyOrder) {
  const std::vector<float> z = {3.f, -1.f, 95.f, 94.5f, -200.f, 0.f, 90.f};  // exp(95) overflows float unshifted
  long double direct = 0;
  for (float v : z) direct += std::exp(static_cast<long double>(v) - 95);
  const double expected = 95 + static_cast<double>(std::log(direct));
  auto forward = math::lse_empty<float>(), first_half = math::lse_empty<float>(), second_half = math::lse_empty<float>();
  for (float v : z) forward = math::lse_add(forward, v);
  for (std::size_t i = 0; i < 3; ++i) first_half = math::lse_add(first_half, z[i]);
  for (std::size_t i = z.size(); i-- > 3;) second_half = math::lse_add(second_half, z[i]);  // reversed
  EXPECT_NEAR(math::lse_value(forward), expected, 1e-5);
  EXPECT_NEAR(math::lse_value(math::lse_merge(first_half, second_half)), expected, 1e-5);
  EXPECT_EQ(math::lse_value(math::lse_merge(forward, math::lse_empty<float>())), math::lse_value(forward));
}

TEST(SimpoMath, PairTermAndItsDerivative) {
  const double beta = 0.7, gamma = 0.4, ls = 0.15, c = -1.3, r = -2.1;
  const auto p = math::pair_term(c, r, beta, gamma, ls);
  EXPECT_DOUBLE_EQ(p.s, beta * (c - r) - gamma);
  const double h = 1e-6;
  const double numeric = (math::pair_term(c + h / beta, r, beta, gamma, ls).term -
                          math::pair_term(c - h / beta, r, beta, gamma, ls).term) / (2 * h);
  EXPECT_NEAR(p.dterm, numeric, 1e-9);
  EXPECT_DOUBLE_EQ(math::avg_gradient(p.dterm, beta, 4, true), beta * p.dterm / 4);
  EXPECT_DOUBLE_EQ(math::avg_gradient(p.dterm, beta, 4, false), -beta * p.dterm / 4);
}

TEST(SimpoMath, TargetCoefficientKeepsTheSmallComplement) {
  // p_target = 1 - 1e-6: 1 - p in float is a multiple of 6e-8 (off by up to 3%); expm1 keeps fp32 precision.
  const float lse = 1.f, z_target = 1.f - 1e-6f;
  const float c = math::target_coefficient(2.f, z_target, lse);
  const double exact = 2.0 * -std::expm1(static_cast<double>(z_target) - 1.0);
  EXPECT_NEAR(c, exact, 1e-6 * exact);
  EXPECT_EQ(math::row_coefficient(1.f, false, 3.f, 5, 0.1f), 0.f);
  EXPECT_EQ(math::row_coefficient(1.f, true, 3.f, 0, 0.1f), 0.f);
  EXPECT_FLOAT_EQ(math::row_coefficient(2.f, true, 3.f, 5, 0.1f), 2.f * (3.f / 5 - 0.1f));
}

}  // namespace
}  // namespace simpo::fused

// forward_outputs.h promises that lse and z_target may share any per-row offset (the cpu backend stores them
// relative to the row max, the cuda backend may not): outputs and k must not depend on it beyond the fp32
// rounding of the offset values.
namespace simpo::fused {
namespace {

TEST(ForwardOutputs, RowStatsOffsetDoesNotMatter) {
  CaseSpec spec;
  spec.shape = {.B = 4, .T = 6, .H = 2, .V = 10};
  spec.seed = 5;
  const Problem problem = generate(spec);
  const Targets targets = read_targets(problem);
  const std::int64_t N = problem.shape.N();
  RowStats shifted(N), unshifted(N);
  Rng rng(9);
  for (std::int64_t r = 0; r < N; ++r) {
    const float offset = static_cast<float>(8 * rng.normal());  // a row max of the logits' magnitude
    shifted.lse[r] = static_cast<float>(1 + rng.uniform());
    shifted.z_target[r] = static_cast<float>(-rng.uniform());
    unshifted.lse[r] = shifted.lse[r] + offset;
    unshifted.z_target[r] = shifted.z_target[r] + offset;
  }
  const TensorMap a = forward_outputs(problem, targets, shifted), b = forward_outputs(problem, targets, unshifted);
  for (const auto& [name, t] : a)
    for (std::int64_t i = 0; i < t.numel(); ++i)
      EXPECT_NEAR(t.value(i), b.at(name).value(i), 1e-5 * (1 + std::abs(t.value(i)))) << name;  // ulp(8+2) ~ 1e-6
  std::vector<float> ka(N), kb(N);
  row_coefficients(problem, targets, shifted, 0, problem.shape.P(), Mutant::none, ka);
  row_coefficients(problem, targets, unshifted, 0, problem.shape.P(), Mutant::none, kb);
  for (std::int64_t r = 0; r < N; ++r) EXPECT_NEAR(ka[r], kb[r], 1e-5 * std::abs(ka[r]) + 1e-12) << r;
}

}  // namespace
}  // namespace simpo::fused
