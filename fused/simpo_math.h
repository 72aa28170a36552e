// The per-token, per-sequence and per-pair math of SimPO (../shared/SPEC.md "The function"), written once for
// both fused backends: every function here is usable in CUDA kernels and in plain C++, so the cpu and cuda
// backends round the same way. Templates take float or double; the fused backends use float per token (the
// logits are fp32) and double per sequence and per pair (tiny work, and it keeps the scalars exact to fp32).
//
// Nothing here allocates or loops over a whole row; the row loops live in the backends (a CUDA block or an
// OpenMP loop) and call these on each element.
#pragma once

#include "fused/host_device.h"

#include <math.h>  // the C names (expf, log1p, ...) exist on both host and device; std:: overloads do not

namespace simpo::fused::math {

// ---- overloads that pick the float or double C function (CUDA device code has both sets) ----
SIMPO_HOST_DEVICE inline float exp_(float x) { return expf(x); }
SIMPO_HOST_DEVICE inline double exp_(double x) { return exp(x); }
SIMPO_HOST_DEVICE inline float log_(float x) { return logf(x); }
SIMPO_HOST_DEVICE inline double log_(double x) { return log(x); }
SIMPO_HOST_DEVICE inline float log1p_(float x) { return log1pf(x); }
SIMPO_HOST_DEVICE inline double log1p_(double x) { return log1p(x); }
SIMPO_HOST_DEVICE inline float expm1_(float x) { return expm1f(x); }
SIMPO_HOST_DEVICE inline double expm1_(double x) { return expm1(x); }
SIMPO_HOST_DEVICE inline float fabs_(float x) { return fabsf(x); }
SIMPO_HOST_DEVICE inline double fabs_(double x) { return fabs(x); }

// ---- scalar functions ----

// log sigmoid(x) = min(x, 0) - log1p(exp(-|x|)): never exponentiates a positive number, so no overflow, and
// log1p keeps the tiny values of large positive x (where log(1 + e^-x) ~ e^-x) exact.
template <class T> SIMPO_HOST_DEVICE inline T log_sigmoid(T x) {
  const T negative_part = x < T(0) ? x : T(0);
  return negative_part - log1p_(exp_(-fabs_(x)));
}

// sigmoid(x), with the exponent always <= 0 so neither branch overflows.
template <class T> SIMPO_HOST_DEVICE inline T sigmoid(T x) {
  if (x >= T(0)) return T(1) / (T(1) + exp_(-x));
  const T e = exp_(x);
  return e / (T(1) + e);
}

// ---- row log-sum-exp, online ----
// One row's running max and sum of exp(z - max). Kernels fold elements in any order with `add`, combine
// partial states (threads, warps, chunks of V) with `merge`, and read lse(). Starting from max = -inf keeps
// the first element's rescale factor exp(-inf) = 0 harmless.
template <class T> struct LogSumExp {
  T max;
  T sum;
};
template <class T> SIMPO_HOST_DEVICE inline LogSumExp<T> lse_empty() { return {-INFINITY, T(0)}; }
template <class T> SIMPO_HOST_DEVICE inline LogSumExp<T> lse_add(LogSumExp<T> s, T z) {
  if (z > s.max) {
    s.sum = s.sum * exp_(s.max - z) + T(1);
    s.max = z;
  } else {
    s.sum += exp_(z - s.max);
  }
  return s;
}
template <class T> SIMPO_HOST_DEVICE inline LogSumExp<T> lse_merge(LogSumExp<T> a, LogSumExp<T> b) {
  if (b.max == -INFINITY) return a;
  if (a.max == -INFINITY) return b;
  if (a.max >= b.max) return {a.max, a.sum + b.sum * exp_(b.max - a.max)};
  return {b.max, b.sum + a.sum * exp_(a.max - b.max)};
}
template <class T> SIMPO_HOST_DEVICE inline T lse_value(LogSumExp<T> s) { return s.max + log_(s.sum); }

// ---- per pair ----
// One pair's preference term and its derivative, before the 1/P mean:
//   s     = beta (c - r) - gamma
//   term  = -(1 - ls) log sigmoid(s) - ls log sigmoid(-s)
//   dterm = d term / d s = -(1 - ls) sigmoid(-s) + ls sigmoid(s)
// SPEC's g_i is dterm / P; dL/dc = beta g_i and dL/dr = -beta g_i.
template <class T> struct PairTerm {
  T s;
  T term;
  T dterm;
};
template <class T>
SIMPO_HOST_DEVICE inline PairTerm<T> pair_term(T chosen_avg, T rejected_avg, T beta, T gamma, T label_smoothing) {
  PairTerm<T> p;
  p.s = beta * (chosen_avg - rejected_avg) - gamma;
  p.term = -(T(1) - label_smoothing) * log_sigmoid(p.s) - label_smoothing * log_sigmoid(-p.s);
  p.dterm = -(T(1) - label_smoothing) * sigmoid(-p.s) + label_smoothing * sigmoid(p.s);
  return p;
}

// ---- per sequence ----
// avg[b] = sum_t m l / n[b]. A sequence with no completion token (n = 0, only reachable with
// empty_sequence = zero) averages to 0 instead of 0/0.
template <class T> SIMPO_HOST_DEVICE inline T sequence_average(T logprob_sum, long long completion_tokens) {
  return completion_tokens > 0 ? logprob_sum / T(completion_tokens) : T(0);
}

// dL/davg[b] from the pair's dterm: +beta g for the chosen sequence, -beta g for the rejected one.
template <class T> SIMPO_HOST_DEVICE inline T avg_gradient(T dterm, T beta, long long pairs, bool chosen) {
  const T g = dterm / T(pairs);
  return chosen ? beta * g : -beta * g;
}

// ---- per row ----
// k[r] = grad_scale * m * (dL/davg[b] / n[b] - [b < P] alpha / N_c): the whole upstream factor of row r's
// logit gradient dz[r, v] = k[r] ([v == target] - softmax_v). nll_weight is alpha / N_c when the NLL term is
// on (0 when compute_nll_loss is false or the row is rejected); empty sequences get k = 0.
template <class T>
SIMPO_HOST_DEVICE inline T row_coefficient(T grad_scale, bool completion, T avg_grad, long long completion_tokens,
                                           T nll_weight) {
  if (!completion || completion_tokens <= 0) return T(0);
  return grad_scale * (avg_grad / T(completion_tokens) - nll_weight);
}

// dz off the target column: -k * softmax_v = -k * exp(z_v - lse). For bf16 inputs the caller rounds it to bf16
// for the GEMMs (f16 and f32 inputs: the cpu backend keeps it fp32) and writes 0 in the target column (whose value comes from target_coefficient, below).
template <class T> SIMPO_HOST_DEVICE inline T softmax_gradient(T k, T z, T lse) { return -k * exp_(z - lse); }

// dz in the target column: c = k (1 - p_target) = k * (-expm1(z_target - lse)). Computing 1 - p with expm1
// keeps it exact when p is near 1 (large logits), where 1 - bf16(p) or even 1 - fp32(p) loses every digit;
// the backends apply c outside the GEMMs in fp32 so it is never rounded to bf16 either.
template <class T> SIMPO_HOST_DEVICE inline T target_coefficient(T k, T z_target, T lse) {
  return k * -expm1_(z_target - lse);
}

// ---- logit distances: what dz needs of a logit, in 16 bits ----
// A logit z (bias included) kept as q = min(round((m - z) 2^11), 65535), its distance below m, the max of its row
// over a tile of columns, in steps of 2^-11 (Options::logit_distances; the cuda backend's logits GEMM writes them
// from its epilogue, fused/cuda/promoted_stats.h). z is read back as m - q 2^-11, off by <= 2^-12: each softmax
// value exp(z - lse) then moves by <= 2^-12 relative, an eighth of the bf16 rounding dz gets anyway (2^-9).
// Distances past 32 saturate, where exp(z - lse) < e^-32: all V of them (V < 2^24) sum to < 2e-7 of the row's,
// under the fp32 noise of the softmax sum itself.
inline constexpr float logit_distance_scale = 2048.0f;        // steps per unit of z (a power of two: q / scale is exact)
inline constexpr float logit_distance_saturated = 65535.0f;   // the largest uint16
inline constexpr int logit_distance_tile = 192;               // columns per tile max (the cuda logits GEMM's tile)
SIMPO_HOST_DEVICE inline float logit_distance(float tile_max, float z) {
  return fminf(rintf((tile_max - z) * logit_distance_scale), logit_distance_saturated);
}
// z - shift from a distance, with above = the tile's max - shift (the backends use shift = the row's max).
SIMPO_HOST_DEVICE inline float logit_from_distance(float above, float q) {
  return above - q * (1.0f / logit_distance_scale);
}

}  // namespace simpo::fused::math
