// What the tests of both fused backends share: the case builder, the dtype check, the accuracy bar against the
// float64 reference and the one "same up to fp32 noise" threshold. backend_suite.cpp is the suite itself, built
// once per backend (fused_cpu_tests; cuda_backend_test with SIMPO_SUITE_CUDA=1); the backend-specific tests
// live beside it (cpu_backend_test.cpp, fused/cuda/tests/cuda_backend_test.cpp) and use these helpers too.
#pragma once

#include "fused/fused.h"
#include "fused/tests/accuracy.h"
#include "problem/generate.h"
#include "reference/reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

namespace simpo::fused::suite {

inline Options options_for(Backend backend) {
  Options o;
  o.backend = backend;
  return o;
}

inline CaseSpec spec_of(Shape shape, double logit_scale, std::uint64_t seed) {
  CaseSpec spec;
  spec.shape = shape;
  spec.logit_scale = logit_scale;
  spec.seed = seed;
  return spec;
}

// *_logits_mean tolerance: each fp32 logit carries an error of order sqrt(H) 2^-24 |x| |w| ~ 1e-7 logit_scale,
// and the mean over P*T*V of them averages it further; 1e-6 * scale leaves 10x for the correlated part. (The
// reference's mean is exact to double.)
inline double logits_mean_tolerance(double logit_scale) { return 1e-6 * logit_scale; }

inline void expect_meets_bar(const TensorMap& fused, const TensorMap& reference, double logit_scale,
                             DType input_dtype = DType::BF16) {
  for (const auto& v :
       testing::bar_violations(fused, reference, logits_mean_tolerance(logit_scale), input_dtype, logit_scale))
    ADD_FAILURE() << v;
}

// SPEC's output dtypes: scalars F32, grad_x the inputs' dtype, grad_weight/grad_bias the inputs' dtype or F32.
inline void expect_dtypes(const TensorMap& out, const Problem& problem, const Options& options) {
  const DType grad_dtype = options.grad_weight_f32 ? DType::F32 : problem.input_dtype();
  for (const auto& name : all_output_names()) {
    const bool present = out.count(name) > 0;
    const bool wanted =
        !is_gradient_output(name) ||
        (options.gradients && (name == output_name::grad_x ? options.grad_x
                                                           : options.grad_weight &&
                                                                 (name != output_name::grad_bias || problem.has_bias())));
    EXPECT_EQ(present, wanted) << name;
    if (!present) continue;
    const Tensor& t = out.at(name);
    EXPECT_EQ(t.shape, output_shape(problem.shape, name)) << name;
    if (name == output_name::grad_x) EXPECT_EQ(t.dtype, problem.input_dtype());
    else if (is_gradient_output(name)) EXPECT_EQ(t.dtype, grad_dtype) << name;
    else EXPECT_EQ(t.dtype, DType::F32) << name;
  }
}

// The smallest bf16 floor any tensor can have: rounding to nearest leaves an error uniform in half a unit in
// the last place, RMS 2^-9/sqrt(3) relative at the bottom of a binade (more higher up). Used where no exact
// result is at hand to measure the floor on.
inline constexpr double smallest_bf16_floor = 1.953125e-3 / 1.7320508075688772;

// Two fused results (two schedules, or cuda vs cpu) differ by fp32 noise only: sums in another order (other
// chunks, other GEMM kernels) move a few bf16 outputs to the neighbouring value, each flip ~1 bf16 ulp. 0.5x the
// floor (the exact result's, from `exact`, when given) would already be half of all the rounding error a bf16
// output carries, so it still separates noise from any algorithmic difference (a wrong term costs >= 1x). The
// scalars agree to 1e-6 relative (fp32 sums of the same terms in other orders). Compares the outputs `a` has.
inline void expect_same_to_fp32_noise(const TensorMap& a, const TensorMap& b, const TensorMap* exact = nullptr) {
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    if (is_gradient_output(name)) {
      const double floor = exact ? testing::bf16_floor(exact->at(name)) : smallest_bf16_floor;
      EXPECT_LE(testing::relative_error(t, b.at(name)), 0.5 * floor) << name;
    } else {
      for (std::int64_t i = 0; i < t.numel(); ++i)
        EXPECT_LE(std::abs(t.value(i) - b.at(name).value(i)), 1e-6 * (1 + std::abs(t.value(i))))
            << name << "[" << i << "]";
    }
  }
}

// One case: generate, run the reference and the backend, check dtypes and the bar; a cuda result must also
// agree with the cpu backend's (the same algorithm) up to fp32 noise.
inline TensorMap check_case(const CaseSpec& spec, const Options& options) {
  const Problem problem = generate(spec);
  reference::Options ref_options;
  ref_options.gradients = options.gradients;
  const TensorMap exact = reference::compute(problem, ref_options);
  const TensorMap out = compute(problem, options);
  expect_dtypes(out, problem, options);
  expect_meets_bar(out, exact, spec.logit_scale, problem.input_dtype());
  if (options.backend == Backend::cuda) {
    Options cpu = options;
    cpu.backend = Backend::cpu;
    expect_same_to_fp32_noise(out, compute(problem, cpu), &exact);
  }
  return out;
}

}  // namespace simpo::fused::suite
