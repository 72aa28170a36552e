// The error model: how far a candidate's outputs may sit from the exact (float64 reference) outputs before the
// verifier calls them wrong. Per output tensor it measures
//   rel_frob   ||candidate - exact|| / ||exact||                 (Frobenius norms)
//   max_abs    max |candidate - exact|, and the multi-index where it happens
//   floor      ||round(exact, candidate dtype) - exact|| / ||exact||: no output of that dtype can do better
//   ratio      rel_frob / floor
//   beyond     elements with |candidate - exact| > atol + rtol |exact|
// and judges it under a profile:
//   strict  (default) bounds derived from the dtypes, the shapes and the problem's scales for an implementation
//           that multiplies operands in the inputs' dtype (bf16, f16 or f32) and accumulates in fp32 (README
//           "Error model" derives each bound)
//   bf16_logits  strict's derivation for an implementation that also rounds the logits to bf16 before the
//           softmax (TRL's eager loss, Liger): the rounding's effect on each output added (README)
//   peer    Liger-Kernel's bf16 test tolerance, atol = rtol = 5e-3 elementwise
//   user    the caller's atol and rtol, elementwise
// NaN or Inf where the exact value is finite always fails; a wrong dtype or shape fails; a tensor the
// candidate lacks is "not checked", which never counts as passed.
//
// Files: error_bounds.cpp (profiles, scales, the derived bounds), compare.cpp (the measurement and verdicts),
// report_format.cpp (table and JSON).
#pragma once

#include "problem/problem.h"
#include "reference/reference.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace simpo::verifier {

enum class ProfileKind { strict, bf16_logits, peer, user };

struct Profile {
  ProfileKind kind = ProfileKind::strict;
  double rtol = 0, atol = 0;  // peer and user only; strict derives its own per tensor
  std::string name() const;   // "strict", "peer", "user(rtol=1e-3, atol=1e-5)"
};
Profile strict_profile();
// strict's derivation for an implementation that rounds the logits to bf16 before the softmax (TRL's eager loss,
// Liger): "as accurate as TRL's eager loss" as a bound with a derivation (README "The bf16_logits profile").
Profile bf16_logits_profile();
Profile peer_profile();
// Every named profile, in the order reports list them: strict, bf16_logits, peer.
std::vector<Profile> named_profiles();
// strict and bf16_logits: bounds derived from the problem (peer and user are elementwise tolerances).
bool is_derived(const Profile&);
Profile user_profile(double rtol, double atol);  // InputError unless both are finite and >= 0
Profile profile_from_name(const std::string&);   // "strict", "bf16_logits" or "peer"; InputError otherwise
// The one resolution of the CLI's profile flags (check, case, sweep): --rtol or --atol given (either) means the
// user profile with both (the other 0), validated by user_profile (a negative or NaN tolerance is an
// InputError naming it, never a silent fall back to strict); else the named profile.
Profile profile_from_flags(const std::string& name, const double* rtol, const double* atol);

// What the strict bounds are derived from, measured once per problem in O(inputs).
struct ProblemScales {
  Shape shape;
  Hyperparameters hp;
  // The inputs' dtype, which the candidate shares: it sets the GEMM operands' rounding (operand_rounding) and
  // whether the logits' products are exact in fp32 (bf16, f16) or round (f32; logit_error).
  DType input_dtype = DType::BF16;
  // Bound on |z| and on sum_h |x_h w_vh| for every logit: max_r ||x_r|| * max_v ||w_v|| + max |bias|
  // (Cauchy-Schwarz), the magnitude fp32 rounding in the logits and the row log-sum-exp is relative to.
  double logit_bound = 0;
  // Gradients: the size of the GEMM operands behind each one, from k[r] (SPEC's per-row factor, computed from
  // the exact chosen/rejected log-probs): dz[r, :] has |dz| summed over v <= 2 |k[r]| and norm <= 2 |k[r]|, so
  //   grad_x:      M = ||k|| max_v ||w_v||     grad_weight: M = sqrt(sum_r k[r]^2 ||x_r||^2)     grad_bias: M = ||k||
  // bound the Frobenius norm of any error made relatively small in each dz element, whatever cancels in the sum.
  // Zero until `exact` is given.
  double magnitude_grad_x = 0, magnitude_grad_weight = 0, magnitude_grad_bias = 0;
  double gradient_magnitude(const std::string& output_name) const;
  // The same with |k[r]| replaced by |k[r]| q[r], q[r] = ||p_off[r]|| = sqrt(sum_{v != target} p_v^2): the
  // norm of row r's dz elements that go through bf16 (the target column's k (1 - p_t) stays fp32, computed
  // with expm1). Rounding the target column to bf16 (a bug class, ANCHORS) costs ~ u |k| p_t instead, which is
  // what makes it visible when p_t is near 1. q comes from the reference's exact softmax when it is given
  // (reference::OffTargetSoftmax, a by-product of its dz pass), else from fp32 logits recomputed here (O(N H V),
  // the cost of a third of the reference); either is widened by the fp32 logits' derived error, so the bound is
  // the same whichever source gave it.
  double operand_grad_x = 0, operand_grad_weight = 0, operand_grad_bias = 0;
  // Per token row r (0 at ignored rows): |k[r]| and q[r], and max_v ||w_v||, for the per-row check of grad_x:
  // its rows are independent sums over the vocabulary, so a bug confined to a few rows (a token whose target
  // probability is near 1, a chunk's last row) is judged against that row's own budget, not diluted in the
  // tensor's norm.
  std::vector<double> row_k, row_q;
  double max_weight_norm = 0;
  double operand_magnitude(const std::string& output_name) const;
  // The preference term's share of k is beta g_i / n[b], g_i = [-(1-ls) sigmoid(-s_i) + ls sigmoid(s_i)] / P.
  // Its two terms can cancel (ls > 0 and s_i near ln((1-ls)/ls), e.g. ls = 0.5, s near 0), so an fp32
  // implementation's k is off by an amount that is not relative to k: the fp32 error of s (2 beta e_l, through
  // dg/ds = sigmoid(s) sigmoid(-s)) plus the rounding of the two terms (4 u32 each, relative to the terms).
  // row_dk[r] bounds |k error| of row r; k_error_* bounds its effect on each gradient: grad_x rows
  // ||dk (e_t - p)||_1 W <= 2 dk W (quadrature over rows), grad_weight sqrt(2) sum_r dk ||x_r|| and grad_bias
  // sqrt(2) sum_r dk within a sequence (one g: coherent), in quadrature across sequences (pairs' errors are
  // independent; a sum over all rows cost the weight_grad_bf16_accumulation mutant its matches_reference kill). These are bounds already (no safety factor on top: e_l is one).
  // Found by the float32 numpy example (examples/numpy_simpo.py,
  // main job seed 4242, case 549: ls = 0.5, gamma = 0, logit scale 0.1: 20 rejected grad_x rows at 1.4x).
  std::vector<double> row_dk;
  double k_error_grad_x = 0, k_error_grad_weight = 0, k_error_grad_bias = 0;
  double k_error(const std::string& output_name) const;
  // The error of an fp32-accumulated logit, e_z (README derivation).
  double logit_error() const;
  // The error of the fp32 token log-prob (README derivation), which also perturbs each dz by |k| e_l.
  double logprob_error() const;
  // The rms relative rounding of the gradient GEMMs' dz operands: u(bf16) / sqrt(3) for bf16 inputs, u(f16) /
  // sqrt(3) for f16, sqrt(2/3) u32 for f32 (dz in fp32 and the products' rounding).
  double operand_rounding() const;

  // The bf16_logits profile's extra budget: what rounding each logit to bf16 (relative error <= u = 2^-8, rms
  // <= u / sqrt(3)) before the softmax adds, derived from the problem's logits (float64; README "The bf16_logits
  // profile"). Scalars: absolute error bounds; gradients: Frobenius (rms) sizes that join the operand rounding in
  // quadrature, plus the error of k through the perturbed log-probs. Set by add_logit_rounding (O(N H V)).
  struct LogitRounding {
    double chosen_logps = 0, rejected_logps = 0, nll = 0, loss_preference = 0;
    double chosen_logits_mean = 0, rejected_logits_mean = 0;
    double grad_x = 0, grad_weight = 0, grad_bias = 0;                    // softmax perturbation through each gradient
    double k_error_grad_x = 0, k_error_grad_weight = 0, k_error_grad_bias = 0;  // k's error through s
    std::vector<double> row_grad_x;  // per token row: the softmax term and 2 dk W, for the per-row grad_x check
    std::vector<double> row_k_error;
    std::vector<double> row_target;  // per token row: dz's rounded target entry through W (rms), k (1 - p_t) |w_t|
  };
  std::optional<LogitRounding> logit_rounding;
  // Needs the exact outputs with gradients (k comes from the exact log-probs). Idempotent.
  void add_logit_rounding(const Problem&, const TensorMap& exact);
  // add_logit_rounding when `profile` is bf16_logits and the exact outputs allow it.
  void prepare_for(const Profile&, const Problem&, const TensorMap& exact);
  static ProblemScales of(const Problem&, const TensorMap* exact = nullptr,
                          const reference::OffTargetSoftmax* off_target = nullptr);
  // The same where the exact gradients are not in the map (kept on the device, reference::compute_on_device):
  // `forward` holds the other outputs, `gradients` says whether gradients are judged.
  static ProblemScales of_forward(const Problem&, const TensorMap& forward, bool gradients,
                                  const reference::OffTargetSoftmax* off_target = nullptr);
};

// The Frobenius norm of the error an fp32-accumulating implementation with GEMM operands in the inputs' dtype may make in
// gradient `name` before its own final rounding: operand rounding + logit noise + accumulation order.
double gradient_internal_error(const ProblemScales&, const std::string& name);

// The strict tolerances for one output tensor of a candidate with dtype `candidate_dtype`.
struct StrictBounds {
  double atol = 0, rtol = 0;      // elementwise; for gradients atol is the output dtype's subnormal rounding,
                                  // to which compare adds the internal budget
  double atol_per_rms = 0;        // gradients: atol = atol_per_rms * rms(exact)
  double frob_bound = -1;         // gradients: rel_frob <= frob_bound (floor-dependent, filled by compare); -1: unused
};
StrictBounds strict_bounds(const ProblemScales&, const std::string& output_name, DType candidate_dtype);
// strict_bounds widened by ProblemScales::logit_rounding for the bf16_logits profile (scalars' atol; gradients
// are widened in gradient_frob_bound_abs, gradient_elementwise_atol and grad_x_row_bound through `profile`).
StrictBounds derived_bounds(const ProblemScales&, const std::string& output_name, DType candidate_dtype, const Profile&);

// Pieces of the strict gradient bounds (README "Error model"), used by compare:
//   the Frobenius bound on ||candidate - exact|| for a tensor of n elements whose rounding floor is floor_abs;
double gradient_frob_bound_abs(const ProblemScales&, const std::string& name, double floor_abs, std::int64_t n,
                               const Profile& = strict_profile());
//   the elementwise backstop (the whole internal budget on one element);
double gradient_elementwise_atol(const ProblemScales&, const std::string& name, const Profile& = strict_profile());
//   the bound for one token row of grad_x, from its own floor and exact norm (the candidate's own rounding: at least
//   its expected size, error_bounds.cpp), k[row] and q[row].
double grad_x_row_bound(const ProblemScales&, std::int64_t row, double row_floor_abs, double row_exact_norm,
                        DType candidate_dtype, const Profile& = strict_profile());
// v rounded to dtype (round to nearest even): what the floor is measured with.
double round_to(DType, double v);

// The unit roundoff of a dtype (2^-8 for bf16, 2^-11 for f16, 2^-24 for f32, 2^-53 for f64) and the rms relative error of
// rounding a typical (log-uniform mantissa) value to it: u * sqrt(1 / (8 ln 2)) = 0.4247 u.
double unit_roundoff(DType);
double expected_rounding_error(DType);

enum class Verdict { passed, failed, not_checked };
std::string verdict_name(Verdict);

struct TensorReport {
  std::string name;
  Verdict verdict = Verdict::not_checked;
  std::string reason;  // why it failed or was not checked; empty when passed
  std::string dtype;   // the candidate's
  std::vector<std::int64_t> shape;
  std::int64_t numel = 0;
  double rel_frob = 0, max_abs = 0, floor = 0, ratio = 0;
  std::string max_abs_at;  // "(1, 0, 3)"
  double reference_at_max = 0, candidate_at_max = 0;
  double rtol = 0, atol = 0;
  double frob_bound = -1;  // -1 when the profile has no Frobenius bound for this tensor
  std::int64_t beyond = 0;
  std::int64_t non_finite = 0;  // NaN/Inf where the reference is finite
  std::int64_t rows_beyond = 0;  // strict grad_x: token rows beyond their own bound
  std::string worst_row;         // "(b, t)"
  // max(rel_frob / frob_bound, max_i |err_i| / (atol + rtol |exact_i|)): < 1 passes; how close it came.
  double margin = 0;
};

struct Report {
  std::string profile;
  std::vector<TensorReport> tensors;  // in SPEC's output order
  bool passed() const;  // every expected tensor present and passed, nothing unexpected
  int count(Verdict) const;
  // The largest rel_frob / frob_bound and (max over elements of |err| / (atol + rtol |exact|)) over all
  // tensors: how close to failing a passing candidate came (< 1 passes). The README's margins come from here.
  double worst_margin() const;
};

// Judges `candidate` against `exact` (the reference's outputs for `problem`). The tensors expected are exactly
// those in `exact`; a candidate tensor `exact` lacks fails as unexpected (e.g. grad_bias without a bias).
Report compare(const Problem&, const TensorMap& exact, const TensorMap& candidate, const Profile&);
// With scales already measured (ProblemScales::of(problem, &exact)).
Report compare(const ProblemScales&, const TensorMap& exact, const TensorMap& candidate, const Profile&);

std::string format_table(const Report&);  // one row per tensor, then the verdict line
std::string format_json(const Report&);   // for CI: {"profile", "passed", "tensors": [...]}
std::string sci(double v, int digits = 2);  // "1.23e-04": how tables and messages write an error

}  // namespace simpo::verifier
