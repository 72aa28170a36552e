// Problems small enough to solve by hand, checked against the reference.
//
// With V = 2 and H = 1 the softmax is a sigmoid: a token log-prob is log sigmoid(difference of the two logits),
// and every derivative has a one-line closed form. With zero weights the softmax is uniform and every log-prob is
// -log V. Large logits check that the log-sum-exp and 1 - p are computed without overflow or cancellation.
#include "reference/reference.h"
#include "reference/tests/tensor_compare.h"
#include "reference/tests/test_problems.h"

#include "reference/tests/test_device.h"

#include <gtest/gtest.h>

#include <cmath>

namespace simpo::reference {
namespace {

using testing::test_options;

using testing::scalar;
using testing::values;
using testing::hyperparameters;

double naive_sigmoid(double u) { return 1.0 / (1.0 + std::exp(-u)); }
double naive_log_sigmoid(double u) { return -std::log(1.0 + std::exp(-u)); }

// Every quantity below is O(1) to O(10) and comes from at most ~30 roundings in either computation, each of relative
// size eps = 1.1e-16 on values of magnitude <= 10: 30 * 10 * 1.1e-16 = 3.3e-14, so 4e-14 absolute.
constexpr double kClosedFormTolerance = 4e-14;

struct TwoTokenCase {
  const char* name;
  bool bias;
  bool chosen_empty;    // the chosen sequence has no completion token (empty_sequence = zero, alpha = 0)
  bool rejected_empty;  // likewise the rejected one
  Hyperparameters hp;
};
// gtest prints a parameter by its name, not its bytes.
void PrintTo(const TwoTokenCase& c, std::ostream* os) { *os << c.name; }


// B = 2 (one pair), T = 1, H = 1, V = 2. Chosen x = a with target 0, rejected x = b with target 1.
// Logits z = x (w0, w1) + (b0, b1). With d = w0 - w1 and e = b0 - b1:
//   chosen  log-prob c = log sigmoid(u_c), u_c = a d + e
//   rejected log-prob r = log sigmoid(u_r), u_r = -(b d + e)        (target 1: z1 - z0 = -(b d + e))
//   s = beta (c - r) - gamma, pref = -(1-ls) log sigmoid(s) - ls log sigmoid(-s), nll = -c (N_c = 1)
// and, by the chain rule through u_c and u_r (d log sigmoid(u)/du = sigmoid(-u)):
//   G_c = grad_scale (beta pref'(s) - alpha) sigmoid(-u_c),  G_r = grad_scale (-beta pref'(s)) sigmoid(-u_r)
//   grad_x = (G_c d, -G_r d),  grad_w = (G_c a - G_r b, -G_c a + G_r b),  grad_bias = (G_c - G_r, G_r - G_c)
class TwoTokenVocabulary : public ::testing::TestWithParam<TwoTokenCase> {};

// The inputs in each dtype, with values that dtype holds and the narrower ones do not (f16 and f32 spend their
// extra mantissa bits: a reader that went through bf16 would be off by ~2^-9, the tolerance is 4e-14).
struct TwoTokenValues {
  DType dtype;
  double a, b, w0, w1, b0, b1;
};
const TwoTokenValues two_token_values[] = {
    {DType::BF16, 1.5, -0.5, 0.75, -1.25, 0.25, -0.5},
    {DType::F16, 1.5 + 0x1p-9, -0.5 - 0x1p-11, 0.75 + 0x1p-10, -1.25 + 0x1p-9, 0.25 + 0x1p-12, -0.5 - 0x1p-11},
    {DType::F32, 1.5 + 0x1p-20, -0.5 - 0x1p-23, 0.75 + 0x3p-22, -1.25 + 0x1p-21, 0.25 - 0x1p-25, -0.5 - 0x5p-24},
};

template <class T> InputValues input_values(std::initializer_list<double> v) {
  std::vector<T> out;
  for (double d : v) {
    out.push_back(T(static_cast<float>(d)));
    if (static_cast<double>(static_cast<float>(out.back())) != d) throw std::logic_error("not exact in the dtype");
  }
  return out;
}
InputValues input_values(DType dtype, std::initializer_list<double> v) {
  return dtype == DType::F16 ? input_values<f16>(v) : dtype == DType::F32 ? input_values<float>(v) : input_values<bf16>(v);
}

TEST_P(TwoTokenVocabulary, MatchesClosedForm) {
  for (const TwoTokenValues& in : two_token_values) {
    SCOPED_TRACE(input_dtype_name(in.dtype) + " inputs");
    const TwoTokenCase& param = GetParam();
    const double a = in.a, b = in.b, w0 = in.w0, w1 = in.w1, b0 = param.bias ? in.b0 : 0.0, b1 = param.bias ? in.b1 : 0.0;
    const Hyperparameters& hp = param.hp;

    Problem problem;
    problem.shape = {2, 1, 1, 2};
    problem.hp = hp;
    problem.x = input_values(in.dtype, {a, b});
    problem.weight = input_values(in.dtype, {w0, w1});
    if (param.bias) problem.bias = input_values(in.dtype, {b0, b1});
    problem.target = {param.chosen_empty ? hp.ignore_index : 0, param.rejected_empty ? hp.ignore_index : 1};

    const double d = w0 - w1, e = b0 - b1;
    const double u_c = a * d + e, u_r = -(b * d + e);
    const double c = param.chosen_empty ? 0.0 : naive_log_sigmoid(u_c);
    const double r = param.rejected_empty ? 0.0 : naive_log_sigmoid(u_r);
    const double ls = hp.label_smoothing;
    const double s = hp.beta * (c - r) - hp.gamma;
    const double pref = -(1 - ls) * naive_log_sigmoid(s) - ls * naive_log_sigmoid(-s);
    const double pref_slope = -(1 - ls) * naive_sigmoid(-s) + ls * naive_sigmoid(s);
    const bool nll_on = hp.compute_nll_loss && !param.chosen_empty;
    const double nll = nll_on ? -c : 0.0;
    const double G_c = param.chosen_empty ? 0.0 : hp.grad_scale * (hp.beta * pref_slope - (nll_on ? hp.alpha : 0.0)) * naive_sigmoid(-u_c);
    const double G_r = param.rejected_empty ? 0.0 : hp.grad_scale * (-hp.beta * pref_slope) * naive_sigmoid(-u_r);

    const TensorMap out = compute(problem, test_options());
    const double tol = kClosedFormTolerance;
    EXPECT_NEAR(scalar(out, "loss"), hp.alpha * nll + pref, tol);
    EXPECT_NEAR(scalar(out, "nll_loss"), nll, tol);
    EXPECT_NEAR(scalar(out, "chosen_logps"), c, tol);
    EXPECT_NEAR(scalar(out, "rejected_logps"), r, tol);
    EXPECT_NEAR(scalar(out, "chosen_rewards"), hp.beta * c, tol);
    EXPECT_NEAR(scalar(out, "rejected_rewards"), hp.beta * r, tol);
    EXPECT_NEAR(scalar(out, "chosen_logits_mean"), (a * (w0 + w1) + b0 + b1) / 2, tol);
    EXPECT_NEAR(scalar(out, "rejected_logits_mean"), (b * (w0 + w1) + b0 + b1) / 2, tol);

    const auto grad_x = values(out, "grad_x");
    const auto grad_w = values(out, "grad_weight");
    ASSERT_EQ(grad_x.size(), 2u);
    ASSERT_EQ(grad_w.size(), 2u);
    EXPECT_NEAR(grad_x[0], G_c * d, tol);
    EXPECT_NEAR(grad_x[1], -G_r * d, tol);
    EXPECT_NEAR(grad_w[0], G_c * a - G_r * b, tol);
    EXPECT_NEAR(grad_w[1], -G_c * a + G_r * b, tol);
    if (param.bias) {
      const auto grad_bias = values(out, "grad_bias");
      ASSERT_EQ(grad_bias.size(), 2u);
      EXPECT_NEAR(grad_bias[0], G_c - G_r, tol);
      EXPECT_NEAR(grad_bias[1], G_r - G_c, tol);
    } else {
      EXPECT_EQ(out.count("grad_bias"), 0u);
    }
    // An empty sequence contributes no gradient at all: exactly zero, not merely small.
    if (param.chosen_empty) {
      EXPECT_EQ(grad_x[0], 0.0);
    }
    if (param.rejected_empty) {
      EXPECT_EQ(grad_x[1], 0.0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TwoTokenVocabulary,
    ::testing::Values(TwoTokenCase{"defaults", false, false, false, Hyperparameters{}},
                      TwoTokenCase{"bias_smoothing_scale", true, false, false, hyperparameters(2.0, 0.5, 0.5, 0.25, 1.5)},
                      TwoTokenCase{"no_nll", true, false, false, hyperparameters(0.7, -0.3, 3.0, 0.0, -2.0, false)},
                      TwoTokenCase{"rejected_empty", true, false, true,
                                   hyperparameters(1.25, 0.5, 0.5, 0.1, 1.0, true, EmptySequence::zero)},
                      TwoTokenCase{"chosen_empty_alpha_zero", false, true, false,
                                   hyperparameters(1.25, 0.5, 0.0, 0.1, 1.0, true, EmptySequence::zero)}),
    [](const auto& info) { return std::string(info.param.name); });

// Zero weights and a constant bias: every logit is 0.75, the softmax is uniform, every token log-prob is -log V,
// every pair has c = r and so s = -gamma. grad_x is sum_v dz w_v = 0 exactly. The weight and bias gradients are
// SPEC's sums with softmax = 1/V, written out below; they exercise the masks, n[b], N_c and the pairing.
TEST(UniformLogits, MatchesClosedForm) {
  const std::int64_t B = 4, T = 3, H = 2, V = 5, P = 2;
  Problem problem;
  problem.shape = {B, T, H, V};
  problem.hp = hyperparameters(1.5, 0.7, 0.8, 0.1, 2.0);
  const std::int64_t I = problem.hp.ignore_index;
  problem.x = std::vector<bf16>{bf16(0.5f), bf16(-1.0f), bf16(2.0f), bf16(0.25f), bf16(-0.75f), bf16(1.5f),
               bf16(1.0f), bf16(3.0f),  bf16(-2.0f), bf16(0.5f), bf16(0.125f), bf16(-1.25f),
               bf16(-0.5f), bf16(1.0f), bf16(0.75f), bf16(2.5f), bf16(-3.0f), bf16(0.5f),
               bf16(1.75f), bf16(-0.25f), bf16(0.0f), bf16(1.0f), bf16(-1.5f), bf16(2.0f)};
  problem.weight.as<bf16>().assign(V * H, bf16(0.0f));
  problem.bias = std::vector<bf16>(V, bf16(0.75f));
  problem.target = {1, I, 4, /**/ 0, 2, 3, /**/ I, I, 2, /**/ 4, 4, I};
  const std::vector<std::int64_t> tokens = {2, 3, 1, 2};
  const double chosen_tokens = 5;

  const Hyperparameters& hp = problem.hp;
  const double log_v = std::log(static_cast<double>(V));
  const double ls = hp.label_smoothing, s = -hp.gamma;
  const double pref = -(1 - ls) * naive_log_sigmoid(s) - ls * naive_log_sigmoid(-s);
  const double g = (-(1 - ls) * naive_sigmoid(-s) + ls * naive_sigmoid(s)) / P;

  std::vector<double> grad_w(V * H, 0.0), grad_bias(V, 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t target = problem.target[b * T + t];
      if (target == I) continue;
      const double k = b < P ? hp.grad_scale * (hp.beta * g / tokens[b] - hp.alpha / chosen_tokens)
                             : hp.grad_scale * (-hp.beta * g / tokens[b]);
      for (std::int64_t v = 0; v < V; ++v) {
        const double dz = k * ((v == target ? 1.0 : 0.0) - 1.0 / V);
        grad_bias[v] += dz;
        for (std::int64_t h = 0; h < H; ++h) grad_w[v * H + h] += dz * static_cast<float>(problem.x.as<bf16>()[(b * T + t) * H + h]);
      }
    }

  const TensorMap out = compute(problem, test_options());
  const double tol = kClosedFormTolerance;
  EXPECT_NEAR(scalar(out, "loss"), hp.alpha * log_v + pref, tol);
  EXPECT_NEAR(scalar(out, "nll_loss"), log_v, tol);
  EXPECT_NEAR(scalar(out, "chosen_logits_mean"), 0.75, tol);
  EXPECT_NEAR(scalar(out, "rejected_logits_mean"), 0.75, tol);
  for (const char* name : {"chosen_logps", "rejected_logps"})
    for (double v : values(out, name)) EXPECT_NEAR(v, -log_v, tol) << name;
  for (double v : values(out, "chosen_rewards")) EXPECT_NEAR(v, -hp.beta * log_v, tol);
  for (double v : values(out, "grad_x")) EXPECT_EQ(v, 0.0);
  const auto got_w = values(out, "grad_weight"), got_bias = values(out, "grad_bias");
  for (std::int64_t i = 0; i < V * H; ++i) EXPECT_NEAR(got_w[i], grad_w[i], tol) << "grad_weight entry " << i;
  for (std::int64_t v = 0; v < V; ++v) EXPECT_NEAR(got_bias[v], grad_bias[v], tol) << "grad_bias entry " << v;
}

// Logits of +-1024 (exp overflows a double beyond 709) and a target that dominates its row so completely that
// its probability rounds to 1. V = 2, H = 1, weight (32, -8), no bias, beta = 0.1, gamma = 0.5, alpha = 1:
//   chosen x = 32, logits (1024, -256), target 1: c = -1280 - log1p(e^-1280) = -1280
//   rejected x = 16, logits (512, -128), target 0: r = -log1p(q) = -q, q = e^-640 = 2.3e-278 (a normal double)
//   s = 0.1 (c - r) - 0.5 = -128.5; pref = -log sigmoid(s) = 128.5 + log1p(e^-128.5) = 128.5 (+1.9e-56);
//   nll = 1280; loss = 1408.5
//   pref'(s) = -sigmoid(128.5) = -1 (to 1e-56): k_c = 0.1 * -1 - 1 = -1.1, k_r = +0.1
//   chosen dz = k_c (onehot - p) = (1.1, -1.1): grad_x_c = 1.1 * 32 + 1.1 * 8 = 44
//   rejected dz = k_r (1 - p_0, -p_1) = 0.1 (q, -q) to relative 1e-278: grad_x_r = 0.1 q (32 + 8) = 4 q
// A reference that forms 1 - p instead of -expm1(l) gets 1 - p_0 = 0 and grad_x_r = 0.8 q; one that forms
// max - lse gets r = 0.
TEST(LargeLogits, StayFiniteAndKeepTinyValuesRelativelyExact) {
  Problem problem;
  problem.shape = {2, 1, 1, 2};
  problem.x = std::vector<bf16>{bf16(32.0f), bf16(16.0f)};
  problem.weight = std::vector<bf16>{bf16(32.0f), bf16(-8.0f)};
  problem.target = {1, 0};
  const double q = std::exp(-640.0);
  ASSERT_GT(q, 0.0);

  const TensorMap out = compute(problem, test_options());
  for (const auto& [name, tensor] : out)
    for (double v : tensor.to_double()) EXPECT_TRUE(std::isfinite(v)) << name;
  // Relative tolerances: the values are formed by a handful of correctly rounded operations (~10 eps).
  const double rel = 1e-14;
  EXPECT_NEAR(scalar(out, "loss"), 1408.5, rel * 1408.5);
  EXPECT_NEAR(scalar(out, "nll_loss"), 1280.0, rel * 1280.0);
  EXPECT_EQ(scalar(out, "chosen_logps"), -1280.0);
  EXPECT_NEAR(scalar(out, "rejected_logps"), -q, rel * q);
  const auto grad_x = values(out, "grad_x");
  EXPECT_NEAR(grad_x[0], 44.0, rel * 44.0);
  EXPECT_NEAR(grad_x[1], 4 * q, rel * 4 * q);
  const auto grad_w = values(out, "grad_weight");  // 1.1 * 32 from the chosen row; the rejected row adds 1.6 q
  EXPECT_NEAR(grad_w[0], 35.2, rel * 35.2);
  EXPECT_NEAR(grad_w[1], -35.2, rel * 35.2);
}

}  // namespace
}  // namespace simpo::reference
