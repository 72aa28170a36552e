// The error model's bounds: profiles, the problem's scales and the strict tolerances derived from them
// (README "Error model"). compare.cpp measures a candidate against them; report_format.cpp prints the result.
#include "verifier/error_model.h"
#include "verifier/logit_rows.h"
#include "verifier/tensor_reductions.h"

#include <nlohmann/json.hpp>

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace simpo::verifier {

namespace {

constexpr double u32 = 0x1.0p-24;

// Safety factor on the probabilistic (sqrt(K) rule) forward-error estimates of the scalar outputs. Higham's
// rule of thumb says rounding errors of K-term sums grow like sqrt(K) u in practice; the factor covers
// correlated roundings and the Cauchy-Schwarz slack in logit_bound going the other way. README measures the
// margin it leaves.
constexpr double scalar_safety = 4.0;

// Gradients: the candidate's error has four parts (README "Error model"):
//   its own final rounding to the output dtype: the floor, measured on the exact values (floor_abs)
//   GEMM operands in the inputs' dtype (dz, as tensor cores need them): each dz element rounds with relative
//     error of rms u(dtype) / sqrt(3) at most (mantissa 1.0; expected_rounding_error is the typical 0.42 u, but k
//     is the same for every row of a sequence, so with a peaked softmax many dz share one mantissa and one
//     rounding error), moving the gradient by ~ ProblemScales::operand_rounding() * M_op
//   fp32 logit and log-sum-exp noise: each dz moves by |k| e_l:                      e_l * M
//   fp32 accumulation over the reduction length K:                                  sqrt(K) u32 * 2 M
// bound_abs = gradient_safety (1 + small_sample / sqrt(n)) hypot(floor_abs, op M) + scalar_safety e_l M +
// accumulation_safety sqrt(K) u32 2 M. The first two add in quadrature (independent roundings); the
// small-sample factor covers the ~1/sqrt(n) fluctuation of a norm over n elements (a 2-element tensor can have a
// floor near 0 by chance).
constexpr double gradient_safety = 1.5;
// Underflow: a gradient near fp32's smallest normal (2^-126; bf16 has the same exponent range) keeps only the
// few bits subnormals have (k can be ~1e-38 when beta (c - r) saturates the sigmoid). Every element may be
// off by this much in absolute terms.
constexpr double underflow = 0x1.0p-120;
constexpr double small_sample = 3.0;
constexpr double accumulation_safety = 4.0;

std::int64_t reduction_length(const Shape& s, const std::string& name) {
  return name == output_name::grad_x ? s.V : s.N();
}

// ||w_v||, in double from the exact input values.
double weight_row_norm(const Problem& p, std::int64_t v) {
  double sq = 0;
  for (std::int64_t h = 0; h < p.shape.H; ++h) {
    const double w = p.weight.value(static_cast<std::size_t>(v * p.shape.H + h));
    sq += w * w;
  }
  return std::sqrt(sq);
}

}  // namespace

std::string Profile::name() const {
  switch (kind) {
    case ProfileKind::strict: return "strict";
    case ProfileKind::bf16_logits: return "bf16_logits";
    case ProfileKind::peer: return "peer";
    case ProfileKind::user: return "user(rtol=" + sci(rtol) + ", atol=" + sci(atol) + ")";
  }
  return "?";
}

Profile strict_profile() { return {}; }
Profile bf16_logits_profile() { return {ProfileKind::bf16_logits, 0, 0}; }
std::vector<Profile> named_profiles() { return {strict_profile(), bf16_logits_profile(), peer_profile()}; }
bool is_derived(const Profile& p) { return p.kind == ProfileKind::strict || p.kind == ProfileKind::bf16_logits; }
Profile peer_profile() { return {ProfileKind::peer, 5e-3, 5e-3}; }
Profile user_profile(double rtol, double atol) {
  if (!(std::isfinite(rtol) && rtol >= 0 && std::isfinite(atol) && atol >= 0))
    throw InputError("tolerances must be finite and >= 0 (got rtol = " + sci(rtol) + ", atol = " + sci(atol) + ")");
  return {ProfileKind::user, rtol, atol};
}
Profile profile_from_flags(const std::string& name, const double* rtol, const double* atol) {
  if (rtol || atol) {
    for (const auto& [flag, v] : {std::pair{"--rtol", rtol}, std::pair{"--atol", atol}})
      if (v && !(std::isfinite(*v) && *v >= 0))
        throw InputError(std::string(flag) + " must be finite and >= 0, got " + sci(*v));
    return user_profile(rtol ? *rtol : 0.0, atol ? *atol : 0.0);
  }
  return profile_from_name(name);
}

Profile profile_from_name(const std::string& name) {
  if (name == "strict") return strict_profile();
  if (name == "bf16_logits") return bf16_logits_profile();
  if (name == "peer") return peer_profile();
  throw InputError("unknown profile \"" + name + "\" (strict, bf16_logits or peer; --rtol/--atol give user tolerances)");
}

double unit_roundoff(DType d) {
  switch (d) {
    case DType::BF16: return 0x1.0p-8;
    case DType::F16: return 0x1.0p-11;
    case DType::F32: return 0x1.0p-24;
    case DType::F64: return 0x1.0p-53;
    case DType::I64: return 0;
  }
  return 0;
}

// Round-to-nearest error of x = m 2^e is uniform in [-u 2^e, u 2^e], relative to x: variance (u/m)^2 / 3; for
// m log-uniform on [1, 2), E[1/m^2] = 3 / (8 ln 2). So rms = u sqrt(1 / (8 ln 2)).
double expected_rounding_error(DType d) { return unit_roundoff(d) * std::sqrt(1.0 / (8.0 * std::log(2.0))); }

namespace {

// Upper bounds on q[r] = ||p_off[r]|| = sqrt(sum_{v != target} p_v^2), the norm of row r's softmax off the
// target column (1 for ignored rows, which have k = 0 anyway): fp32 logits in row chunks of <= 64 MiB, lse and
// p in double from them, widened by 2 e_l (the fp32 logits' derived error) so the bound holds; capped at 1.
struct OffTarget {
  std::vector<double> q;          // ||p_off[r]||, widened
  std::vector<char> saturated;    // some off-target p_v >= 1/2: see ProblemScales::of
};
// q widened by the fp32 logits' derived error (the bound the fp32 recomputation below needs; kept for the exact
// source too, so a bound does not depend on where q came from).
double widened(double off_norm, double logprob_error) {
  return std::min(1.0, off_norm * (1 + 2 * logprob_error) + 2 * logprob_error);
}

// From the reference's exact softmax: O(N).
OffTarget off_target_mass(const Problem& p, const reference::OffTargetSoftmax& exact, double logprob_error) {
  const auto n = static_cast<std::size_t>(p.shape.N());
  if (exact.norm.size() != n || exact.max.size() != n)
    throw std::logic_error("ProblemScales::of: the off-target softmax has " + std::to_string(exact.norm.size()) + " rows, the problem " +
                           std::to_string(n));
  OffTarget out;
  out.q.assign(n, 1.0);
  out.saturated.assign(n, 0);
  for (std::size_t r = 0; r < n; ++r) {
    out.q[r] = widened(exact.norm[r], logprob_error);
    out.saturated[r] = exact.max[r] >= 0.5;
  }
  return out;
}

OffTarget off_target_mass(const Problem& p, double logprob_error) {
  const Shape& s = p.shape;
  OffTarget out;
  out.q.assign(static_cast<std::size_t>(s.N()), 1.0);
  out.saturated.assign(static_cast<std::size_t>(s.N()), 0);
  auto& q = out.q;
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Matrix w(s.V, s.H);
  p.weight.visit([&](const auto& values) {
    for (std::int64_t i = 0; i < s.V * s.H; ++i) w.data()[i] = static_cast<float>(values[static_cast<std::size_t>(i)]);
  });
  const std::int64_t rows = std::max<std::int64_t>(1, std::min<std::int64_t>(s.N(), (std::int64_t{64} << 20) / (4 * s.V)));
  for (std::int64_t r0 = 0; r0 < s.N(); r0 += rows) {
    const std::int64_t m = std::min(rows, s.N() - r0);
    Matrix x(m, s.H);
    p.x.visit([&](const auto& values) {
      for (std::int64_t i = 0; i < m * s.H; ++i) x.data()[i] = static_cast<float>(values[static_cast<std::size_t>(r0 * s.H + i)]);
    });
    Matrix z = x * w.transpose();
    for (std::int64_t i = 0; i < m; ++i) {
      const std::int64_t r = r0 + i;
      const std::int64_t target = p.target[static_cast<std::size_t>(r)];
      if (target == p.hp.ignore_index || target < 0 || target >= s.V) continue;
      double zmax = -INFINITY;
      std::vector<double> row(static_cast<std::size_t>(s.V));
      for (std::int64_t v = 0; v < s.V; ++v) {
        row[static_cast<std::size_t>(v)] = z(i, v) + (p.bias ? p.bias->value(static_cast<std::size_t>(v)) : 0.0);
        zmax = std::max(zmax, row[static_cast<std::size_t>(v)]);
      }
      double sum = 0;
      for (double zv : row) sum += std::exp(zv - zmax);
      const double lse = zmax + std::log(sum);
      double off_sq = 0, off_max = 0;  // sum and max over v != target of p_v^2
      for (std::int64_t v = 0; v < s.V; ++v)
        if (v != target) {
          const double p2 = std::exp(2 * (row[static_cast<std::size_t>(v)] - lse));
          off_sq += p2;
          off_max = std::max(off_max, p2);
        }
      out.saturated[static_cast<std::size_t>(r)] = std::sqrt(off_max) >= 0.5;
      q[static_cast<std::size_t>(r)] = widened(std::sqrt(off_sq), logprob_error);
    }
  }
  return out;
}

}  // namespace

ProblemScales ProblemScales::of(const Problem& p, const TensorMap* exact, const reference::OffTargetSoftmax* off_target) {
  return exact ? of_forward(p, *exact, exact->count(output_name::grad_x) > 0, off_target) : of_forward(p, {}, false, nullptr);
}

ProblemScales ProblemScales::of_forward(const Problem& p, const TensorMap& forward, bool gradients,
                                        const reference::OffTargetSoftmax* off_target) {
  const TensorMap* exact = &forward;
  ProblemScales s;
  s.shape = p.shape;
  s.hp = p.hp;
  s.input_dtype = p.input_dtype();
  const Shape& sh = p.shape;
  const std::int64_t H = sh.H;
  // Row norms of an [rows, H] input, whatever its dtype (one visit, not one per element).
  auto row_norms = [H](const InputValues& input, std::int64_t rows) {
    std::vector<double> norms(static_cast<std::size_t>(rows));
    input.visit([&](const auto& m) {
#pragma omp parallel for schedule(static)
      for (std::int64_t r = 0; r < rows; ++r) {
        double sq = 0;
        for (std::int64_t h = 0; h < H; ++h) {
          const double v = static_cast<float>(m[static_cast<std::size_t>(r * H + h)]);
          sq += v * v;
        }
        norms[static_cast<std::size_t>(r)] = std::sqrt(sq);
      }
    });
    return norms;
  };
  double max_bias = 0;  // maxima of per-row sums: the same on any number of threads
  const std::vector<double> x_norm = row_norms(p.x, sh.N());
  const double max_x = x_norm.empty() ? 0.0 : *std::max_element(x_norm.begin(), x_norm.end());
  const std::vector<double> w_norm = row_norms(p.weight, sh.V);
  const double max_w = w_norm.empty() ? 0.0 : *std::max_element(w_norm.begin(), w_norm.end());
  if (p.bias)
    for (std::size_t v = 0; v < p.bias->size(); ++v) max_bias = std::max(max_bias, std::fabs(p.bias->value(v)));
  s.logit_bound = max_x * max_w + max_bias;

  // The gradient magnitudes cost O(N H V) (off_target_mass): only when there are gradients to judge.
  if (!gradients || !exact->count(output_name::chosen_logps) || !exact->count(output_name::rejected_logps)) return s;
  // k[r] from the exact averages (SPEC "Gradients"): the per-row factor of dz.
  const Tensor& c = exact->at(output_name::chosen_logps);
  const Tensor& rj = exact->at(output_name::rejected_logps);
  const std::int64_t P = sh.P();
  const auto& hp = p.hp;
  std::vector<double> avg_grad(static_cast<std::size_t>(sh.B)), avg_grad_error(static_cast<std::size_t>(sh.B));
  const double e_l = s.logprob_error();
  for (std::int64_t i = 0; i < P && i < c.numel() && i < rj.numel(); ++i) {
    const double si = hp.beta * (c.value(i) - rj.value(i)) - hp.gamma;
    const double sig_pos = 1 / (1 + std::exp(-si)), sig_neg = 1 / (1 + std::exp(si));
    const double g = (-(1 - hp.label_smoothing) * sig_neg + hp.label_smoothing * sig_pos) / static_cast<double>(P);
    avg_grad[static_cast<std::size_t>(i)] = hp.beta * g;
    avg_grad[static_cast<std::size_t>(P + i)] = -hp.beta * g;
    const double g_error = (sig_pos * sig_neg * 2 * hp.beta * e_l +
                            4 * u32 * ((1 - hp.label_smoothing) * sig_neg + hp.label_smoothing * sig_pos)) /
                           static_cast<double>(P);
    avg_grad_error[static_cast<std::size_t>(i)] = avg_grad_error[static_cast<std::size_t>(P + i)] = hp.beta * g_error;
  }
  std::vector<std::int64_t> n(static_cast<std::size_t>(sh.B), 0);
  std::int64_t chosen_tokens = 0;
  for (std::int64_t b = 0; b < sh.B; ++b)
    for (std::int64_t t = 0; t < sh.T; ++t)
      if (p.is_completion(b, t)) ++n[static_cast<std::size_t>(b)], chosen_tokens += b < P;
  const double nll_weight =
      hp.compute_nll_loss && chosen_tokens > 0 ? hp.alpha / static_cast<double>(chosen_tokens) : 0.0;
  const OffTarget off = off_target ? off_target_mass(p, *off_target, s.logprob_error()) : off_target_mass(p, s.logprob_error());
  const std::vector<double>& q = off.q;
  // Rows whose softmax is peaked on one wrong token (p_v >= 1/2) put k p_v, nearly the same number for every
  // such row of a sequence (one k, p_v near 1), into bf16: their rounding errors are nearly one error,
  // repeated. Those rows add coherently (a sum of |terms|) per sequence; everything else in quadrature
  // (independent roundings). Measured: with the cut at p_v >= 1 - 2^-6 instead, 1 in 10,000 sweep cases
  // (H = 1, logit scale 30) still exceeded its bound.
  double coherent_w_sq = 0, coherent_b_sq = 0;
  s.row_k.assign(static_cast<std::size_t>(sh.N()), 0.0);
  s.row_q.assign(static_cast<std::size_t>(sh.N()), 0.0);
  s.row_dk.assign(static_cast<std::size_t>(sh.N()), 0.0);
  double dk_sq = 0, dk_x_sq = 0, dk_b_sq = 0;  // per sequence: sums (one dg), then squares (pairs independent)
  s.max_weight_norm = max_w;
  double k_sq = 0, kx_sq = 0, kq_sq = 0, kqx_sq = 0;
  for (std::int64_t b = 0; b < sh.B; ++b) {
    const std::int64_t nb = n[static_cast<std::size_t>(b)];
    if (nb == 0) continue;
    const double k = hp.grad_scale * (avg_grad[static_cast<std::size_t>(b)] / static_cast<double>(nb) - (b < P ? nll_weight : 0.0));
    const double dk = std::fabs(hp.grad_scale) * avg_grad_error[static_cast<std::size_t>(b)] / static_cast<double>(nb);
    double coherent_w = 0, coherent_b = 0, dk_x_seq = 0, dk_seq = 0;
    for (std::int64_t t = 0; t < sh.T; ++t) {
      if (!p.is_completion(b, t)) continue;
      const std::size_t r = static_cast<std::size_t>(b * sh.T + t);
      const double xn = x_norm[r], kq = k * q[r];
      if (off.saturated[r]) {
        coherent_w += std::fabs(kq) * xn;
        coherent_b += std::fabs(kq);
      }
      s.row_k[r] = std::fabs(k);
      s.row_q[r] = q[r];
      s.row_dk[r] = dk;
      dk_sq += dk * dk;
      dk_x_seq += dk * xn;
      dk_seq += dk;
      k_sq += k * k;
      kx_sq += k * k * xn * xn;
      kq_sq += kq * kq;
      kqx_sq += kq * kq * xn * xn;
    }
    coherent_w_sq += coherent_w * coherent_w;
    dk_x_sq += dk_x_seq * dk_x_seq;
    dk_b_sq += dk_seq * dk_seq;
    coherent_b_sq += coherent_b * coherent_b;
  }
  s.magnitude_grad_x = std::sqrt(k_sq) * max_w;
  s.magnitude_grad_weight = std::sqrt(kx_sq);
  s.magnitude_grad_bias = std::sqrt(k_sq);
  s.operand_grad_x = std::sqrt(kq_sq) * max_w;
  s.operand_grad_weight = std::sqrt(kqx_sq + coherent_w_sq);
  s.operand_grad_bias = std::sqrt(kq_sq + coherent_b_sq);
  s.k_error_grad_x = 2 * std::sqrt(dk_sq) * max_w;
  s.k_error_grad_weight = std::sqrt(2.0) * std::sqrt(dk_x_sq);
  s.k_error_grad_bias = std::sqrt(2.0) * std::sqrt(dk_b_sq);
  return s;
}

double ProblemScales::gradient_magnitude(const std::string& name) const {
  if (name == output_name::grad_x) return magnitude_grad_x;
  if (name == output_name::grad_weight) return magnitude_grad_weight;
  if (name == output_name::grad_bias) return magnitude_grad_bias;
  return 0;
}

double ProblemScales::k_error(const std::string& name) const {
  if (name == output_name::grad_x) return k_error_grad_x;
  if (name == output_name::grad_weight) return k_error_grad_weight;
  if (name == output_name::grad_bias) return k_error_grad_bias;
  return 0;
}

double ProblemScales::operand_magnitude(const std::string& name) const {
  if (name == output_name::grad_x) return operand_grad_x;
  if (name == output_name::grad_weight) return operand_grad_weight;
  if (name == output_name::grad_bias) return operand_grad_bias;
  return 0;
}

// bf16 and f16 products are exact in fp32 (8 + 8 and 11 + 11 significant bits <= 24); f32 products each round
// by u32 relative, |sum_h delta_h x_h w_vh| <= u32 sum_h |x_h w_vh| <= u32 Z (worst case, not sqrt(H): an FMA has
// no product rounding at all, a plain multiply-add does).
double ProblemScales::logit_error() const {
  const double H = static_cast<double>(shape.H);
  return (std::sqrt(H) + (input_dtype == DType::F32 ? 1.0 : 0.0)) * u32 * logit_bound;
}

double ProblemScales::logprob_error() const {
  const double Z = logit_bound;
  const double V = static_cast<double>(shape.V);
  const double e_z = logit_error();
  const double e_lse = e_z + u32 * (2 * std::sqrt(V) + Z + std::log(V));
  return e_z + e_lse;
}

// bf16 and f16 inputs: dz rounded to the inputs' dtype for the tensor cores, rms <= u(dtype) / sqrt(3). f32
// inputs: dz in fp32 (u32 / sqrt(3)) and each product dz w or dz x rounded in fp32 (another u32 / sqrt(3),
// independent): sqrt(2/3) u32.
double ProblemScales::operand_rounding() const {
  if (input_dtype == DType::F32) return std::sqrt(2.0 / 3.0) * u32;
  return unit_roundoff(input_dtype) / std::sqrt(3.0);
}

double gradient_internal_error(const ProblemScales& scales, const std::string& name) {
  const double M = scales.gradient_magnitude(name);
  const double K = static_cast<double>(reduction_length(scales.shape, name));
  return scales.operand_rounding() * scales.operand_magnitude(name) + scalar_safety * scales.logprob_error() * M +
         accumulation_safety * std::sqrt(K) * u32 * 2 * M + scales.k_error(name);
}

// Forward error of the fp32 pipeline, per quantity (README "Error model" has the derivation):
//   each logit: an H-term fp32 dot product of exact bf16/f16 products plus the bias: e_z = sqrt(H) u Z
//   (f32 inputs: + u Z for the products' own rounding, ProblemScales::logit_error)
//   row lse = max + log sum exp(z - max): e_z from the logits it reads, sqrt(V) u from the V-term sum of
//   terms <= 1, u |lse| <= u (Z + ln V) from the final add:                      e_lse = e_z + u (2 sqrt(V) + Z + ln V)
//   token log-prob l = z_t - lse:                                                   e_l   = e_z + e_lse
//   avg (a mean of l), chosen/rejected_logps: e_l; rewards: beta e_l; nll: e_l;
//   loss = alpha nll + mean of pair terms whose slope in s is <= 1 and s moves by <= 2 beta e_l:
//                                                                                   e_loss = (alpha + 2 beta) e_l
//   logits_mean: the mean of fp32 logits (e_z) summed in fp32 (u (sqrt(V) + log2 M) Z for M = P T V terms).
// Each output also carries its own final rounding: rtol = 2 u(candidate dtype).
StrictBounds strict_bounds(const ProblemScales& scales, const std::string& name, DType dtype) {
  const Shape& s = scales.shape;
  const double Z = scales.logit_bound;
  const double V = static_cast<double>(s.V);
  const double e_z = scales.logit_error();
  const double e_l = scales.logprob_error();
  StrictBounds b;
  b.rtol = 2 * unit_roundoff(dtype);
  if (name == output_name::loss) {
    const double alpha = scales.hp.compute_nll_loss ? scales.hp.alpha : 0.0;
    b.atol = scalar_safety * (alpha + 2 * scales.hp.beta) * e_l;
  } else if (name == output_name::nll_loss) {
    b.atol = scalar_safety * e_l;
  } else if (name == output_name::chosen_logps || name == output_name::rejected_logps) {
    b.atol = scalar_safety * e_l;
  } else if (name == output_name::chosen_rewards || name == output_name::rejected_rewards) {
    b.atol = scalar_safety * scales.hp.beta * e_l;
  } else if (name == output_name::chosen_logits_mean || name == output_name::rejected_logits_mean) {
    const double M = static_cast<double>(s.P()) * static_cast<double>(s.T) * V;
    b.atol = scalar_safety * (e_z + u32 * (std::sqrt(V) + std::log2(M)) * Z);
  } else {  // gradients: relative to the tensor's own size, filled in by compare
    b.rtol = unit_roundoff(dtype);
    // The element's own rounding below the smallest normal is absolute, half the subnormal spacing: 2^-25 for
    // f16, whose subnormals start at 6e-5 (gradients are often smaller); bf16's and f32's are below 1e-40.
    b.atol = dtype == DType::F16 ? 0x1.0p-25 : dtype == DType::BF16 ? 0x1.0p-134 : dtype == DType::F32 ? 0x1.0p-150 : 0.0;
    b.frob_bound = 0;
  }
  return b;
}

double round_to(DType dtype, double v) { return element::round_to(rounding_of(dtype), v); }

namespace {
// The bf16_logits profile's gradient terms for tensor `name` (0 under strict): the softmax perturbation (rms, joins
// the roundings in quadrature) and k's error through the perturbed log-probs (a bound, added).
std::pair<double, double> logit_rounding_terms(const ProblemScales& scales, const std::string& name, const Profile& profile) {
  if (profile.kind != ProfileKind::bf16_logits || !scales.logit_rounding) return {0.0, 0.0};
  const auto& lr = *scales.logit_rounding;
  if (name == output_name::grad_x) return {lr.grad_x, lr.k_error_grad_x};
  if (name == output_name::grad_weight) return {lr.grad_weight, lr.k_error_grad_weight};
  if (name == output_name::grad_bias) return {lr.grad_bias, lr.k_error_grad_bias};
  return {0.0, 0.0};
}
}  // namespace

double gradient_frob_bound_abs(const ProblemScales& scales, const std::string& name, double floor_abs, std::int64_t n,
                               const Profile& profile) {
  const double nn = static_cast<double>(std::max<std::int64_t>(n, 1));
  const double M = scales.gradient_magnitude(name);
  const double op = scales.operand_rounding() * scales.operand_magnitude(name);
  const double K = static_cast<double>(reduction_length(scales.shape, name));
  const auto [softmax, k_error] = logit_rounding_terms(scales, name, profile);
  return gradient_safety * (1 + small_sample / std::sqrt(nn)) * std::hypot(std::hypot(floor_abs, op), softmax) +
         scalar_safety * scales.logprob_error() * M + accumulation_safety * std::sqrt(K) * u32 * 2 * M +
         underflow * std::sqrt(nn) + scales.k_error(name) + k_error;
}

double gradient_elementwise_atol(const ProblemScales& scales, const std::string& name, const Profile& profile) {
  const auto [softmax, k_error] = logit_rounding_terms(scales, name, profile);
  return gradient_safety * (gradient_internal_error(scales, name) + softmax + k_error) + underflow;
}

// The row's own final rounding is that of the candidate's values, exact + internal error, not of the exact values
// whose rounding the measured floor is: an internal error of half a spacing can carry an element across a
// rounding boundary, a full spacing from exact where its floor is ~0. Over many elements the two roundings have
// the same size; in a short row (H = 1: one element) the measured floor is no estimate of the candidate's, so the
// row's rounding is at least its expected size, expected_rounding_error(dtype) ||exact row|| (rms; the small-sample
// factor on top covers the worst case of one element, u |x| = 2.35 rms). verifier/README.md has the case that
// showed it.
double grad_x_row_bound(const ProblemScales& scales, std::int64_t row, double row_floor_abs, double row_exact_norm,
                        DType candidate_dtype, const Profile& profile) {
  row_floor_abs = std::max(row_floor_abs, expected_rounding_error(candidate_dtype) * row_exact_norm);
  const double H = static_cast<double>(scales.shape.H);
  const double e_l = scales.logprob_error(), W = scales.max_weight_norm;
  const double row_sample = 1 + small_sample / std::sqrt(H);
  const double acc = accumulation_safety * std::sqrt(static_cast<double>(scales.shape.V)) * u32 * 2;
  const double k = scales.row_k[static_cast<std::size_t>(row)], q = scales.row_q[static_cast<std::size_t>(row)];
  const double dk = scales.row_dk.empty() ? 0.0 : scales.row_dk[static_cast<std::size_t>(row)];
  double softmax = 0, k_error = 0;
  if (profile.kind == ProfileKind::bf16_logits && scales.logit_rounding && !scales.logit_rounding->row_grad_x.empty()) {
    softmax = std::hypot(scales.logit_rounding->row_grad_x[static_cast<std::size_t>(row)],
                         scales.logit_rounding->row_target[static_cast<std::size_t>(row)]);
    k_error = scales.logit_rounding->row_k_error[static_cast<std::size_t>(row)];
  }
  return gradient_safety * row_sample * std::hypot(std::hypot(row_floor_abs, scales.operand_rounding() * k * q * W), softmax) +
         scalar_safety * e_l * k * W + acc * k * W + underflow * std::sqrt(H) + 2 * dk * W + k_error;
}

StrictBounds derived_bounds(const ProblemScales& scales, const std::string& name, DType dtype, const Profile& profile) {
  StrictBounds b = strict_bounds(scales, name, dtype);
  if (profile.kind != ProfileKind::bf16_logits || !scales.logit_rounding) return b;
  const auto& lr = *scales.logit_rounding;
  const double beta = scales.hp.beta;
  const double alpha = scales.hp.compute_nll_loss ? scales.hp.alpha : 0.0;
  if (name == output_name::loss) b.atol += alpha * lr.nll + lr.loss_preference;
  else if (name == output_name::nll_loss) b.atol += lr.nll;
  else if (name == output_name::chosen_logps) b.atol += lr.chosen_logps;
  else if (name == output_name::rejected_logps) b.atol += lr.rejected_logps;
  else if (name == output_name::chosen_rewards) b.atol += beta * lr.chosen_logps;
  else if (name == output_name::rejected_rewards) b.atol += beta * lr.rejected_logps;
  else if (name == output_name::chosen_logits_mean) b.atol += lr.chosen_logits_mean;
  else if (name == output_name::rejected_logits_mean) b.atol += lr.rejected_logits_mean;
  return b;
}

// ---- the bf16_logits profile (README "The bf16_logits profile") ----
//
// The candidate computes fp32 logits z (strict's errors), then rounds each to bf16: z_v (1 + eps_v), |eps_v| <= u
// = 2^-8, variance s_v^2 <= sigma^2 = u^2 / 3, independent across distinct logits. To first order, with p =
// softmax(z) and e_v = eps_v z_v:
//   token log-prob  dl = e_t (1 - p_t) - sum_{v != t} p_v e_v
//                   worst |dl| <= u (|z_t| (1 - p_t) + sum_{v != t} p_v |z_v|),  var <= sigma^2 (z_t^2 (1 - p_t)^2 + sum_{v != t} p_v^2 z_v^2)
//   softmax         dp_v = p_v (e_v - S), S = sum_u p_u e_u = p_v (1 - p_v) e_v - p_v sum_{u != v} p_u e_u
//                   E ||dp||^2 <= sigma^2 B^2,  B^2 = sum_v p_v^2 (z_v^2 (1 - p_v)^2 + sum_{u != v} p_u^2 z_u^2)
//   grad_x row      k W^T dp = k sum_v e_v p_v (w_v - g), g = sum_u p_u w_u: independent terms, so
//                   E ||.||^2 <= sigma^2 k^2 C^2,  C^2 = sum_v p_v^2 z_v^2 ||w_v - g||^2
// Each form keeps the cancellation of a peaked softmax (p_m near 1: dp_m ~ p_m (1 - p_m) e_m, w_m ~ g); bounding
// |dp| by |p z| instead cost 40x at logit scale 30. Beyond first order, |exp(d) - 1| <= |d| expm1(D) / D for |d|
// <= D: each row's terms are scaled by expm1(2 u zmax) / (2 u zmax), zmax = max_v |z_v|. A sequence average of n
// tokens: min(worst, scalar_safety rms), rms = sqrt(sum var) / n, the worst case capping the probabilistic
// estimate where few roundings decide it. grad_weight and grad_bias: rows independent, sigma sqrt(sum_r (k B
// ||x_r||)^2) and sigma sqrt(sum_r (k B)^2). k itself moves: s_i = beta (c_i - r_i) - gamma by beta (e_c + e_r), g
// by sigmoid(s) sigmoid(-s) times that (strict's dk, with the bf16 log-prob error in place of fp32's).
void ProblemScales::add_logit_rounding(const Problem& p, const TensorMap& exact) {
  if (logit_rounding) return;
  LogitRounding lr;
  const Shape& sh = p.shape;
  const double u = 0x1.0p-8, sigma = u / std::sqrt(3.0);
  const bool gradients = row_k.size() == static_cast<std::size_t>(sh.N());
  // The O(N H V) part, each row's terms from the problem's logits (logit_rows.h: on a device where one is present).
  const std::vector<LogitRow> rows = logit_rows(p, gradients);
  double chosen_abs = 0, chosen_sq = 0, rejected_abs = 0, rejected_sq = 0;  // logits means: sum |z|, sum z^2 per half
  for (std::int64_t r = 0; r < sh.N(); ++r) {
    const LogitRow& o = rows[static_cast<std::size_t>(r)];
    (r < sh.P() * sh.T ? chosen_abs : rejected_abs) += o.abs_sum;
    (r < sh.P() * sh.T ? chosen_sq : rejected_sq) += o.sq_sum;
  }
  const double PTV = static_cast<double>(sh.P()) * static_cast<double>(sh.T) * static_cast<double>(sh.V);
  lr.chosen_logits_mean = std::min(u * chosen_abs, scalar_safety * sigma * std::sqrt(chosen_sq)) / PTV;
  lr.rejected_logits_mean = std::min(u * rejected_abs, scalar_safety * sigma * std::sqrt(rejected_sq)) / PTV;

  // Per sequence: the average's error bound; the NLL's over the chosen completion tokens.
  const std::int64_t P = sh.P();
  std::vector<double> e_avg(static_cast<std::size_t>(sh.B), 0.0);
  std::vector<std::int64_t> n(static_cast<std::size_t>(sh.B), 0);
  double nll_worst = 0, nll_var = 0;
  std::int64_t chosen_tokens = 0;
  for (std::int64_t b = 0; b < sh.B; ++b) {
    double worst = 0, var = 0;
    for (std::int64_t t = 0; t < sh.T; ++t) {
      if (!p.is_completion(b, t)) continue;
      const std::size_t r = static_cast<std::size_t>(b * sh.T + t);
      worst += rows[r].worst_l;
      var += rows[r].var_l;
      ++n[static_cast<std::size_t>(b)];
    }
    const std::int64_t nb = n[static_cast<std::size_t>(b)];
    if (nb > 0) e_avg[static_cast<std::size_t>(b)] = std::min(worst, scalar_safety * std::sqrt(var)) / static_cast<double>(nb);
    if (b < P) {
      nll_worst += worst;
      nll_var += var;
      chosen_tokens += nb;
    }
    (b < P ? lr.chosen_logps : lr.rejected_logps) = std::max(b < P ? lr.chosen_logps : lr.rejected_logps, e_avg[static_cast<std::size_t>(b)]);
  }
  if (chosen_tokens > 0) lr.nll = std::min(nll_worst, scalar_safety * std::sqrt(nll_var)) / static_cast<double>(chosen_tokens);
  for (std::int64_t i = 0; i < P; ++i)
    lr.loss_preference += hp.beta * (e_avg[static_cast<std::size_t>(i)] + e_avg[static_cast<std::size_t>(P + i)]) / static_cast<double>(P);

  // Gradients: only with the exact log-probs (k) and gradients to judge.
  if (gradients && exact.count(output_name::chosen_logps) && exact.count(output_name::rejected_logps) && P > 0) {
    const Tensor& c = exact.at(output_name::chosen_logps);
    const Tensor& rj = exact.at(output_name::rejected_logps);
    lr.row_grad_x.assign(static_cast<std::size_t>(sh.N()), 0.0);
    lr.row_k_error.assign(static_cast<std::size_t>(sh.N()), 0.0);
    const double W = max_weight_norm;
    // dz's target entry, k (p_t - 1), rounded with the rest of the row: these implementations put the one-hot term
    // into the logits' gradient before it is cast to the GEMMs' dtype (strict's implementation keeps it in fp32).
    // Rows of one sequence share k, and near a uniform softmax 1 - p_t ~ 1, so their roundings are nearly one
    // error: the rows of a sequence with the same target add into grad_W's and grad_bias's row t as a sum of
    // |terms|; different targets (other rows of the output) and sequences in quadrature; each grad_x row has its own.
    const double op = operand_rounding();
    double tx_sq = 0, tw_sq = 0, tb_sq = 0;
    std::map<std::int64_t, double> target_norm;  // ||w_t|| of the targets seen
    lr.row_target.assign(static_cast<std::size_t>(sh.N()), 0.0);
    double gx_sq = 0, gw_sq = 0, gb_sq = 0, dk_sq = 0, dk_x_sq = 0, dk_b_sq = 0;
    for (std::int64_t b = 0; b < sh.B; ++b) {
      const std::int64_t nb = n[static_cast<std::size_t>(b)];
      if (nb == 0) continue;
      const std::int64_t i = b % P;
      const double si = hp.beta * (c.value(i) - rj.value(i)) - hp.gamma;
      const double sig_pos = 1 / (1 + std::exp(-si)), sig_neg = 1 / (1 + std::exp(si));
      const double ds = hp.beta * (e_avg[static_cast<std::size_t>(i)] + e_avg[static_cast<std::size_t>(P + i)]);
      const double dk = std::fabs(hp.grad_scale) * hp.beta * sig_pos * sig_neg * ds / static_cast<double>(P) / static_cast<double>(nb);
      double dk_x_seq = 0;
      std::map<std::int64_t, std::pair<double, double>> by_target;  // target -> (sum kt |x_r|, sum kt)
      for (std::int64_t t = 0; t < sh.T; ++t) {
        if (!p.is_completion(b, t)) continue;
        const std::size_t r = static_cast<std::size_t>(b * sh.T + t);
        const double kb = row_k[r] * rows[r].b_row, kc = row_k[r] * rows[r].c_row;
        double xn_sq = 0;
        for (std::int64_t h = 0; h < sh.H; ++h) {
          const double xv = static_cast<float>(p.x.value(r * static_cast<std::size_t>(sh.H) + static_cast<std::size_t>(h)));
          xn_sq += xv * xv;
        }
        const std::int64_t target = p.target[r];
        const double kt = op * row_k[r] * rows[r].target_gap;
        auto norm = target_norm.find(target);  // O(H) per distinct target, not per row
        if (norm == target_norm.end()) norm = target_norm.emplace(target, weight_row_norm(p, target)).first;
        lr.row_target[r] = kt * norm->second;
        tx_sq += lr.row_target[r] * lr.row_target[r];
        auto& [tw, tb] = by_target[target];
        tw += kt * std::sqrt(xn_sq);
        tb += kt;
        lr.row_grad_x[r] = sigma * kc;
        lr.row_k_error[r] = 2 * dk * W;
        gx_sq += kc * kc;
        gw_sq += kb * kb * xn_sq;
        gb_sq += kb * kb;
        dk_sq += dk * dk;
        dk_x_seq += dk * std::sqrt(xn_sq);
      }
      dk_x_sq += dk_x_seq * dk_x_seq;
      dk_b_sq += (static_cast<double>(nb) * dk) * (static_cast<double>(nb) * dk);
      for (const auto& [target, sums] : by_target) {
        tw_sq += sums.first * sums.first;
        tb_sq += sums.second * sums.second;
      }
    }
    lr.grad_x = std::hypot(sigma * std::sqrt(gx_sq), std::sqrt(tx_sq));
    lr.grad_weight = std::hypot(sigma * std::sqrt(gw_sq), std::sqrt(tw_sq));
    lr.grad_bias = std::hypot(sigma * std::sqrt(gb_sq), std::sqrt(tb_sq));
    lr.k_error_grad_x = 2 * std::sqrt(dk_sq) * W;
    lr.k_error_grad_weight = std::sqrt(2.0) * std::sqrt(dk_x_sq);
    lr.k_error_grad_bias = std::sqrt(2.0) * std::sqrt(dk_b_sq);
  }
  logit_rounding = std::move(lr);
}

void ProblemScales::prepare_for(const Profile& profile, const Problem& p, const TensorMap& exact) {
  if (profile.kind == ProfileKind::bf16_logits) add_logit_rounding(p, exact);
}

}  // namespace simpo::verifier
