// How the fused tests and the accuracy table measure a fused output against the float64 reference:
// relative Frobenius error, and the "bf16 floor" (the error of the exact result merely rounded to bf16, which
// no bf16 output can beat). The accuracy bar of the issue is stated in these terms.
#pragma once

#include "problem/tensor.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace simpo::fused::testing {

// ||candidate - exact|| / ||exact|| (Frobenius), both read as double; infinity on a NaN/Inf in the candidate.
// An exact tensor of all zeros gives the absolute norm of the candidate instead (0 when both are zero).
inline double relative_error(const Tensor& candidate, const Tensor& exact) {
  if (candidate.numel() != exact.numel())
    throw std::logic_error("relative_error: " + shape_string(candidate.shape) + " vs " + shape_string(exact.shape));
  double diff = 0, norm = 0;
  for (std::int64_t i = 0; i < exact.numel(); ++i) {
    const double c = candidate.value(i), e = exact.value(i);
    if (!std::isfinite(c)) return INFINITY;
    diff += (c - e) * (c - e);
    norm += e * e;
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// The floor of `dtype` (BF16, F16 or F32): relative_error(dtype(exact), exact).
inline double rounding_floor(const Tensor& exact, DType dtype) {
  auto round = [dtype](double e) {
    const float f = static_cast<float>(e);
    return dtype == DType::BF16  ? static_cast<double>(static_cast<float>(bf16(f)))
           : dtype == DType::F16 ? static_cast<double>(static_cast<float>(f16(f)))
                                 : static_cast<double>(f);
  };
  double diff = 0, norm = 0;
  for (std::int64_t i = 0; i < exact.numel(); ++i) {
    const double e = exact.value(i);
    const double rounded = round(e);
    diff += (rounded - e) * (rounded - e);
    norm += e * e;
  }
  return norm > 0 ? std::sqrt(diff / norm) : 0.0;
}

// The bf16 floor: relative_error(bf16(exact), exact).
inline double bf16_floor(const Tensor& exact) { return rounding_floor(exact, DType::BF16); }

// The bar: every gradient within 1.5x the bf16 floor; the rest of the checks are in the tests.
inline constexpr double gradient_floor_ratio_bar = 1.5;
// f16 inputs: the same 1.5x of the f16 floor (the cpu backend keeps dz in fp32, so the output rounding is nearly
// all the error: measured 1.00x). f32 inputs: no fp32-logit implementation reaches the f32 floor, because each
// fp32 logit itself rounds by up to u32 |z|, and the row's lse likewise, moving dz = -k exp(z - lse) by as much
// relative. The softmax mass sits at the row's largest logits, about s sqrt(2 ln V) for logits of standard
// deviation s over V columns, so the gradients carry up to ~ 2 u32 s sqrt(2 ln V). Measured (the suite, V = 512;
// fused_accuracy_table --dtype f32, V = 8000): 0.1-0.4 of that, i.e. 4-11x the f32 floor at s = 2 and 110-230x at
// s = 30. The f32 bar: 1.5x the floor + 2 u32 s sqrt(2 ln V). (The verifier's strict bound, which f32 results
// must also meet, is derived from the inputs, not from s: cpu_backend_test.cpp.)
inline double gradient_bar(DType input_dtype, double floor, double logit_scale, std::int64_t V) {
  const double logit_noise =
      input_dtype == DType::F32 ? 2 * 0x1.0p-24 * logit_scale * std::sqrt(2 * std::log(static_cast<double>(V))) : 0.0;
  return gradient_floor_ratio_bar * floor + logit_noise;
}
// loss, nll_loss and the logps within 5e-7 relative: fp32 row statistics (lse of a row of V fp32 logits is
// good to a few fp32 ulps, ~1e-7 relative) averaged over many tokens, then reduced in double.
inline constexpr double scalar_relative_bar = 5e-7;

}  // namespace simpo::fused::testing

#include "problem/problem.h"

#include <vector>

namespace simpo::fused::testing {

// Every way `fused` misses the bar against `reference` (empty: it meets it). logits_mean_tolerance is the
// absolute tolerance of the two *_logits_mean outputs (a mean near zero has no useful relative error). The
// gradients' floor is that of the inputs' dtype (what the GEMM operands carry; an F32 grad_weight of bf16 inputs
// is held to the bf16 floor too).
inline std::vector<std::string> bar_violations(const TensorMap& fused, const TensorMap& reference,
                                               double logits_mean_tolerance, DType input_dtype = DType::BF16,
                                               double logit_scale = 0) {
  std::vector<std::string> out;
  for (const auto& [name, exact] : reference) {
    const auto it = fused.find(name);
    if (it == fused.end()) {
      out.push_back(name + ": missing");
      continue;
    }
    const Tensor& candidate = it->second;
    if (candidate.shape != exact.shape) {
      out.push_back(name + ": shape " + shape_string(candidate.shape) + ", expected " + shape_string(exact.shape));
      continue;
    }
    if (is_gradient_output(name)) {
      const double error = relative_error(candidate, exact), floor = rounding_floor(exact, input_dtype);
      const auto gw = reference.find(output_name::grad_weight);
      const std::int64_t V = gw == reference.end() ? 1 : gw->second.shape[0];
      const double bar = gradient_bar(input_dtype, floor, logit_scale, V);
      if (!(error <= bar))
        out.push_back(name + ": relative error " + std::to_string(error) + " > " + std::to_string(bar) + " (" +
                      dtype_name(input_dtype) + " floor " + std::to_string(floor) + ")");
      continue;
    }
    const bool is_mean = name == output_name::chosen_logits_mean || name == output_name::rejected_logits_mean;
    for (std::int64_t i = 0; i < exact.numel(); ++i) {
      const double c = candidate.value(i), e = exact.value(i);
      const double error = std::abs(c - e);
      const double allowed = is_mean ? logits_mean_tolerance : scalar_relative_bar * std::abs(e);
      if (!(error <= allowed)) {
        out.push_back(name + "[" + std::to_string(i) + "]: " + std::to_string(c) + " vs exact " + std::to_string(e) +
                      " (error " + std::to_string(error) + " > " + std::to_string(allowed) + ")");
        break;
      }
    }
  }
  return out;
}

}  // namespace simpo::fused::testing
