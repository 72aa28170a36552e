// Every row of SPEC's edge-case table surfaces from reference::compute as an InputError whose message names the
// problem, and the two cases SPEC allows (empty_sequence = zero; no chosen token with alpha = 0) give finite
// outputs, never NaN.
#include "problem/generate.h"
#include "reference/reference.h"
#include "reference/reference_core.h"
#include "reference/tests/tensor_compare.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

namespace simpo::reference {
namespace {

Problem valid_problem(bool bias = true) {
  CaseSpec c;
  c.shape = {4, 3, 5, 7};
  c.bias = bias;
  c.ignore = IgnorePattern::none;
  c.seed = 31;
  return generate(c);
}

// Runs compute on the problem after `edit` and returns the InputError's message ("" if nothing was thrown).
std::string error_of(const std::function<void(Problem&)>& edit) {
  Problem p = valid_problem();
  edit(p);
  try {
    compute(p);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

struct ErrorCase {
  const char* name;
  std::function<void(Problem&)> edit;
  std::vector<std::string> message_contains;
};
// gtest prints a parameter by its name, not its bytes.
void PrintTo(const ErrorCase& c, std::ostream* os) { *os << c.name; }


class InputErrors : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(InputErrors, SurfaceFromComputeNamingTheProblem) {
  const std::string message = error_of(GetParam().edit);
  ASSERT_FALSE(message.empty()) << "no InputError";
  for (const std::string& part : GetParam().message_contains)
    EXPECT_NE(message.find(part), std::string::npos) << "message \"" << message << "\" lacks \"" << part << "\"";
}

void set_shape(Problem& p, Shape s) {
  p.shape = s;
  p.x.as<bf16>().assign(static_cast<std::size_t>(std::max<std::int64_t>(0, s.B * s.T * s.H)), bf16(0.5f));
  p.weight.as<bf16>().assign(static_cast<std::size_t>(std::max<std::int64_t>(0, s.V * s.H)), bf16(0.5f));
  p.bias.reset();
  p.target.assign(static_cast<std::size_t>(std::max<std::int64_t>(0, s.B * s.T)), 0);
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

INSTANTIATE_TEST_SUITE_P(
    SpecEdgeCases, InputErrors,
    ::testing::Values(
        ErrorCase{"odd_B", [](Problem& p) { set_shape(p, {3, 2, 2, 2}); }, {"B=3", "even"}},
        ErrorCase{"zero_B", [](Problem& p) { set_shape(p, {0, 2, 2, 2}); }, {"B=0"}},
        ErrorCase{"zero_T", [](Problem& p) { set_shape(p, {2, 0, 2, 2}); }, {"T=0"}},
        ErrorCase{"zero_H", [](Problem& p) { set_shape(p, {2, 2, 0, 2}); }, {"H=0"}},
        ErrorCase{"zero_V", [](Problem& p) { set_shape(p, {2, 2, 2, 0}); }, {"V=0"}},
        ErrorCase{"target_too_large", [](Problem& p) { p.target[1 * 3 + 2] = 7; }, {"target(1, 2) = 7", "[0, 7)"}},
        ErrorCase{"target_negative", [](Problem& p) { p.target[2 * 3 + 0] = -5; }, {"target(2, 0) = -5"}},
        ErrorCase{"empty_rejected_sequence",
                  [](Problem& p) {
                    for (int t = 0; t < 3; ++t) p.target[3 * 3 + t] = p.hp.ignore_index;
                  },
                  {"rejected sequence of pair 1", "no completion token"}},
        ErrorCase{"no_chosen_token_with_nll",
                  [](Problem& p) {
                    p.hp.empty_sequence = EmptySequence::zero;
                    for (int t = 0; t < 6; ++t) p.target[t] = p.hp.ignore_index;
                  },
                  {"compute_nll_loss"}},
        ErrorCase{"nan_in_x", [](Problem& p) { p.x.as<bf16>()[1 * 15 + 2 * 5 + 3] = bf16(static_cast<float>(kNaN)); }, {"x(1, 2, 3)"}},
        ErrorCase{"inf_in_weight", [](Problem& p) { p.weight.as<bf16>()[4 * 5 + 1] = bf16(static_cast<float>(kInf)); }, {"weight(4, 1)"}},
        ErrorCase{"nan_in_bias", [](Problem& p) { p.bias->as<bf16>()[6] = bf16(static_cast<float>(kNaN)); }, {"bias(6)"}},
        ErrorCase{"beta_zero", [](Problem& p) { p.hp.beta = 0; }, {"beta"}},
        ErrorCase{"beta_nan", [](Problem& p) { p.hp.beta = kNaN; }, {"beta"}},
        ErrorCase{"gamma_infinite", [](Problem& p) { p.hp.gamma = kInf; }, {"gamma"}},
        ErrorCase{"alpha_negative", [](Problem& p) { p.hp.alpha = -0.5; }, {"alpha"}},
        ErrorCase{"label_smoothing_above_half", [](Problem& p) { p.hp.label_smoothing = 0.6; }, {"label_smoothing"}},
        ErrorCase{"label_smoothing_negative", [](Problem& p) { p.hp.label_smoothing = -0.1; }, {"label_smoothing"}},
        ErrorCase{"grad_scale_infinite", [](Problem& p) { p.hp.grad_scale = -kInf; }, {"grad_scale"}},
        ErrorCase{"x_size_disagrees", [](Problem& p) { p.x.as<bf16>().pop_back(); }, {"x", "[4, 3, 5]"}},
        ErrorCase{"weight_size_disagrees", [](Problem& p) { p.weight.as<bf16>().push_back(bf16(0.0f)); }, {"weight", "[7, 5]"}},
        ErrorCase{"bias_size_disagrees", [](Problem& p) { p.bias->as<bf16>().pop_back(); }, {"bias", "[7]"}},
        ErrorCase{"target_size_disagrees", [](Problem& p) { p.target.push_back(0); }, {"target", "[4, 3]"}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(AllowedEdgeCases, EmptySequenceZeroAndNoChosenTokenWithoutNllAreFinite) {
  Problem p = valid_problem();
  p.hp.empty_sequence = EmptySequence::zero;
  p.hp.alpha = 0;  // allows N_c = 0 although compute_nll_loss stays on
  for (int t = 0; t < 6; ++t) p.target[t] = p.hp.ignore_index;  // both chosen sequences empty
  const TensorMap out = compute(p);
  for (const auto& [name, tensor] : out)
    for (double v : tensor.to_double()) EXPECT_TRUE(std::isfinite(v)) << name;
  EXPECT_EQ(testing::scalar(out, "nll_loss"), 0.0);
  for (double c : testing::values(out, "chosen_logps")) EXPECT_EQ(c, 0.0);
  // The rejected sequences still carry the preference gradient.
  const auto grad_x = testing::values(out, "grad_x");
  double rejected_max = 0;
  for (std::size_t i = grad_x.size() / 2; i < grad_x.size(); ++i) rejected_max = std::max(rejected_max, std::abs(grad_x[i]));
  EXPECT_GT(rejected_max, 0.0);
}

TEST(CoreInputs, SizeMismatchesAreInputErrors) {
  const Problem p = valid_problem();
  const std::vector<double> x = widen(p.x), weight = widen(p.weight), bias = widen(*p.bias);
  std::vector<double> gx(x.size()), gw(weight.size() - 1), gb(bias.size());
  try {
    compute_core({p.shape, p.hp, x, weight, bias, p.target}, {}, {gx, gw, gb});
    FAIL() << "no InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("grad_weight"), std::string::npos) << e.what();
  }
}

// Device selection (SPEC's --reference): auto always resolves to something that can run here; cuda where
// reference-cuda cannot run is an InputError that says why, from compute and compute_core alike; a misspelt name
// lists the choices.
TEST(DeviceSelection, UnavailableCudaIsAnInputErrorNamingWhy) {
  EXPECT_EQ(resolve(Device::automatic), cuda_available() ? Device::cuda : Device::cpu);
  EXPECT_EQ(resolve(Device::cpu), Device::cpu);
  // Per problem, auto takes the GPU only from 2^28 logit multiply-adds (N V H) on.
  const Shape small{2, 8, 64, 1000}, published{2, 1024, 4096, 128256};
  EXPECT_EQ(resolve(Device::automatic, small), Device::cpu);
  EXPECT_EQ(resolve(Device::automatic, published), cuda_available() ? Device::cuda : Device::cpu);
  EXPECT_EQ(resolve(Device::cpu, published), Device::cpu);
  EXPECT_EQ(device_from_name("auto"), Device::automatic);
  try {
    device_from_name("gpu");
    FAIL() << "no InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("cpu, cuda or auto"), std::string::npos) << e.what();
  }
  // A program's choice (simpo-verify --reference) reaches every Options made after it.
  EXPECT_EQ(Options{}.device, Device::cpu);
  set_default_device(Device::automatic);
  EXPECT_EQ(Options{}.device, Device::automatic);
  set_default_device(Device::cpu);
  if (cuda_available()) GTEST_SKIP() << "reference-cuda can run here: nothing to refuse";
  EXPECT_FALSE(cuda_unavailable_reason().empty());
  Options options;
  options.device = Device::cuda;
  const Problem p = valid_problem();
  for (const bool core : {false, true}) {
    try {
      if (core) {
        const std::vector<double> x = widen(p.x), weight = widen(p.weight), bias = widen(*p.bias);
        std::vector<double> gx(x.size()), gw(weight.size()), gb(bias.size());
        compute_core({p.shape, p.hp, x, weight, bias, p.target}, options, {gx, gw, gb});
      } else {
        compute(p, options);
      }
      FAIL() << "no InputError";
    } catch (const InputError& e) {
      EXPECT_EQ(std::string(e.what()), "reference cuda: " + cuda_unavailable_reason());
    }
  }
  // The reproducible mode is CPU-only and ignores the device.
  options.reproducible = true;
  EXPECT_NO_THROW(compute(p, options));
}

}  // namespace
}  // namespace simpo::reference
