// The cuda backend against the float64 reference (the bar: each gradient within 1.5x its bf16 floor;
// loss, nll and logps within 5e-7 relative) and against the cpu backend (same algorithm, so the same result up
// to fp32 noise), on every SPEC feature, odd sizes, chunk boundaries and workspace budgets. Needs a CUDA
// device: without one every test that runs the backend skips with a message saying so.
#include "fused/cuda/cuda_backend.h"
#include "fused/cuda/device_fused.h"
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

#define SKIP_WITHOUT_DEVICE()                                                                             \
  do {                                                                                                     \
    if (!cuda::device_present())                                                                           \
      GTEST_SKIP() << "no CUDA device on this machine: the cuda backend tests run on a GPU machine (ctest -L gpu)"; \
  } while (0)

Options cuda_options() {
  Options o;
  o.backend = Backend::cuda;
  return o;
}
Options cpu_options() {
  Options o;
  o.backend = Backend::cpu;
  return o;
}

// As in the cpu backend's tests: each fp32 logit carries ~sqrt(H) 2^-24 |x||w| ~ 1e-7 logit_scale of error,
// averaged over P*T*V of them; 1e-6 * scale leaves 10x for the correlated part.
double logits_mean_tolerance(double logit_scale) { return 1e-6 * logit_scale; }

CaseSpec spec_of(Shape shape, double logit_scale, std::uint64_t seed) {
  CaseSpec spec;
  spec.shape = shape;
  spec.logit_scale = logit_scale;
  spec.seed = seed;
  return spec;
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

// The smallest bf16 floor any tensor can have: rounding to nearest leaves an error uniform in half a unit in
// the last place, RMS 2^-9/sqrt(3) relative at the bottom of a binade (more higher up). Used where no exact
// result is at hand to measure the floor on.
constexpr double smallest_bf16_floor = 1.953125e-3 / 1.7320508075688772;

// Two fused results (cuda vs cpu, or two schedules) differ by fp32 noise only: GEMMs summing in another order
// move a few bf16 outputs to the neighbouring value. 0.5x the floor would already be half of all the rounding
// error a bf16 output carries, so this separates noise from any algorithmic difference. The floor is the
// exact result's when given (both a and b are bf16 already: their own floor is 0).
void expect_same_to_fp32_noise(const TensorMap& a, const TensorMap& b, const TensorMap* exact = nullptr) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    if (is_gradient_output(name)) {
      const double floor = exact ? bf16_floor(exact->at(name)) : smallest_bf16_floor;
      EXPECT_LE(relative_error(t, b.at(name)), 0.5 * floor) << name;
    } else {
      for (std::int64_t i = 0; i < t.numel(); ++i)
        EXPECT_LE(std::abs(t.value(i) - b.at(name).value(i)), 1e-6 * (1 + std::abs(t.value(i))))
            << name << "[" << i << "]";
    }
  }
}

// One case: the cuda backend against the reference (bar) and the cpu backend (noise), dtypes and shapes.
TensorMap check_case(const CaseSpec& spec, const Options& options) {
  const Problem problem = generate(spec);
  reference::Options ref_options;
  ref_options.gradients = options.gradients;
  const TensorMap exact = reference::compute(problem, ref_options);
  const TensorMap out = cuda::compute(problem, options);
  expect_dtypes(out, problem, options);
  for (const auto& v : bar_violations(out, exact, logits_mean_tolerance(spec.logit_scale))) ADD_FAILURE() << v;
  Options cpu = options;
  cpu.backend = Backend::cpu;
  expect_same_to_fp32_noise(out, compute(problem, cpu), &exact);
  return out;
}

// ---- the bar, on shapes big enough for the Frobenius statistic to be stable ----

const Shape bar_shape{.B = 4, .T = 128, .H = 256, .V = 512};

TEST(CudaBackendAccuracy, RealisticLogitsMeetTheBar) {
  SKIP_WITHOUT_DEVICE();
  check_case(spec_of(bar_shape, 2.0, 11), cuda_options());
}

TEST(CudaBackendAccuracy, LargeLogitsMeetTheBar) {
  SKIP_WITHOUT_DEVICE();
  check_case(spec_of(bar_shape, 30.0, 12), cuda_options());
}

TEST(CudaBackendAccuracy, EveryFeatureAtOnceMeetsTheBar) {
  SKIP_WITHOUT_DEVICE();
  for (double scale : {2.0, 30.0}) {
    SCOPED_TRACE("logit scale " + std::to_string(scale));
    CaseSpec spec = spec_of(bar_shape, scale, 13);
    spec.bias = true;
    spec.ignore = IgnorePattern::random;
    spec.hp.label_smoothing = 0.2;
    spec.hp.grad_scale = 0.37;
    spec.hp.ignore_index = 7;  // inside [0, V): target 7 means "ignored"
    spec.hp.beta = 2.0;
    spec.hp.gamma = -0.3;
    spec.hp.alpha = 0.6;
    Options options = cuda_options();
    options.max_chunk_rows = 3 * 128 + 5;  // three_pass, one pair per chunk
    check_case(spec, options);
  }
}

// A vocabulary in the tens of thousands: many 16-byte steps per row and per-row sums of 50k exponentials.
TEST(CudaBackendAccuracy, LargeVocabularyMeetsTheBar) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of({.B = 2, .T = 64, .H = 128, .V = 50007}, 2.0, 14);
  spec.bias = true;
  check_case(spec, cuda_options());
}

// ---- SPEC features one at a time ----

const Shape feature_shape{.B = 4, .T = 64, .H = 96, .V = 300};

TEST(CudaBackendFeatures, Bias) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of(feature_shape, 2.0, 21);
  spec.bias = true;
  check_case(spec, cuda_options());
}

TEST(CudaBackendFeatures, LabelSmoothing) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of(feature_shape, 2.0, 22);
  spec.hp.label_smoothing = 0.3;
  check_case(spec, cuda_options());
}

TEST(CudaBackendFeatures, NllOffGivesZeroNll) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of(feature_shape, 2.0, 23);
  spec.hp.compute_nll_loss = false;
  const TensorMap out = check_case(spec, cuda_options());
  EXPECT_EQ(out.at(output_name::nll_loss).value(0), 0.0);
}

TEST(CudaBackendFeatures, CustomIgnoreIndex) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of(feature_shape, 2.0, 24);
  spec.hp.ignore_index = 5;
  spec.ignore = IgnorePattern::random;
  check_case(spec, cuda_options());
}

TEST(CudaBackendFeatures, GradScale) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of(feature_shape, 2.0, 25);
  spec.hp.grad_scale = -2.5;
  check_case(spec, cuda_options());
}

TEST(CudaBackendFeatures, AllButOneTokenIgnored) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of(feature_shape, 2.0, 26);
  spec.ignore = IgnorePattern::all_but_one;
  check_case(spec, cuda_options());
}

TEST(CudaBackendFeatures, EmptySequenceTreatedAsZero) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of(feature_shape, 2.0, 27);
  spec.ignore = IgnorePattern::empty_sequence;
  spec.hp.empty_sequence = EmptySequence::zero;
  check_case(spec, cuda_options());
}

TEST(CudaBackendFeatures, ForwardOnlyHasNoGradientsAndTheSameForward) {
  SKIP_WITHOUT_DEVICE();
  const CaseSpec spec = spec_of(feature_shape, 2.0, 29);
  Options forward = cuda_options();
  forward.gradients = false;
  const TensorMap fwd = check_case(spec, forward);
  TensorMap full = cuda::compute(generate(spec), cuda_options());
  for (const char* name : {output_name::grad_x, output_name::grad_weight, output_name::grad_bias}) full.erase(name);
  expect_same_to_fp32_noise(fwd, full);
}

TEST(CudaBackendFeatures, GradWeightF32RoundsToTheBf16Output) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of(feature_shape, 2.0, 30);
  spec.bias = true;
  Options f32 = cuda_options();
  f32.grad_weight_f32 = true;
  const TensorMap wide = check_case(spec, f32);
  const TensorMap narrow = cuda::compute(generate(spec), cuda_options());
  // Both are one fp32 accumulator rounded once (on the device vs here): equal bitwise up to the run-to-run
  // order of the fp32 atomics of the target term, which may move a value across a rounding boundary.
  for (const char* name : {output_name::grad_weight, output_name::grad_bias}) {
    const auto a = wide.at(name).as<float>();
    const auto b = narrow.at(name).as<bf16>();
    ASSERT_EQ(a.size(), b.size());
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < a.size(); ++i) mismatches += bf16(a[i]) != b[i];
    EXPECT_LE(mismatches, a.size() / 1000) << name;
  }
}

TEST(CudaBackendFeatures, OddSizesBothSchedules) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of({.B = 6, .T = 37, .H = 31, .V = 123}, 2.0, 31);
  spec.bias = true;
  spec.hp.label_smoothing = 0.1;
  for (std::int64_t rows : {0, 1, 50, 73, 74, 75, 111, 149}) {  // 2T = 74: below it two_pass, from it three_pass
    SCOPED_TRACE("max_chunk_rows " + std::to_string(rows));
    Options options = cuda_options();
    options.max_chunk_rows = rows;
    check_case(spec, options);
  }
}

// The logits GEMM cut along k (cuda::Tuning): slices summed in the fp32 epilogue compute the same function.
// Odd H (31 -> 32 padded columns, slices of 8) and H = 96 (slices of 24/32) exercise the slice arithmetic.
TEST(CudaBackendFeatures, LogitsKSlicesMeetTheBar) {
  SKIP_WITHOUT_DEVICE();
  for (Shape shape : {Shape{.B = 4, .T = 16, .H = 31, .V = 123}, feature_shape}) {
    CaseSpec spec = spec_of(shape, 30.0, 33);
    spec.bias = true;
    const Problem problem = generate(spec);
    const TensorMap exact = reference::compute(problem);
    for (int slices : {2, 3, 4}) {
      SCOPED_TRACE(shape.to_string() + ", " + std::to_string(slices) + " slices");
      const TensorMap out = cuda::compute(problem, cuda_options(), cuda::Tuning{.logits_k_splits = slices});
      for (const auto& v : bar_violations(out, exact, logits_mean_tolerance(spec.logit_scale))) ADD_FAILURE() << v;
    }
  }
}

TEST(CudaBackendFeatures, IgnoredRowsOfGradXAreExactlyZero) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of(feature_shape, 2.0, 32);
  spec.ignore = IgnorePattern::random;
  const Problem problem = generate(spec);
  Options options = cuda_options();
  options.max_chunk_rows = 50;
  const auto grad_x = cuda::compute(problem, options).at(output_name::grad_x).as<bf16>();
  std::int64_t ignored = 0;
  for (std::int64_t b = 0; b < problem.shape.B; ++b)
    for (std::int64_t t = 0; t < problem.shape.T; ++t) {
      if (problem.is_completion(b, t)) continue;
      ++ignored;
      for (std::int64_t h = 0; h < problem.shape.H; ++h)
        ASSERT_EQ(static_cast<float>(grad_x[static_cast<std::size_t>((b * problem.shape.T + t) * problem.shape.H + h)]),
                  0.f);
    }
  EXPECT_GT(ignored, 0);
}

// ---- schedules and budgets ----

TEST(CudaBackendSchedules, TwoPassAgreesWithThreePass) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of({.B = 4, .T = 50, .H = 48, .V = 200}, 30.0, 42);
  spec.hp.label_smoothing = 0.25;
  const Problem problem = generate(spec);
  Options three = cuda_options(), two = cuda_options();
  three.max_chunk_rows = 100;  // one pair per chunk
  two.max_chunk_rows = 99;     // one row short of a pair: the fallback
  expect_same_to_fp32_noise(cuda::compute(problem, two), cuda::compute(problem, three));
}

// Budgets from the 64 MiB minimum up, on a shape whose one pair (2T = 512 rows of ~293 KiB) needs ~147 MiB plus
// the GEMM scratch: 64 and 100 MiB run the two_pass fallback, 200 MiB one pair per chunk, 1 GiB one chunk. All must meet the bar, and the
// runner must never allocate past the budget.
TEST(CudaBackendSchedules, WorkspaceBudgetsFromTheMinimumUp) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of({.B = 4, .T = 256, .H = 64, .V = 50000}, 2.0, 44);
  spec.hp.label_smoothing = 0.1;
  const Problem problem = generate(spec);
  const TensorMap exact = reference::compute(problem);
  for (std::int64_t mib : {64, 100, 200, 1024}) {
    SCOPED_TRACE("workspace " + std::to_string(mib) + " MiB");
    Options options = cuda_options();
    options.workspace_bytes = mib << 20;
    const TensorMap out = cuda::compute(problem, options);
    for (const auto& v : bar_violations(out, exact, logits_mean_tolerance(spec.logit_scale))) ADD_FAILURE() << v;
  }
}

TEST(CudaBackendSchedules, WorkspaceStaysInsideTheBudget) {
  SKIP_WITHOUT_DEVICE();
  const Problem problem = generate(spec_of({.B = 4, .T = 256, .H = 64, .V = 50000}, 2.0, 45));
  const std::int64_t N = problem.shape.N(), H = problem.shape.H, V = problem.shape.V, ld_h = cuda::padded(H);
  // Minimal device inputs: zero-padded uploads as cuda::compute makes them.
  cuda::FusedRunner runner;
  cuda::DeviceBuffer x(N * ld_h * 2, "x"), w(V * ld_h * 2, "weight"), target(N * 8, "target");
  ASSERT_EQ(cudaMemset(x.get(), 0, x.bytes()), cudaSuccess);
  ASSERT_EQ(cudaMemset(w.get(), 0, w.bytes()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy2D(x.get(), ld_h * 2, problem.x.data(), H * 2, H * 2, N, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy2D(w.get(), ld_h * 2, problem.weight.data(), H * 2, H * 2, V, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(target.get(), problem.target.data(), N * 8, cudaMemcpyHostToDevice), cudaSuccess);
  cuda::DeviceProblem device;
  device.shape = problem.shape;
  device.hp = problem.hp;
  device.ld_h = ld_h;
  device.x = x.as<__nv_bfloat16>();
  device.weight = w.as<__nv_bfloat16>();
  device.target = target.as<std::int64_t>();
  device.targets = read_targets(problem);
  cuda::DeviceBuffer grad_x(N * H * 2, "grad_x"), grad_w(V * ld_h * 4, "grad_weight");
  cuda::DeviceGradients gradients;
  gradients.grad_x = grad_x.as<__nv_bfloat16>();
  gradients.grad_weight = grad_w.as<float>();
  for (std::int64_t mib : {64, 100, 200, 1024}) {
    for (bool with_gradients : {true, false}) {
      Options options = cuda_options();
      options.workspace_bytes = mib << 20;
      runner.run(device, with_gradients ? &gradients : nullptr, options);
      const auto& report = runner.last_report();
      SCOPED_TRACE(std::to_string(mib) + " MiB: " + report.schedule.to_string());
      EXPECT_LE(report.workspace_bytes, options.workspace_bytes);
      EXPECT_EQ(report.gemm_fallbacks, 0) << "cuBLASLt refused a padded, 16-byte aligned GEMM";
      if (with_gradients) {
        EXPECT_EQ(report.schedule.mode, mib >= 200 ? Mode::three_pass : Mode::two_pass);
      }
    }
  }
}

// ---- errors ----

TEST(CudaBackendErrors, TooSmallABudgetIsAnInputErrorNamingTheBytes) {
  SKIP_WITHOUT_DEVICE();
  const Problem problem = generate(spec_of({.B = 2, .T = 4, .H = 8, .V = 1000}, 2.0, 43));
  Options options = cuda_options();
  options.workspace_bytes = 1000;
  try {
    cuda::compute(problem, options);
    FAIL() << "no error";
  } catch (const InputError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("1000 bytes"), std::string::npos) << message;
    EXPECT_NE(message.find("per row"), std::string::npos) << message;
  }
}

TEST(CudaBackendErrors, OutOfDeviceMemoryIsAnInputErrorNamingTheBytes) {
  SKIP_WITHOUT_DEVICE();
  try {
    cuda::DeviceBuffer huge(std::size_t{1} << 50, "a test buffer");  // 1 PiB
    FAIL() << "a 1 PiB allocation succeeded";
  } catch (const InputError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(std::to_string(std::size_t{1} << 50)), std::string::npos) << message;
    EXPECT_NE(message.find("a test buffer"), std::string::npos) << message;
  }
  // The failed allocation must leave the device usable.
  check_case(spec_of({.B = 2, .T = 8, .H = 16, .V = 40}, 2.0, 46), cuda_options());
}

// Needs no device: the mutant check comes first.
TEST(CudaBackendErrors, MutantsAreRefused) {
  Options options = cuda_options();
  options.mutant = Mutant::preference_sign_flip;
  const Problem problem = generate(spec_of({.B = 2, .T = 4, .H = 8, .V = 16}, 2.0, 47));
  EXPECT_THROW(cuda::compute(problem, options), InputError);
}

TEST(CudaBackendErrors, InvalidProblemsAreInputErrors) {
  SKIP_WITHOUT_DEVICE();
  Problem problem = generate(spec_of({.B = 2, .T = 4, .H = 8, .V = 16}, 2.0, 48));
  problem.target[3] = 16;  // outside [0, V)
  EXPECT_THROW(cuda::compute(problem, cuda_options()), InputError);
}

TEST(CudaBackendDispatch, FusedComputePicksTheCudaBackend) {
  SKIP_WITHOUT_DEVICE();
  EXPECT_EQ(resolve(Backend::automatic), Backend::cuda);
  const Problem problem = generate(spec_of({.B = 2, .T = 8, .H = 16, .V = 40}, 2.0, 49));
  expect_same_to_fp32_noise(compute(problem, cuda_options()), cuda::compute(problem, cuda_options()));
}

}  // namespace
}  // namespace simpo::fused
