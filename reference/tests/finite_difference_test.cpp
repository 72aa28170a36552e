// Every gradient entry of the reference against a central finite difference of its own loss.
//
// The loss is differentiated numerically in float64 on the double inputs (reference_core.h), with steps far below
// any bf16 spacing, for every entry of x, weight and bias of small random problems that cover each hyperparameter,
// each ignore pattern, both schedules (whole pairs kept, and pairs split with the logits recomputed) and a bias.
#include "problem/generate.h"
#include "reference/reference_core.h"
#include "reference/tests/test_problems.h"

#include "reference/tests/test_device.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

namespace simpo::reference {
namespace {

using testing::test_options;

using testing::case_spec;
using testing::hyperparameters;

struct FiniteDifferenceCase {
  const char* name;
  CaseSpec spec;
  std::int64_t chunk_rows;
};
// gtest prints a parameter by its name, not its bytes.
void PrintTo(const FiniteDifferenceCase& c, std::ostream* os) { *os << c.name; }


// Tolerance, derived per entry. With f(theta) = grad_scale * loss, the central difference
//   D(h) = (f(theta + h) - f(theta - h)) / 2h = f'(theta) + (h^2 / 6) f'''(xi) + rounding
// has two errors:
//  * truncation (h^2 / 6) |f'''(xi)|, xi within h of theta. f''' is estimated at theta by the four-point stencil
//    (f(+2H) - 2 f(+H) + 2 f(-H) - f(-2H)) / (2 H^3) with H = 1e-2; as xi is not theta and the estimate has its own
//    O(H^2 f^(5)) error, we allow twice the estimate plus one unit (inputs and logits are O(1)).
//  * rounding: f carries an absolute error delta <= 32 eps S, S = |grad_scale| max(1, |loss|, max |z|): the
//    logits are sums of H <= 5 products, lse sums V <= 8 terms, an average T <= 3, the mean P <= 4, each step
//    adding at most its term count in roundings of relative size eps on quantities bounded by S (~20 < 32).
//    Two such errors over 2h give delta / h.
// h = 2e-5 balances the two: h^2/6 = 6.7e-11 per unit of f''', delta/h = 1.8e-10 per unit of S.
constexpr double kStep = 2e-5;
constexpr double kThirdDerivativeStep = 1e-2;
constexpr double kEps = std::numeric_limits<double>::epsilon();

double max_abs_logit(const Shape& s, const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& bias) {
  double m = 0;
  for (std::int64_t r = 0; r < s.N(); ++r)
    for (std::int64_t v = 0; v < s.V; ++v) {
      double z = bias.empty() ? 0.0 : bias[v];
      for (std::int64_t h = 0; h < s.H; ++h) z += x[r * s.H + h] * w[v * s.H + h];
      m = std::max(m, std::abs(z));
    }
  return m;
}

class FiniteDifferences : public ::testing::TestWithParam<FiniteDifferenceCase> {};

TEST_P(FiniteDifferences, EveryGradientEntryMatchesCentralDifference) {
  const FiniteDifferenceCase& param = GetParam();
  const Problem problem = generate(param.spec);
  ASSERT_NO_THROW(validate(problem));
  const Shape& s = problem.shape;
  std::vector<double> x = widen(problem.x), weight = widen(problem.weight);
  std::vector<double> bias = problem.bias ? widen(*problem.bias) : std::vector<double>{};
  const DoubleInputs inputs{s, problem.hp, x, weight, bias, problem.target};  // views: perturbations show through

  Options options = test_options();
  options.chunk_rows = param.chunk_rows;
  std::vector<double> grad_x(x.size()), grad_weight(weight.size()), grad_bias(bias.size());
  const ForwardOutputs base = compute_core(inputs, options, {grad_x, grad_weight, grad_bias});

  Options loss_only = options;
  loss_only.gradients = false;
  const double grad_scale = problem.hp.grad_scale;
  auto f = [&] { return grad_scale * compute_core(inputs, loss_only).loss; };
  const double S = std::abs(grad_scale) * std::max({1.0, std::abs(base.loss), max_abs_logit(s, x, weight, bias)});
  const double delta = 32 * kEps * S;

  struct Entries {
    const char* name;
    std::vector<double>* values;
    const std::vector<double>* gradient;
  };
  int checked = 0, failed = 0;
  double worst_ratio = 0;  // |error| / tolerance, reported so the margin is visible
  std::ostringstream failures;
  for (const Entries& e : {Entries{"x", &x, &grad_x}, Entries{"weight", &weight, &grad_weight},
                           Entries{"bias", &bias, &grad_bias}}) {
    for (std::size_t j = 0; j < e.values->size(); ++j) {
      double& theta = (*e.values)[j];
      const double original = theta;
      auto at = [&](double offset) {
        theta = original + offset;
        const double value = f();
        theta = original;
        return value;
      };
      const double h = kStep, H = kThirdDerivativeStep;
      const double central = (at(h) - at(-h)) / (2 * h);
      const double third = (at(2 * H) - 2 * at(H) + 2 * at(-H) - at(-2 * H)) / (2 * H * H * H);
      const double tolerance = h * h / 6 * (2 * std::abs(third) + 1) + delta / h;
      const double error = std::abs(central - (*e.gradient)[j]);
      worst_ratio = std::max(worst_ratio, error / tolerance);
      ++checked;
      if (!(error <= tolerance) && failed++ < 8)
        failures << "  grad_" << e.name << "[" << j << "] = " << (*e.gradient)[j] << ", central difference " << central
                 << ", error " << error << " > tolerance " << tolerance << "\n";
    }
  }
  EXPECT_EQ(failed, 0) << failed << " of " << checked << " entries off:\n" << failures.str();
  EXPECT_EQ(checked, static_cast<int>(x.size() + weight.size() + bias.size()));
  RecordProperty("worst_error_over_tolerance", std::to_string(worst_ratio));
  std::printf("[ %s ] %d entries, worst |error| / tolerance = %.3g\n", param.name, checked, worst_ratio);
}

Hyperparameters no_nll_symmetric() {
  Hyperparameters hp = hyperparameters(1.5, 0.0, 1.0, 0.5, 1.0);
  hp.compute_nll_loss = false;
  return hp;
}

Hyperparameters empty_zero() {
  Hyperparameters hp = hyperparameters(1.0, 0.5, 1.0, 0.0, 1.0);
  hp.empty_sequence = EmptySequence::zero;
  return hp;
}

Hyperparameters ignore_inside_vocab() {
  Hyperparameters hp = hyperparameters(0.5, 0.2, 1.0, 0.0, -0.5);
  hp.ignore_index = 3;
  return hp;
}

const Shape kSmall{4, 3, 5, 7};

INSTANTIATE_TEST_SUITE_P(
    Cases, FiniteDifferences,
    ::testing::Values(
        FiniteDifferenceCase{"defaults_bias", case_spec(kSmall, true, IgnorePattern::prompt_prefix, 2.0, 11), 0},
        // chunk_rows 2 < 2T: pairs split in pieces of 2 and 1 rows, logits recomputed for the gradient.
        FiniteDifferenceCase{"strong_preference_split_pairs",
                             case_spec(kSmall, true, IgnorePattern::random, 3.0, 12, hyperparameters(2.0, 0.3, 0.4, 0.2, 1.7)), 2},
        FiniteDifferenceCase{"no_nll_symmetric_smoothing",
                             case_spec(kSmall, false, IgnorePattern::all_but_one, 2.0, 13, no_nll_symmetric()), 6},
        FiniteDifferenceCase{"empty_sequence_zero", case_spec(kSmall, true, IgnorePattern::empty_sequence, 2.0, 14, empty_zero()), 1},
        FiniteDifferenceCase{"ignore_index_inside_vocab",
                             case_spec(kSmall, false, IgnorePattern::random, 2.0, 15, ignore_inside_vocab()), 0},
        FiniteDifferenceCase{"large_logits", case_spec(kSmall, true, IgnorePattern::none, 8.0, 16, hyperparameters(0.5, 0.5, 1.0, 0.1, 1.0)), 0},
        FiniteDifferenceCase{"four_pairs_two_per_block",
                             case_spec({8, 2, 3, 4}, true, IgnorePattern::prompt_prefix, 2.0, 17, hyperparameters(1.0, 1.0, 0.5, 0.3, 2.0)), 8}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace simpo::reference
