// Properties SPEC's function has whatever its inputs: each is a way the reference could be wrong that the closed
// forms and finite differences might not show (a mixed-up pairing, a leaked gradient, a schedule-dependent sum).
//
// Tolerances: two float64 computations of the same exact value that differ only in rounding (summation order,
// a shifted logit) differ by a few eps per operation on the sums involved; on these sizes (V, H <= 16, N <= 24)
// that is well below 1e-13 normwise (16 terms * 1.1e-16 * a condition of a few), so 1e-13.
#include "problem/generate.h"
#include "reference/reference.h"
#include "reference/reference_core.h"
#include "reference/tests/tensor_compare.h"

#include "reference/tests/test_device.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

namespace simpo::reference {
namespace {

using testing::test_options;

using testing::normwise_error;
using testing::scalar;
using testing::values;

constexpr double kRoundingTolerance = 1e-13;

Problem make_problem(std::uint64_t seed, Hyperparameters hp = {}, bool bias = true,
                     IgnorePattern ignore = IgnorePattern::random) {
  CaseSpec c;
  c.shape = {6, 4, 8, 11};
  c.hp = hp;
  c.bias = bias;
  c.ignore = ignore;
  c.seed = seed;
  return generate(c);
}

Hyperparameters interesting_hp() {
  Hyperparameters hp;
  hp.beta = 1.5;
  hp.gamma = 0.4;
  hp.alpha = 0.7;
  hp.label_smoothing = 0.15;
  hp.grad_scale = 1.3;
  return hp;
}

// Row b of a [B, T, H] (or [B, T]) tensor stored flat with `width` entries per sequence.
template <class T> std::vector<T> take_sequences(const std::vector<T>& flat, std::int64_t width, const std::vector<std::int64_t>& order) {
  std::vector<T> out;
  for (std::int64_t b : order) out.insert(out.end(), flat.begin() + b * width, flat.begin() + (b + 1) * width);
  return out;
}
InputValues take_sequences(const InputValues& flat, std::int64_t width, const std::vector<std::int64_t>& order) {
  return flat.visit([&](const auto& values) { return InputValues(take_sequences(values, width, order)); });
}

TEST(Invariance, ConstantAddedToEveryBiasChangesOnlyTheLogitsMeans) {
  const Problem problem = make_problem(21, interesting_hp());
  const Shape& s = problem.shape;
  const std::vector<double> x = widen(problem.x), weight = widen(problem.weight), bias = widen(*problem.bias);
  std::vector<double> shifted = bias;
  const double shift = 3.375;
  for (double& b : shifted) b += shift;

  auto run = [&](const std::vector<double>& b, std::vector<double>& gx, std::vector<double>& gw, std::vector<double>& gb) {
    gx.resize(x.size());
    gw.resize(weight.size());
    gb.resize(b.size());
    return compute_core({s, problem.hp, x, weight, b, problem.target}, test_options(), {gx, gw, gb});
  };
  std::vector<double> gx0, gw0, gb0, gx1, gw1, gb1;
  const ForwardOutputs base = run(bias, gx0, gw0, gb0), moved = run(shifted, gx1, gw1, gb1);

  EXPECT_NEAR(moved.loss, base.loss, kRoundingTolerance * std::abs(base.loss));
  EXPECT_NEAR(moved.nll_loss, base.nll_loss, kRoundingTolerance * std::abs(base.nll_loss));
  EXPECT_LT(normwise_error(moved.chosen_logps, base.chosen_logps), kRoundingTolerance);
  EXPECT_LT(normwise_error(moved.rejected_logps, base.rejected_logps), kRoundingTolerance);
  EXPECT_LT(normwise_error(gx1, gx0), kRoundingTolerance);
  EXPECT_LT(normwise_error(gw1, gw0), kRoundingTolerance);
  EXPECT_LT(normwise_error(gb1, gb0), kRoundingTolerance);
  // The means move by exactly the shift (up to rounding on logits of size ~|shift|).
  EXPECT_NEAR(moved.chosen_logits_mean, base.chosen_logits_mean + shift, kRoundingTolerance * shift);
  EXPECT_NEAR(moved.rejected_logits_mean, base.rejected_logits_mean + shift, kRoundingTolerance * shift);
}

// sum_v dz[r, v] = k (1 - sum_v softmax) = 0 for every row, so grad_bias sums to zero and so does every column
// of grad_weight. The rounding bound: V terms each below max |g|, so V eps max|g| per sum, times a few.
TEST(Invariance, GradientsOfTheSoftmaxSumToZeroOverTheVocabulary) {
  const Problem problem = make_problem(22, interesting_hp());
  const Shape& s = problem.shape;
  const TensorMap out = compute(problem, test_options());
  const auto grad_bias = values(out, "grad_bias"), grad_w = values(out, "grad_weight");
  double bias_sum = 0, bias_scale = 0;
  for (double g : grad_bias) {
    bias_sum += g;
    bias_scale = std::max(bias_scale, std::abs(g));
  }
  EXPECT_LT(std::abs(bias_sum), 4 * s.V * 1.1e-16 * bias_scale * s.N());
  EXPECT_GT(bias_scale, 1e-3);  // not trivially zero
  for (std::int64_t h = 0; h < s.H; ++h) {
    double sum = 0, scale = 0;
    for (std::int64_t v = 0; v < s.V; ++v) {
      sum += grad_w[v * s.H + h];
      scale = std::max(scale, std::abs(grad_w[v * s.H + h]));
    }
    EXPECT_LT(std::abs(sum), 4 * s.V * 1.1e-16 * scale * s.N()) << "column " << h;
  }
}

TEST(Invariance, PermutingPairsPermutesPerPairOutputsAndGradXRows) {
  const Problem problem = make_problem(23, interesting_hp());
  const Shape& s = problem.shape;
  const std::int64_t P = s.P();
  const std::vector<std::int64_t> pair_order = {2, 0, 1};  // new pair j is old pair pair_order[j]
  std::vector<std::int64_t> sequence_order;
  for (std::int64_t j = 0; j < P; ++j) sequence_order.push_back(pair_order[j]);
  for (std::int64_t j = 0; j < P; ++j) sequence_order.push_back(P + pair_order[j]);

  Problem permuted = problem;
  permuted.x = take_sequences(problem.x, s.T * s.H, sequence_order);
  permuted.target = take_sequences(problem.target, s.T, sequence_order);

  const TensorMap a = compute(problem, test_options()), b = compute(permuted, test_options());
  for (const char* name : {"chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards"}) {
    const auto original = values(a, name), moved = values(b, name);
    std::vector<double> expected;
    for (std::int64_t j = 0; j < P; ++j) expected.push_back(original[pair_order[j]]);
    EXPECT_LT(normwise_error(moved, expected), kRoundingTolerance) << name;
  }
  EXPECT_LT(normwise_error(values(b, "grad_x"), take_sequences(values(a, "grad_x"), s.T * s.H, sequence_order)),
            kRoundingTolerance);
  for (const char* name : {"loss", "nll_loss", "chosen_logits_mean", "rejected_logits_mean", "grad_weight", "grad_bias"})
    EXPECT_LT(normwise_error(values(b, name), values(a, name)), kRoundingTolerance) << name;
  // The check has teeth: a pairing that ignored the order would leave chosen_logps unpermuted.
  EXPECT_GT(normwise_error(values(b, "chosen_logps"), values(a, "chosen_logps")), 1e-3);
}

// ls = 0.5 and gamma = 0 make the preference term -0.5 (log sigmoid(s) + log sigmoid(-s)), even in s; swapping
// chosen and rejected flips s, so without the NLL the loss is unchanged and the gradients swap with the rows.
TEST(Invariance, SymmetricSmoothingIgnoresWhichSideIsChosen) {
  Hyperparameters hp = interesting_hp();
  hp.label_smoothing = 0.5;
  hp.gamma = 0.0;
  hp.compute_nll_loss = false;
  const Problem problem = make_problem(24, hp);
  const Shape& s = problem.shape;
  std::vector<std::int64_t> swap;
  for (std::int64_t b = 0; b < s.B; ++b) swap.push_back((b + s.P()) % s.B);

  auto swapped_problem = [&](const Problem& p) {
    Problem q = p;
    q.x = take_sequences(p.x, s.T * s.H, swap);
    q.target = take_sequences(p.target, s.T, swap);
    return q;
  };
  const TensorMap a = compute(problem, test_options()), b = compute(swapped_problem(problem), test_options());
  EXPECT_NEAR(scalar(b, "loss"), scalar(a, "loss"), kRoundingTolerance * std::abs(scalar(a, "loss")));
  EXPECT_LT(normwise_error(values(b, "chosen_logps"), values(a, "rejected_logps")), kRoundingTolerance);
  EXPECT_LT(normwise_error(values(b, "rejected_logps"), values(a, "chosen_logps")), kRoundingTolerance);
  EXPECT_LT(normwise_error(values(b, "grad_x"), take_sequences(values(a, "grad_x"), s.T * s.H, swap)), kRoundingTolerance);
  EXPECT_LT(normwise_error(values(b, "grad_weight"), values(a, "grad_weight")), kRoundingTolerance);

  // Teeth: with ls = 0.15 the term is not even, and the same swap changes the loss.
  Problem asymmetric = problem;
  asymmetric.hp.label_smoothing = 0.15;
  const double l0 = scalar(compute(asymmetric, test_options()), "loss"), l1 = scalar(compute(swapped_problem(asymmetric), test_options()), "loss");
  EXPECT_GT(std::abs(l1 - l0), 1e-6 * std::abs(l0));
}

// Ignored positions have k = 0: their rows of grad_x are exactly zero (not merely small), in every schedule.
// Completion rows are not (a gradient that vanished everywhere would pass the first half trivially).
TEST(Invariance, GradXRowsAtIgnoredPositionsAreExactlyZero) {
  for (const IgnorePattern ignore : {IgnorePattern::random, IgnorePattern::prompt_prefix, IgnorePattern::all_but_one}) {
    const Problem problem = make_problem(25, interesting_hp(), true, ignore);
    const Shape& s = problem.shape;
    for (const std::int64_t chunk_rows : {0, 1, 3, 8, 1000}) {
      Options options = test_options();
      options.chunk_rows = chunk_rows;
      const auto grad_x = values(compute(problem, options), "grad_x");
      int ignored = 0;
      for (std::int64_t r = 0; r < s.N(); ++r) {
        double row_max = 0;
        for (std::int64_t h = 0; h < s.H; ++h) row_max = std::max(row_max, std::abs(grad_x[r * s.H + h]));
        if (problem.target[r] == problem.hp.ignore_index) {
          ++ignored;
          EXPECT_EQ(row_max, 0.0) << "row " << r << ", chunk_rows " << chunk_rows;
        } else {
          EXPECT_GT(row_max, 0.0) << "row " << r << ", chunk_rows " << chunk_rows;
        }
      }
      EXPECT_GT(ignored, 0);
    }
  }
}

// Every schedule computes the same function: keeping whole pairs (one or several per block) or splitting them and
// recomputing the logits, in pieces that do or do not divide T.
TEST(Invariance, ScheduleDoesNotChangeTheResult) {
  const Problem problem = make_problem(26, interesting_hp());
  Options whole = test_options();
  whole.chunk_rows = 1 << 20;
  const TensorMap expected = compute(problem, whole);
  for (const std::int64_t chunk_rows : {0, 1, 3, 4, 8, 16, 17}) {
    Options options = test_options();
    options.chunk_rows = chunk_rows;
    const TensorMap got = compute(problem, options);
    ASSERT_EQ(got.size(), expected.size());
    for (const auto& [name, tensor] : expected)
      EXPECT_LT(normwise_error(values(got, name), tensor.to_double()), kRoundingTolerance)
          << name << ", chunk_rows " << chunk_rows;
  }
}

// The reference reads every input dtype exactly, so the same values given as bf16, f16 or f32 give the same
// outputs bit for bit (the dtype never enters the arithmetic); f32 values between bf16's are read as themselves.
TEST(Invariance, TheSameValuesInEveryInputDtypeGiveTheSameBits) {
  const Problem bf = make_problem(28, interesting_hp());  // bf16 values, each also an f16 and an f32
  auto as = [](const InputValues& v, DType dtype) -> InputValues {
    std::vector<float> f(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) f[i] = static_cast<float>(v.value(i));
    if (dtype == DType::F32) return f;
    std::vector<f16> h(f.begin(), f.end());
    return h;
  };
  const TensorMap expected = compute(bf, test_options());
  for (DType dtype : {DType::F16, DType::F32}) {
    Problem p = bf;
    p.x = as(bf.x, dtype);
    p.weight = as(bf.weight, dtype);
    p.bias = as(*bf.bias, dtype);
    for (std::size_t i = 0; i < bf.weight.size(); ++i)  // exact: these bf16 values are within f16's range and precision
      ASSERT_EQ(p.weight.value(i), bf.weight.value(i)) << input_dtype_name(dtype) << " weight " << i;
    const TensorMap got = compute(p, test_options());
    for (const auto& [name, tensor] : expected)
      EXPECT_EQ(got.at(name).bytes, tensor.bytes) << name << ", " << input_dtype_name(dtype);
  }
  // One f32 value moved by one f32 ulp (invisible to bf16) moves the loss.
  Problem p = bf;
  p.x = as(bf.x, DType::F32);
  p.weight = as(bf.weight, DType::F32);
  p.bias = as(*bf.bias, DType::F32);
  float& w = p.weight.as<float>()[3];
  w = std::nextafter(w, 2 * w);
  EXPECT_NE(scalar(compute(p, test_options()), "loss"), scalar(expected, "loss"));
}

TEST(Outputs, HaveSpecNamesShapesAndDtypes) {
  for (const bool bias : {false, true}) {
    const Problem problem = make_problem(27, {}, bias);
    for (const bool gradients : {false, true}) {
      Options options = test_options();
      options.gradients = gradients;
      const TensorMap out = compute(problem, options);
      std::size_t expected_count = 0;
      for (const std::string& name : all_output_names()) {
        const bool expected = !is_gradient_output(name) || (gradients && (name != "grad_bias" || bias));
        ASSERT_EQ(out.count(name), expected ? 1u : 0u) << name << " bias " << bias << " gradients " << gradients;
        if (!expected) continue;
        ++expected_count;
        EXPECT_EQ(out.at(name).dtype, DType::F64) << name;
        EXPECT_EQ(out.at(name).shape, output_shape(problem.shape, name)) << name;
        for (double v : out.at(name).to_double()) EXPECT_TRUE(std::isfinite(v)) << name;
      }
      EXPECT_EQ(out.size(), expected_count);
    }
  }
}

TEST(Outputs, LossOnlyModeGivesTheSameForwardOutputs) {
  const Problem problem = make_problem(28, interesting_hp());
  Options loss_only = test_options();
  loss_only.gradients = false;
  const TensorMap full = compute(problem, test_options()), forward = compute(problem, loss_only);
  for (const auto& [name, tensor] : forward)
    EXPECT_LT(normwise_error(tensor.to_double(), values(full, name)), kRoundingTolerance) << name;
}

TEST(Outputs, ProgressRisesToOne) {
  const Problem problem = make_problem(29);
  for (const std::int64_t chunk_rows : {0, 3}) {
    std::vector<double> reports;
    Options options = test_options();
    options.chunk_rows = chunk_rows;
    options.progress = [&](double fraction) { reports.push_back(fraction); };
    compute(problem, options);
    ASSERT_FALSE(reports.empty());
    EXPECT_TRUE(std::is_sorted(reports.begin(), reports.end()));
    EXPECT_GT(reports.front(), 0.0);
    EXPECT_DOUBLE_EQ(reports.back(), 1.0);
  }
}

}  // namespace
}  // namespace simpo::reference

namespace simpo::reference {
namespace {

// The reproducible mode (fixed-order products, correctly rounded exp/log1p/expm1) computes the same function as
// the BLAS/libm path: outputs agree to rounding on shapes where the BLAS really blocks and threads its products
// (H, V past one kernel tile; V with a tail), for every hyperparameter at once.
TEST(Invariance, ReproducibleModeAgreesWithTheFastPath) {
  CaseSpec c;
  c.shape = {4, 7, 67, 301};
  c.hp = interesting_hp();
  c.bias = true;
  c.ignore = IgnorePattern::random;
  c.logit_scale = 8;
  c.seed = 4242;
  const Problem problem = generate(c);
  Options reproducible = test_options();
  reproducible.reproducible = true;
  const TensorMap fast = compute(problem, test_options()), exact_order = compute(problem, reproducible);
  ASSERT_EQ(fast.size(), exact_order.size());
  // 1e-13 above, for sums of at most V = 301 terms: 301 * 1.1e-16 * a small condition number stays under it.
  for (const auto& [name, t] : fast) EXPECT_LT(normwise_error(values(exact_order, name), values(fast, name)), kRoundingTolerance) << name;
}

}  // namespace
}  // namespace simpo::reference
