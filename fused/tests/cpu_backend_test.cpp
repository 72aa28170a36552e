// The cpu backend against the float64 reference on every SPEC feature, at the accuracy bar (each
// gradient within 1.5x its bf16 floor; loss, nll and logps within 5e-7 relative), and against itself across
// chunk schedules and workspace budgets.
#include "fused/fused.h"
#include "fused/schedule.h"
#include "fused/tests/accuracy.h"
#include "problem/generate.h"
#include "reference/reference.h"

#include <gtest/gtest.h>

#include <cmath>

namespace simpo::fused {
namespace {

using testing::bar_violations;
using testing::bf16_floor;
using testing::relative_error;

Options cpu_options() {
  Options o;
  o.backend = Backend::cpu;
  return o;
}

// *_logits_mean tolerance: each fp32 logit carries an error of order sqrt(H) 2^-24 |x| |w| ~ 1e-7 logit_scale
// (H <= 1024 here), and the mean over P*T*V of them averages it further; 1e-6 * scale leaves 10x for the
// correlated part. (The reference's mean is exact to double.)
double logits_mean_tolerance(double logit_scale) { return 1e-6 * logit_scale; }

void expect_meets_bar(const TensorMap& fused, const TensorMap& reference, double logit_scale) {
  for (const auto& v : bar_violations(fused, reference, logits_mean_tolerance(logit_scale))) ADD_FAILURE() << v;
}

void expect_dtypes(const TensorMap& out, const Problem& problem, const Options& options) {
  const DType grad_dtype = options.grad_weight_f32 ? DType::F32 : DType::BF16;
  for (const auto& name : all_output_names()) {
    const bool present = out.count(name) > 0;
    const bool wanted = !is_gradient_output(name) ||
                        (options.gradients && (name != output_name::grad_bias || problem.has_bias()));
    EXPECT_EQ(present, wanted) << name;
    if (!present) continue;
    const Tensor& t = out.at(name);
    EXPECT_EQ(t.shape, output_shape(problem.shape, name)) << name;
    if (name == output_name::grad_x) EXPECT_EQ(t.dtype, DType::BF16);
    else if (is_gradient_output(name)) EXPECT_EQ(t.dtype, grad_dtype) << name;
    else EXPECT_EQ(t.dtype, DType::F32) << name;
  }
}

CaseSpec spec_of(Shape shape, double logit_scale, std::uint64_t seed) {
  CaseSpec spec;
  spec.shape = shape;
  spec.logit_scale = logit_scale;
  spec.seed = seed;
  return spec;
}

// One case: generate, run the reference and the cpu backend, check dtypes and the bar.
TensorMap check_case(const CaseSpec& spec, const Options& options) {
  const Problem problem = generate(spec);
  reference::Options ref_options;
  ref_options.gradients = options.gradients;
  const TensorMap exact = reference::compute(problem, ref_options);
  const TensorMap out = compute(problem, options);
  expect_dtypes(out, problem, options);
  expect_meets_bar(out, exact, spec.logit_scale);
  return out;
}

// Two fused runs differ only by fp32 noise when their gradients differ far less than the bf16 floor (the
// exact gradient's own rounding error, from `exact`): sums that differ in their last fp32 bits round to the
// neighbouring bf16 value in a few elements. 0.25x the floor allows that in a few percent of the elements at
// most (each flip costs ~1 bf16 ulp, 2-4x an average rounding error); the scalars agree to 1e-6 relative
// (fp32 sums of the same terms in other orders).
void expect_same_to_fp32_noise(const TensorMap& a, const TensorMap& b, const TensorMap& exact) {
  for (const auto& [name, t] : a) {
    if (is_gradient_output(name)) {
      EXPECT_LE(relative_error(t, b.at(name)), 0.25 * bf16_floor(exact.at(name))) << name;
    } else {
      for (std::int64_t i = 0; i < t.numel(); ++i)
        EXPECT_LE(std::abs(t.value(i) - b.at(name).value(i)), 1e-6 * (1 + std::abs(t.value(i)))) << name << "[" << i << "]";
    }
  }
}

// ---- the bar on shapes big enough for the Frobenius statistic to be stable (N*H and V*H >= 1e5) ----

const Shape bar_shape{.B = 4, .T = 128, .H = 256, .V = 512};

TEST(CpuBackendAccuracy, RealisticLogitsMeetTheBar) { check_case(spec_of(bar_shape, 2.0, 11), cpu_options()); }

TEST(CpuBackendAccuracy, LargeLogitsMeetTheBar) { check_case(spec_of(bar_shape, 30.0, 12), cpu_options()); }

TEST(CpuBackendAccuracy, EveryFeatureAtOnceMeetsTheBar) {
  CaseSpec spec = spec_of(bar_shape, 4.0, 13);
  spec.bias = true;
  spec.ignore = IgnorePattern::random;
  spec.hp.label_smoothing = 0.2;
  spec.hp.grad_scale = 0.37;
  spec.hp.ignore_index = 7;  // inside [0, V): target 7 means "ignored"
  spec.hp.beta = 2.0;
  spec.hp.gamma = -0.3;
  spec.hp.alpha = 0.6;
  Options options = cpu_options();
  options.max_chunk_rows = 3 * 128 + 5;  // three_pass, one pair per chunk
  check_case(spec, options);
}

// ---- SPEC features one at a time, smaller shapes ----

const Shape feature_shape{.B = 4, .T = 64, .H = 96, .V = 300};

TEST(CpuBackendFeatures, Bias) {
  CaseSpec spec = spec_of(feature_shape, 2.0, 21);
  spec.bias = true;
  check_case(spec, cpu_options());
}

TEST(CpuBackendFeatures, LabelSmoothing) {
  CaseSpec spec = spec_of(feature_shape, 2.0, 22);
  spec.hp.label_smoothing = 0.5;
  check_case(spec, cpu_options());
}

TEST(CpuBackendFeatures, NllOffGivesZeroNll) {
  CaseSpec spec = spec_of(feature_shape, 2.0, 23);
  spec.hp.compute_nll_loss = false;
  spec.hp.alpha = 3.0;  // must not matter
  const TensorMap out = check_case(spec, cpu_options());
  EXPECT_EQ(out.at(output_name::nll_loss).value(0), 0.0);
}

TEST(CpuBackendFeatures, AlphaZero) {
  CaseSpec spec = spec_of(feature_shape, 2.0, 24);
  spec.hp.alpha = 0.0;
  check_case(spec, cpu_options());
}

TEST(CpuBackendFeatures, CustomIgnoreIndex) {
  CaseSpec spec = spec_of(feature_shape, 2.0, 25);
  spec.hp.ignore_index = -1;
  spec.ignore = IgnorePattern::random;
  check_case(spec, cpu_options());
}

TEST(CpuBackendFeatures, GradScale) {
  CaseSpec spec = spec_of(feature_shape, 2.0, 26);
  spec.hp.grad_scale = -2.5;
  check_case(spec, cpu_options());
}

TEST(CpuBackendFeatures, AllButOneTokenIgnored) {
  CaseSpec spec = spec_of(feature_shape, 2.0, 27);
  spec.ignore = IgnorePattern::all_but_one;
  check_case(spec, cpu_options());
}

TEST(CpuBackendFeatures, EmptySequenceTreatedAsZero) {
  CaseSpec spec = spec_of(feature_shape, 2.0, 28);
  spec.ignore = IgnorePattern::empty_sequence;
  spec.hp.empty_sequence = EmptySequence::zero;
  check_case(spec, cpu_options());
}

TEST(CpuBackendFeatures, EmptySequenceIsAnErrorByDefault) {
  CaseSpec spec = spec_of(feature_shape, 2.0, 28);
  spec.ignore = IgnorePattern::empty_sequence;
  EXPECT_THROW(compute(generate(spec), cpu_options()), InputError);
}

TEST(CpuBackendFeatures, ForwardOnlyHasNoGradientsAndTheSameForward) {
  const CaseSpec spec = spec_of(feature_shape, 2.0, 29);
  Options forward = cpu_options();
  forward.gradients = false;
  const TensorMap fwd = check_case(spec, forward);
  const TensorMap full = compute(generate(spec), cpu_options());
  // Forward-only uses bigger chunks (no dz or grad_x per row): the same forward up to fp32 noise.
  expect_same_to_fp32_noise(fwd, full, {});  // no gradients to compare
}

TEST(CpuBackendFeatures, GradWeightF32RoundsToTheBf16Output) {
  CaseSpec spec = spec_of(feature_shape, 2.0, 30);
  spec.bias = true;
  Options f32 = cpu_options();
  f32.grad_weight_f32 = true;
  const TensorMap wide = check_case(spec, f32);
  const TensorMap narrow = compute(generate(spec), cpu_options());
  // The bf16 outputs are the same fp32 accumulators rounded once, so rounding the F32 ones must match bitwise.
  for (const char* name : {output_name::grad_weight, output_name::grad_bias}) {
    const auto a = wide.at(name).as<float>();
    const auto b = narrow.at(name).as<bf16>();
    ASSERT_EQ(a.size(), b.size());
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < a.size(); ++i) mismatches += bf16(a[i]) != b[i];
    EXPECT_EQ(mismatches, 0u) << name;
  }
}

TEST(CpuBackendFeatures, OddSizesBothSchedules) {
  CaseSpec spec = spec_of({.B = 6, .T = 37, .H = 31, .V = 123}, 2.0, 31);
  spec.bias = true;
  spec.hp.label_smoothing = 0.1;
  for (std::int64_t rows : {0, 1, 50, 73, 74, 75, 111, 149}) {  // 2T = 74: below it two_pass, from it three_pass
    SCOPED_TRACE("max_chunk_rows " + std::to_string(rows));
    Options options = cpu_options();
    options.max_chunk_rows = rows;
    check_case(spec, options);
  }
}

TEST(CpuBackendFeatures, IgnoredRowsOfGradXAreExactlyZero) {
  CaseSpec spec = spec_of(feature_shape, 2.0, 32);
  spec.ignore = IgnorePattern::random;
  const Problem problem = generate(spec);
  Options options = cpu_options();
  options.max_chunk_rows = 50;
  const auto grad_x = compute(problem, options).at(output_name::grad_x).as<bf16>();
  std::int64_t ignored = 0;
  for (std::int64_t b = 0; b < problem.shape.B; ++b)
    for (std::int64_t t = 0; t < problem.shape.T; ++t) {
      if (problem.is_completion(b, t)) continue;
      ++ignored;
      for (std::int64_t h = 0; h < problem.shape.H; ++h)
        ASSERT_EQ(static_cast<float>(grad_x[static_cast<std::size_t>((b * problem.shape.T + t) * problem.shape.H + h)]), 0.f);
    }
  EXPECT_GT(ignored, 0);
}

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
    expect_same_to_fp32_noise(compute(problem, options), whole, exact);
  }
}

TEST(CpuBackendSchedules, TwoPassAgreesWithThreePass) {
  CaseSpec spec = spec_of({.B = 4, .T = 50, .H = 48, .V = 200}, 30.0, 42);
  spec.hp.label_smoothing = 0.25;
  const Problem problem = generate(spec);
  Options three = cpu_options(), two = cpu_options();
  three.max_chunk_rows = 100;  // one pair per chunk
  two.max_chunk_rows = 99;     // one row short of a pair: the fallback
  ASSERT_EQ(plan(problem.shape, three).mode, Mode::three_pass);
  ASSERT_EQ(plan(problem.shape, two).mode, Mode::two_pass);
  expect_same_to_fp32_noise(compute(problem, two), compute(problem, three), reference::compute(problem));
}

TEST(CpuBackendSchedules, TooSmallABudgetIsAnInputErrorNamingTheBytes) {
  const Problem problem = generate(spec_of({.B = 2, .T = 4, .H = 8, .V = 1000}, 2.0, 43));
  Options options = cpu_options();
  options.workspace_bytes = 1000;
  try {
    compute(problem, options);
    FAIL() << "no error";
  } catch (const InputError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("1000 bytes"), std::string::npos) << message;
    EXPECT_NE(message.find(std::to_string(workspace_bytes_per_row(problem.shape, true))), std::string::npos) << message;
  }
}

// ---- the entry point ----

TEST(FusedEntryPoint, InvalidProblemsAreInputErrors) {
  Problem problem = generate(spec_of({.B = 2, .T = 4, .H = 8, .V = 16}, 2.0, 51));
  problem.target[3] = 16;  // outside [0, V)
  EXPECT_THROW(compute(problem, cpu_options()), InputError);
}

TEST(FusedEntryPoint, ValidateOffSkipsOnlyTheValueScan) {
  Problem problem = generate(spec_of({.B = 2, .T = 4, .H = 8, .V = 16}, 2.0, 52));
  problem.x[5] = bf16(NAN);
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
