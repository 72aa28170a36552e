// The cuda backend's own tests, beside the suite both backends pass (fused/tests/backend_suite.cpp, built into
// this executable as the CudaBackend* tests): the logits GEMM's forms (cuBLAS slices, the promoted GEMM's
// variants), workspace budgets from the 64 MiB minimum up with the runner's own report, device errors and the
// dispatch. Needs a CUDA device: without one every test that runs the backend skips with a message saying so.
#include "fused/cuda/cuda_backend.h"
#include "fused/cuda/device_fused.h"
#include "fused/cuda/promoted_gemm.h"
#include "fused/cuda/promoted_stats.h"
#include "fused/fused.h"
#include "fused/schedule.h"
#include "fused/tests/backend_suite.h"
#include "problem/generate.h"
#include "reference/reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <thread>
#include <vector>

namespace simpo::fused {
namespace {

using namespace suite;

#define SKIP_WITHOUT_DEVICE()                                                                             \
  do {                                                                                                     \
    if (!cuda::device_present())                                                                           \
      GTEST_SKIP() << "no CUDA device on this machine: the cuda backend tests run on a GPU machine (ctest -L gpu)"; \
  } while (0)

Options cuda_options() { return options_for(Backend::cuda); }

const Shape feature_shape{.B = 4, .T = 64, .H = 96, .V = 300};

// ---- the logits GEMM ----

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
      cuda::Tuning tuning;
      tuning.logits_k_splits = slices;
      const TensorMap out = cuda::compute(problem, cuda_options(), tuning);
      expect_meets_bar(out, exact, spec.logit_scale);
    }
  }
}

// The promoted logits GEMM (promoted_gemm.h; the default on sm_90 when built with CUTLASS): every compiled
// variant, promoting every 64 or 256 k or never, computes the same function, at odd sizes (rows and V not
// multiples of a tile, V % 4 != 0 for the cuBLAS tail, H = 31 padded to 32 < one k tile) as well.
TEST(CudaBackendFeatures, PromotedLogitsGemmMeetsTheBar) {
  SKIP_WITHOUT_DEVICE();
  if (!cuda::promoted_logits_available())
    GTEST_SKIP() << "the promoted logits GEMM needs a build with CUTLASS and a device of compute capability 9.0";
  EXPECT_EQ(cuda::tuning_for(4096, Options{}).logits, cuda::Tuning::Logits::promoted) << "the default on sm_90";
  for (Shape shape : {Shape{.B = 4, .T = 16, .H = 31, .V = 123}, feature_shape, Shape{.B = 2, .T = 70, .H = 520, .V = 1001}}) {
    CaseSpec spec = spec_of(shape, 30.0, 34);
    spec.bias = true;
    const Problem problem = generate(spec);
    const TensorMap exact = reference::compute(problem);
    for (int variant = 0; variant < cuda::promoted_variant_count(); ++variant)
      for (std::int64_t promotion_k : {64, 256, 0}) {
        SCOPED_TRACE(shape.to_string() + ", " + cuda::promoted_variant_name(variant) + ", promotion_k " +
                     std::to_string(promotion_k));
        cuda::Tuning tuning;
        tuning.logits = cuda::Tuning::Logits::promoted;
        tuning.promotion_k = promotion_k;
        tuning.promoted.variant = variant;
        tuning.epilogue_stats = false;  // the variant computes the logits; the statistics: row_stats_kernel
        const TensorMap out = cuda::compute(problem, cuda_options(), tuning);
        expect_meets_bar(out, exact, spec.logit_scale);
      }
  }
}

// The row statistics from the promoted GEMM's epilogue (promoted_stats.h; Tuning::epilogue_stats): the
// same function as row_stats_kernel over stored logits, in every schedule (three_pass stores the logits too;
// two_pass's first pass and forward_only store none), with a bias, random ignored rows and a custom
// ignore_index, at V not a multiple of the 192-wide tile (196: a last tile of 4 columns) or a multiple (384),
// rows not a multiple of the 128-row tile; against the previous path (row_stats_kernel, gradient GEMMs per part).
TEST(CudaBackendFeatures, EpilogueStatisticsMeetTheBarInEverySchedule) {
  SKIP_WITHOUT_DEVICE();
  if (!cuda::promoted_stats_available())
    GTEST_SKIP() << "the epilogue statistics need the promoted GEMM (CUTLASS build, compute capability 9.0)";
  for (Shape shape : {Shape{.B = 4, .T = 50, .H = 136, .V = 196}, Shape{.B = 2, .T = 300, .H = 64, .V = 384}}) {
    CaseSpec spec = spec_of(shape, 30.0, 35);
    spec.bias = true;
    spec.ignore = IgnorePattern::random;
    spec.hp.ignore_index = 7;  // inside [0, V): an ignored row must not gather column 7
    const Problem problem = generate(spec);
    const TensorMap exact = reference::compute(problem);
    reference::Options forward_ref;
    forward_ref.gradients = false;
    const TensorMap exact_forward = reference::compute(problem, forward_ref);
    for (const std::int64_t chunk_rows : {std::int64_t{0}, shape.T - 1}) {  // three_pass, two_pass
      for (const bool gradients : {true, false}) {
        SCOPED_TRACE(shape.to_string() + ", max_chunk_rows " + std::to_string(chunk_rows) +
                     (gradients ? ", gradients" : ", forward only"));
        Options options = cuda_options();
        options.max_chunk_rows = chunk_rows;
        options.gradients = gradients;
        cuda::Tuning with = cuda::tuning_for(shape.H, options), without = with;
        ASSERT_EQ(with.logits, cuda::Tuning::Logits::promoted);
        with.epilogue_stats = true;
        without.epilogue_stats = false;  // and the gradient GEMMs a part at a time: the previous path
        without.gradient_gemms_per_chunk = false;
        const TensorMap out = cuda::compute(problem, options, with);
        expect_meets_bar(out, gradients ? exact : exact_forward, spec.logit_scale);
        expect_same_to_fp32_noise(out, cuda::compute(problem, options, without), gradients ? &exact : &exact_forward);
      }
    }
  }
}

// ---- schedules and budgets ----

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
    expect_meets_bar(out, exact, spec.logit_scale);
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

// ---- errors and dispatch ----

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

TEST(CudaBackendDispatch, FusedComputePicksTheCudaBackend) {
  SKIP_WITHOUT_DEVICE();
  EXPECT_EQ(resolve(Backend::automatic), Backend::cuda);
  const Problem problem = generate(spec_of({.B = 2, .T = 8, .H = 16, .V = 40}, 2.0, 49));
  expect_same_to_fp32_noise(compute(problem, cuda_options()), cuda::compute(problem, cuda_options()));
}

// ---- a runner per thread, stream-ordered memory ----

// cuda::compute keeps one runner per thread (stream, cuBLAS handles) and allocates on its stream from a pool
// (device_buffer.h): calls of every size in turn, from several threads at once, must compute what one fresh
// call computes. A free ordered before the work that still reads the buffer, or a GEMM left pointing at an
// old workspace, would show here as outputs far past fp32 noise.
TEST(CudaBackendRunners, ConcurrentCallsOfEverySizeAgreeWithSequentialOnes) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Problem> problems;
  for (Shape shape : {Shape{.B = 2, .T = 8, .H = 16, .V = 40}, feature_shape, Shape{.B = 2, .T = 33, .H = 200, .V = 1001},
                      Shape{.B = 6, .T = 5, .H = 31, .V = 77}}) {
    CaseSpec spec = spec_of(shape, 30.0, 60 + problems.size());
    spec.bias = problems.size() % 2 == 1;
    problems.push_back(generate(spec));
  }
  std::vector<TensorMap> sequential;
  for (const Problem& problem : problems) sequential.push_back(cuda::compute(problem, cuda_options()));

  constexpr int threads = 6, rounds = 3;
  std::vector<std::vector<TensorMap>> concurrent(threads);
  std::vector<std::string> errors(threads);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t)
    workers.emplace_back([&, t] {
      try {
        for (int i = 0; i < rounds * static_cast<int>(problems.size()); ++i)
          concurrent[t].push_back(cuda::compute(problems[(t + i) % problems.size()], cuda_options()));
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  for (std::thread& worker : workers) worker.join();
  for (int t = 0; t < threads; ++t) {
    ASSERT_EQ(errors[t], "") << "thread " << t;
    for (std::size_t i = 0; i < concurrent[t].size(); ++i) {
      SCOPED_TRACE("thread " + std::to_string(t) + ", call " + std::to_string(i));
      expect_same_to_fp32_noise(concurrent[t][i], sequential[(t + i) % problems.size()]);
    }
  }
}

}  // namespace
}  // namespace simpo::fused
