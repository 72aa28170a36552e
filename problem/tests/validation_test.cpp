// validate(): one test per row of SPEC's edge-case table. Each bad input must be an InputError whose message
// names the thing a person has to fix (the shape, the first bad (b, t) and its value, the sequence, the
// hyperparameter, the tensor and index, both shapes); each nearby good input must pass, so the rule is not
// simply "reject everything".
#include "problem/problem.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace simpo {
namespace {

constexpr std::int64_t kIgnore = -100;

// B = 4 (two pairs), T = 3, H = 4, V = 5; every row has completion tokens and a prompt token.
Problem valid_problem() {
  Problem p;
  p.shape = {4, 3, 4, 5};
  for (int i = 0; i < 4 * 3 * 4; ++i) p.x.as<bf16>().push_back(bf16(0.25f * static_cast<float>(i % 9 - 4)));
  for (int i = 0; i < 5 * 4; ++i) p.weight.as<bf16>().push_back(bf16(0.125f * static_cast<float>(i % 5 - 2)));
  p.bias = std::vector<bf16>(5, bf16(0.5f));
  p.target = {kIgnore, 1, 2,  //
              kIgnore, 0, 4,  //
              3, 3, kIgnore,  //
              kIgnore, kIgnore, 0};
  return p;
}

std::int64_t& target_at(Problem& p, std::int64_t b, std::int64_t t) {
  return p.target[static_cast<std::size_t>(b * p.shape.T + t)];
}

std::string validation_error(const Problem& p, const ValidationOptions& options = {}) {
  try {
    validate(p, options);
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "validate accepted the problem";
  return "";
}

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "message: " << (haystack)

TEST(Validation, TheBaseProblemIsValid) {
  EXPECT_NO_THROW(validate(valid_problem()));
  Problem p = valid_problem();
  p.bias.reset();
  EXPECT_NO_THROW(validate(p));
}

// Row: "B odd, B = 0, T = 0, H = 0 or V = 0 -> error naming the shape".
TEST(Validation, BadShapeIsNamed) {
  for (const Shape& s : {Shape{3, 3, 4, 5}, Shape{1, 3, 4, 5}, Shape{0, 3, 4, 5}, Shape{4, 0, 4, 5},
                         Shape{4, 3, 0, 5}, Shape{4, 3, 4, 0}, Shape{-2, 3, 4, 5}, Shape{4, 3, -1, 5}}) {
    // Tensors sized to the (bad) shape, so the shape itself is the only thing wrong.
    Problem p;
    p.shape = s;
    const auto n = [](std::int64_t a) { return static_cast<std::size_t>(std::max<std::int64_t>(a, 0)); };
    p.x.as<bf16>().assign(n(s.B * s.T * s.H), bf16(0.0f));
    p.weight.as<bf16>().assign(n(s.V * s.H), bf16(0.0f));
    p.target.assign(n(s.B * s.T), 0);
    const std::string m = validation_error(p);
    EXPECT_CONTAINS(m, s.to_string());
    try {
      validate_shape(s);
      ADD_FAILURE() << "validate_shape accepted " << s.to_string();
    } catch (const InputError& e) {
      EXPECT_CONTAINS(e.what(), s.to_string());
    }
  }
  EXPECT_NO_THROW(validate_shape({2, 1, 1, 1}));  // the smallest valid shape
  EXPECT_EQ((Shape{2, 4, 8, 16}.to_string()), "B=2 T=4 H=8 V=16");
}

// Row: "a target outside [0, V) that is not ignore_index -> error naming the first such (b, t) and its value".
TEST(Validation, TargetOutOfRangeNamesFirstPositionAndValue) {
  Problem p = valid_problem();
  target_at(p, 1, 2) = 7;
  target_at(p, 3, 0) = -5;  // also bad, but later in (b, t) order
  std::string m = validation_error(p);
  EXPECT_CONTAINS(m, "target(1, 2) = 7");
  EXPECT_EQ(m.find("-5"), std::string::npos) << m;

  p = valid_problem();
  target_at(p, 2, 1) = 5;  // == V: one past the end
  EXPECT_CONTAINS(validation_error(p), "target(2, 1) = 5");

  p = valid_problem();
  target_at(p, 0, 0) = -1;  // negative but not ignore_index
  EXPECT_CONTAINS(validation_error(p), "target(0, 0) = -1");

  p = valid_problem();
  target_at(p, 0, 2) = 4;  // V - 1: the last valid token
  EXPECT_NO_THROW(validate(p));
}

TEST(Validation, CustomIgnoreIndexIsNotATargetAndTheOldOneIs) {
  Problem p = valid_problem();
  for (auto& t : p.target)
    if (t == kIgnore) t = 5;  // ignore_index = V: outside the vocabulary, like -100
  p.hp.ignore_index = 5;
  EXPECT_NO_THROW(validate(p));

  target_at(p, 3, 2) = kIgnore;  // -100 is now an ordinary (out of range) target
  EXPECT_CONTAINS(validation_error(p), "target(3, 2) = -100");
}

// Row: "a sequence with no completion token -> error naming the sequence (chosen/rejected, pair i)".
TEST(Validation, EmptySequenceNamesChosenOrRejectedAndPair) {
  Problem p = valid_problem();
  for (std::int64_t t = 0; t < 3; ++t) target_at(p, 1, t) = kIgnore;  // row 1: chosen, pair 1
  EXPECT_CONTAINS(validation_error(p), "chosen sequence of pair 1");

  p = valid_problem();
  for (std::int64_t t = 0; t < 3; ++t) target_at(p, 2, t) = kIgnore;  // row 2 = P + 0: rejected, pair 0
  const std::string m = validation_error(p);
  EXPECT_CONTAINS(m, "rejected sequence of pair 0");
  EXPECT_EQ(m.find("chosen"), std::string::npos) << m;

  // empty_sequence = zero accepts it (avg taken as 0, no gradient).
  p.hp.empty_sequence = EmptySequence::zero;
  EXPECT_NO_THROW(validate(p));
}

TEST(Validation, SequenceNameCountsPairsFromEachHalf) {
  const Shape s{6, 1, 1, 1};
  EXPECT_CONTAINS(sequence_name(s, 0), "chosen sequence of pair 0");
  EXPECT_CONTAINS(sequence_name(s, 2), "chosen sequence of pair 2");
  EXPECT_CONTAINS(sequence_name(s, 3), "rejected sequence of pair 0");
  EXPECT_CONTAINS(sequence_name(s, 5), "rejected sequence of pair 2");
}

// Row: "compute_nll_loss with no chosen completion token (N_c = 0) -> error, unless alpha = 0".
TEST(Validation, NoChosenTokenWithNllIsAnErrorUnlessAlphaZero) {
  Problem p = valid_problem();
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t = 0; t < 3; ++t) target_at(p, b, t) = kIgnore;
  p.hp.empty_sequence = EmptySequence::zero;  // so the empty-sequence rule does not fire first
  const std::string m = validation_error(p);
  EXPECT_CONTAINS(m, "compute_nll_loss");
  EXPECT_CONTAINS(m, "chosen");

  Problem alpha_zero = p;
  alpha_zero.hp.alpha = 0;
  EXPECT_NO_THROW(validate(alpha_zero));
  Problem no_nll = p;
  no_nll.hp.compute_nll_loss = false;
  EXPECT_NO_THROW(validate(no_nll));

  // Rejected rows do not count towards N_c: the same problem with only the rejected rows empty is fine.
  Problem rejected_empty = valid_problem();
  for (std::int64_t b = 2; b < 4; ++b)
    for (std::int64_t t = 0; t < 3; ++t) target_at(rejected_empty, b, t) = kIgnore;
  rejected_empty.hp.empty_sequence = EmptySequence::zero;
  EXPECT_NO_THROW(validate(rejected_empty));
}

// Row: "NaN or Inf in x, weight or bias -> error naming the tensor and first index".
TEST(Validation, NonFiniteInputNamesTensorAndFirstIndex) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();

  Problem p = valid_problem();
  p.x.as<bf16>()[7] = bf16(nan);   // [B, T, H] = [4, 3, 4]: flat 7 is (0, 1, 3)
  p.x.as<bf16>()[20] = bf16(inf);  // later: not the one named
  std::string m = validation_error(p);
  EXPECT_CONTAINS(m, "x(0, 1, 3)");
  EXPECT_CONTAINS(m, "nan");

  p = valid_problem();
  p.weight.as<bf16>()[9] = bf16(-inf);  // [V, H] = [5, 4]: flat 9 is (2, 1)
  m = validation_error(p);
  EXPECT_CONTAINS(m, "weight(2, 1)");
  EXPECT_CONTAINS(m, "inf");

  p = valid_problem();
  p.bias->as<bf16>()[3] = bf16(inf);
  m = validation_error(p);
  EXPECT_CONTAINS(m, "bias(3)");
  EXPECT_CONTAINS(m, "inf");

  // The largest finite bf16 is an ordinary value.
  p = valid_problem();
  p.x.as<bf16>()[0] = std::numeric_limits<bf16>::max();
  EXPECT_NO_THROW(validate(p));

  // SPEC lets the scan be turned off, and only the scan.
  p = valid_problem();
  p.x.as<bf16>()[7] = bf16(nan);
  EXPECT_NO_THROW(validate(p, {.scan_values = false}));
  target_at(p, 0, 0) = 99;
  EXPECT_CONTAINS(validation_error(p, {.scan_values = false}), "target(0, 0) = 99");
}

// Row: "hyperparameter out of range -> error naming it". Ranges from SPEC's hyperparameter table.
TEST(Validation, HyperparameterOutOfRangeIsNamed) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Bad {
    const char* name;
    void (*set)(Hyperparameters&, double);
    std::vector<double> values;
  };
  const std::vector<Bad> bad = {
      {"beta", [](Hyperparameters& h, double v) { h.beta = v; }, {0.0, -0.1, nan, inf}},
      {"gamma", [](Hyperparameters& h, double v) { h.gamma = v; }, {nan, inf, -inf}},
      {"alpha", [](Hyperparameters& h, double v) { h.alpha = v; }, {-1e-9, nan, inf}},
      {"label_smoothing", [](Hyperparameters& h, double v) { h.label_smoothing = v; }, {-0.01, 0.5000001, 1.0, nan}},
      {"grad_scale", [](Hyperparameters& h, double v) { h.grad_scale = v; }, {nan, inf}},
  };
  for (const auto& b : bad)
    for (double v : b.values) {
      Problem p = valid_problem();
      b.set(p.hp, v);
      EXPECT_CONTAINS(validation_error(p), b.name);
      try {
        validate_hyperparameters(p.hp);
        ADD_FAILURE() << b.name << " = " << v << " accepted";
      } catch (const InputError& e) {
        EXPECT_CONTAINS(e.what(), std::string("hyperparameter ") + b.name);
      }
    }

  // The edges of each range are inside it.
  Problem p = valid_problem();
  p.hp = {.beta = 1e-12, .gamma = -3.0, .alpha = 0.0, .label_smoothing = 0.5, .grad_scale = -2.0};
  EXPECT_NO_THROW(validate(p));
  p.hp.label_smoothing = 0.0;
  p.hp.grad_scale = 0.0;
  EXPECT_NO_THROW(validate(p));
}

// valid_problem() with its inputs converted (exactly: every value is a multiple of 1/8) to T.
template <class T> Problem converted(T) {
  Problem p = valid_problem();
  auto as = [](const InputValues& v) {
    std::vector<T> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = T(static_cast<float>(v.value(i)));
    return out;
  };
  p.x = as(p.x);
  p.weight = as(p.weight);
  p.bias = as(*p.bias);
  return p;
}

// Row: "x, weight and bias share one dtype (mixing them is an error naming both)".
TEST(Validation, EveryInputDtypeIsValidAndMixingThemNamesBoth) {
  EXPECT_NO_THROW(validate(converted(bf16())));
  EXPECT_NO_THROW(validate(converted(f16())));
  EXPECT_NO_THROW(validate(converted(0.0f)));
  EXPECT_EQ(converted(f16()).input_dtype(), DType::F16);

  Problem p = converted(0.0f);
  p.weight = converted(bf16()).weight;
  std::string m = validation_error(p);
  EXPECT_CONTAINS(m, "x is F32 but weight is BF16");

  p = converted(f16());
  p.bias = converted(0.0f).bias;
  m = validation_error(p);
  EXPECT_CONTAINS(m, "x is F16 but bias is F32");
}

// The NaN/Inf scan in every input dtype, naming the tensor and the first index; f16's largest finite value
// (65504) is an ordinary value, a float beyond it is not an f16.
TEST(Validation, NonFiniteInputIsNamedInEveryDtype) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  Problem p = converted(0.0f);
  p.x.as<float>()[7] = nan;
  EXPECT_CONTAINS(validation_error(p), "x(0, 1, 3)");
  p = converted(0.0f);
  p.bias->as<float>()[2] = -inf;
  EXPECT_CONTAINS(validation_error(p), "bias(2) = -inf");
  p = converted(0.0f);
  p.x.as<float>()[0] = std::numeric_limits<float>::max();
  EXPECT_NO_THROW(validate(p));

  p = converted(f16());
  p.weight.as<f16>()[9] = f16(inf);
  EXPECT_CONTAINS(validation_error(p), "weight(2, 1) = inf");
  p = converted(f16());
  p.x.as<f16>()[20] = f16(nan);
  EXPECT_CONTAINS(validation_error(p), "x(1, 2, 0) = nan");
  p = converted(f16());
  p.x.as<f16>()[0] = f16(65504.0f);
  EXPECT_NO_THROW(validate(p));
  p.x.as<f16>()[0] = f16(65536.0f);  // rounds to inf
  EXPECT_CONTAINS(validation_error(p), "x(0, 0, 0) = inf");
}

// Row: "shapes that disagree between tensors -> error naming both shapes". A Problem holds flat vectors, so
// the message gives the tensor's element count against the shape the problem's Shape requires.
TEST(Validation, TensorSizeDisagreeingWithShapeNamesBoth) {
  Problem p = valid_problem();
  p.x.as<bf16>().pop_back();
  std::string m = validation_error(p);
  EXPECT_CONTAINS(m, "x holds 47 values");
  EXPECT_CONTAINS(m, "[4, 3, 4]");

  p = valid_problem();
  p.weight.as<bf16>().resize(24);  // H = 4, V = 6: one row too many
  m = validation_error(p);
  EXPECT_CONTAINS(m, "weight holds 24 values");
  EXPECT_CONTAINS(m, "[5, 4]");

  p = valid_problem();
  p.bias->as<bf16>().resize(4);
  m = validation_error(p);
  EXPECT_CONTAINS(m, "bias holds 4 values");
  EXPECT_CONTAINS(m, "[5]");

  p = valid_problem();
  p.target.push_back(0);
  m = validation_error(p);
  EXPECT_CONTAINS(m, "target holds 13 values");
  EXPECT_CONTAINS(m, "[4, 3]");
}

TEST(Outputs, NamesAndShapesFollowSpec) {
  const std::vector<std::string> expected = {"loss",           "nll_loss",       "chosen_logps",
                                             "rejected_logps", "chosen_logits_mean", "rejected_logits_mean",
                                             "chosen_rewards", "rejected_rewards",   "grad_x",
                                             "grad_weight",    "grad_bias"};
  EXPECT_EQ(all_output_names(), expected);
  const Shape s{6, 5, 3, 7};
  using S = std::vector<std::int64_t>;
  EXPECT_EQ(output_shape(s, "loss"), S{});
  EXPECT_EQ(output_shape(s, "nll_loss"), S{});
  EXPECT_EQ(output_shape(s, "rejected_logits_mean"), S{});
  EXPECT_EQ(output_shape(s, "chosen_logps"), S{3});
  EXPECT_EQ(output_shape(s, "rejected_rewards"), S{3});
  EXPECT_EQ(output_shape(s, "grad_x"), (S{6, 5, 3}));
  EXPECT_EQ(output_shape(s, "grad_weight"), (S{7, 3}));
  EXPECT_EQ(output_shape(s, "grad_bias"), S{7});
  EXPECT_THROW(output_shape(s, "logits"), InputError);
  EXPECT_TRUE(is_gradient_output("grad_x"));
  EXPECT_FALSE(is_gradient_output("loss"));
  EXPECT_FALSE(is_gradient_output("chosen_rewards"));
}

}  // namespace
}  // namespace simpo
