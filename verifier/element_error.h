// The comparison's per-element arithmetic and its reductions' partial results, shared by the host loops
// (compare.cpp) and the device kernels (device_compare.cu): one set of formulas, so a candidate judged on the
// device is judged by the same rules as on the host. Compiles as plain C++ and as CUDA (no project types: nvcc never
// sees Eigen).
#pragma once

#include "fused/host_device.h"

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#include <Eigen/Core>
#endif

namespace simpo::verifier::element {

// The candidate's output dtype as far as its floor is concerned: what an exact value is rounded to.
enum class Rounding : int { bf16, f16, f32, none };

// v rounded to the candidate's dtype: to float first, then (bf16, f16) to nearest even, as Eigen's conversions
// (the host) and CUDA's _rn conversions (either side of a CUDA build) both do.
SIMPO_HOST_DEVICE inline double round_to(Rounding r, double v) {
#if defined(__CUDA_ARCH__)
  const float f = __double2float_rn(v);
#else
  const float f = static_cast<float>(v);
#endif
  switch (r) {
#if defined(__CUDACC__)
    case Rounding::bf16: return static_cast<double>(__bfloat162float(__float2bfloat16_rn(f)));
    case Rounding::f16: return static_cast<double>(__half2float(__float2half_rn(f)));
#else
    case Rounding::bf16: return static_cast<double>(static_cast<float>(Eigen::bfloat16(f)));
    case Rounding::f16: return static_cast<double>(static_cast<float>(Eigen::half(f)));
#endif
    case Rounding::f32: return static_cast<double>(f);
    case Rounding::none: return v;
  }
  return v;
}

// std::isfinite without <cmath>'s overload set, which device code does not have: v - v is 0 exactly when v is finite.
SIMPO_HOST_DEVICE inline bool finite(double v) { return v - v == 0; }

// The elementwise tolerance atol + rtol |exact|, never contracted to a fused multiply-add (the device compiler
// would contract it, the host's portable build cannot): the same bits on both sides.
SIMPO_HOST_DEVICE inline double allowed(double atol, double rtol, double exact) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(atol, __dmul_rn(rtol, fabs(exact)));
#else
  return atol + rtol * fabs(exact);
#endif
}

// |err| against what is allowed: < 1 passes; an error where nothing is allowed is infinitely far.
SIMPO_HOST_DEVICE inline double ratio(double err, double allowed_error) {
  return allowed_error > 0 ? err / allowed_error : (err > 0 ? INFINITY : 0.0);
}

// Pass 1 of one tensor: norms, floor, the largest error and where, non-finite candidates (NaN/Inf where the
// reference is finite, left out of the sums). Partial results over disjoint index ranges merge in any order to
// the same maxima and indices (ties: the lowest index); only the sums' rounding depends on the order.
struct ElementSums {
  double exact_sq = 0, err_sq = 0, floor_sq = 0, max_abs = 0;
  std::int64_t worst = -1, non_finite = 0, first_non_finite = -1;

  SIMPO_HOST_DEVICE void add(std::int64_t i, double e, double c, Rounding r) {
    if (!finite(c) && finite(e)) {
      if (non_finite++ == 0 || i < first_non_finite) first_non_finite = i;
      return;
    }
    const double err = fabs(c - e);
    const double fl = round_to(r, e) - e;
    exact_sq += e * e;
    err_sq += err * err;
    floor_sq += fl * fl;
    take_max(err, i);
  }
  SIMPO_HOST_DEVICE void merge(const ElementSums& o) {
    exact_sq += o.exact_sq;
    err_sq += o.err_sq;
    floor_sq += o.floor_sq;
    if (o.worst >= 0) take_max(o.max_abs, o.worst);
    if (o.non_finite > 0 && (non_finite == 0 || o.first_non_finite < first_non_finite)) first_non_finite = o.first_non_finite;
    non_finite += o.non_finite;
  }

 private:
  SIMPO_HOST_DEVICE void take_max(double err, std::int64_t i) {
    if (worst < 0 || err > max_abs || (err == max_abs && i < worst)) {
      max_abs = err;
      worst = i;
    }
  }
};

// Pass 2: elements beyond atol + rtol |exact|, and the largest ratio (a count and a maximum: order-free).
struct BeyondCount {
  std::int64_t beyond = 0;
  double worst_ratio = 0;

  SIMPO_HOST_DEVICE void add(double e, double c, double atol, double rtol) {
    const double a = allowed(atol, rtol, e);
    const double err = fabs(c - e);
    if (err > a) ++beyond;
    const double q = ratio(err, a);
    worst_ratio = q > worst_ratio ? q : worst_ratio;
  }
  SIMPO_HOST_DEVICE void merge(const BeyondCount& o) {
    beyond += o.beyond;
    worst_ratio = o.worst_ratio > worst_ratio ? o.worst_ratio : worst_ratio;
  }
};

// One row's sums (grad_x's per-row check): err^2, floor^2 and exact^2.
struct RowSums {
  double err_sq = 0, floor_sq = 0, exact_sq = 0;

  SIMPO_HOST_DEVICE void add(double e, double c, Rounding r) {
    const double fl = round_to(r, e) - e;
    err_sq += (c - e) * (c - e);
    floor_sq += fl * fl;
    exact_sq += e * e;
  }
  SIMPO_HOST_DEVICE void merge(const RowSums& o) {
    err_sq += o.err_sq;
    floor_sq += o.floor_sq;
    exact_sq += o.exact_sq;
  }
};

}  // namespace simpo::verifier::element
