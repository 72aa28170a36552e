// The comparison on the device (verifier/device_compare.h) against the host's (compare.cpp), label gpu: the same
// exact outputs (reference::compute_on_device, its gradients downloaded for the host), the same candidates (our cpu
// backend, correct, and planted-wrong ones; on the host and on the device), the same TensorReport. Integers,
// strings, maxima and the elements read back must be equal; only the float64 sums may differ, by their reduction
// order (derivation at sums_tolerance). Where no CUDA device is present no test runs and the binary says why
// (reference/cuda/tests/gpu_main.cpp, the main it shares with reference_cuda_tests).
#include "fused/fused.h"
#include "problem/generate.h"
#include "reference/reference.h"
#include "verifier/device_compare.h"
#include "verifier/device_reductions.h"
#include "verifier/error_model.h"
#include "verifier/implementation.h"
#include "verifier/logit_rows.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

namespace simpo::verifier {
namespace {

// A sum of n nonnegative float64 terms, in any order, is within gamma_{n-1} = (n-1) u / (1 - (n-1) u) of the exact
// sum, relative (Higham, Accuracy and Stability, 4.2): two orders differ by at most twice that. A ratio of two
// square roots of such sums (rel_frob, floor, the bound's floor term, the row norms) moves by at most the sum of
// their halves, and ratio = rel_frob / floor and margin = rel_frob / frob_bound compose two of those: 4 gamma in
// all, plus a few roundings of the formulas themselves (8 u).
double sums_tolerance(std::int64_t n) {
  const double u = 0x1.0p-53, g = static_cast<double>(n) * u / (1 - static_cast<double>(n) * u);
  return 4 * g + 8 * u;
}

void expect_close(const char* what, const std::string& tensor, double host, double device, double tolerance) {
  if (std::isnan(host) || std::isinf(host)) {
    EXPECT_TRUE(std::isnan(host) ? std::isnan(device) : host == device) << tensor << " " << what << ": " << host << " vs " << device;
    return;
  }
  EXPECT_LE(std::fabs(host - device), tolerance * std::fabs(host)) << tensor << " " << what << ": host " << host << ", device "
                                                                    << device << " (relative tolerance " << tolerance << ")";
}

// Order-free values (maxima, single elements): the same bits, a NaN (a planted one) matching a NaN.
void expect_same_bits(const char* what, double host, double device) {
  EXPECT_TRUE(host == device || (std::isnan(host) && std::isnan(device))) << what << ": " << host << " vs " << device;
}

void expect_same_report(const Report& host, const Report& device) {
  ASSERT_EQ(host.tensors.size(), device.tensors.size());
  EXPECT_EQ(host.profile, device.profile);
  for (std::size_t i = 0; i < host.tensors.size(); ++i) {
    const TensorReport& h = host.tensors[i];
    const TensorReport& d = device.tensors[i];
    SCOPED_TRACE(h.name + " under " + host.profile);
    EXPECT_EQ(h.name, d.name);
    EXPECT_EQ(h.verdict, d.verdict) << h.reason << " | " << d.reason;
    EXPECT_EQ(h.dtype, d.dtype);
    EXPECT_EQ(h.shape, d.shape);
    EXPECT_EQ(h.numel, d.numel);
    EXPECT_EQ(h.beyond, d.beyond);
    EXPECT_EQ(h.non_finite, d.non_finite);
    EXPECT_EQ(h.rows_beyond, d.rows_beyond);
    EXPECT_EQ(h.worst_row, d.worst_row);
    EXPECT_EQ(h.max_abs_at, d.max_abs_at);
    // Maxima and single elements: order-free, the same bits.
    expect_same_bits("max_abs", h.max_abs, d.max_abs);
    expect_same_bits("reference_at_max", h.reference_at_max, d.reference_at_max);
    expect_same_bits("candidate_at_max", h.candidate_at_max, d.candidate_at_max);
    EXPECT_EQ(h.rtol, d.rtol);
    const double t = sums_tolerance(std::max<std::int64_t>(h.numel, 1));
    expect_close("atol", h.name, h.atol, d.atol, t);  // gradients: from the floor's sum
    expect_close("rel_frob", h.name, h.rel_frob, d.rel_frob, t);
    expect_close("floor", h.name, h.floor, d.floor, t);
    expect_close("ratio", h.name, h.ratio, d.ratio, t);
    expect_close("frob_bound", h.name, h.frob_bound, d.frob_bound, t);
    expect_close("margin", h.name, h.margin, d.margin, t);
    // The reason quotes sums to 3 digits: equal unless a sum sits on a printed digit's boundary.
    if (h.verdict == Verdict::failed) {
      EXPECT_EQ(h.reason, d.reason);
    }
  }
}

struct Judged {
  Problem problem;
  reference::DeviceOutputs device_exact;
  TensorMap host_exact;
  ProblemScales scales;
};

Judged judged(const CaseSpec& spec) {
  Judged j{generate(spec), {}, {}, {}};
  reference::OffTargetSoftmax off_target;
  reference::Options o;
  o.off_target = &off_target;
  j.device_exact = reference::compute_on_device(j.problem, o);
  j.host_exact = to_host(j.device_exact);
  j.scales = ProblemScales::of_forward(j.problem, j.device_exact.host, true, &off_target);
  j.scales.add_logit_rounding(j.problem, j.device_exact.host);
  return j;
}

// The candidate's gradients as device tensors (the rest on the host), the copies kept alive by `keep`.
MixedOutputs on_device(const TensorMap& candidate, int device, std::vector<std::shared_ptr<const void>>& keep) {
  MixedOutputs m;
  for (const auto& [name, t] : candidate) {
    if (!is_gradient_output(name)) {
      m.host[name] = t;
      continue;
    }
    keep.push_back(device::upload(t.bytes.data(), t.bytes.size(), device));
    m.device[name] = DeviceTensorView{t.dtype, t.shape, keep.back().get(), device};
  }
  return m;
}

// Judges `candidate` on the host and on the device (candidate on the host, then on the device) under every
// profile, and requires the same reports; returns the strict one.
Report judge_everywhere(Judged& j, const TensorMap& candidate) {
  std::vector<Profile> profiles = named_profiles();
  profiles.push_back(user_profile(1e-3, 1e-5));
  Report strict;
  for (const Profile& p : profiles) {
    const Report host = compare(j.scales, j.host_exact, candidate, p);
    MixedOutputs all_host;
    all_host.host = candidate;
    expect_same_report(host, compare(j.scales, j.device_exact, all_host, p));
    std::vector<std::shared_ptr<const void>> keep;
    const int device = j.device_exact.gradients.begin()->second.device;
    expect_same_report(host, compare(j.scales, j.device_exact, on_device(candidate, device, keep), p));
    if (p.kind == ProfileKind::strict) strict = host;
  }
  return strict;
}

TensorMap cpu_outputs(const Problem& p, bool grad_f32 = false) {
  RunOptions run;
  run.grad_f32 = grad_f32;
  return implementation_by_name("cpu").compute(p, run);
}

std::vector<CaseSpec> problems() {
  std::vector<CaseSpec> specs;
  auto add = [&](Shape s, bool bias, double scale, std::uint64_t seed) {
    CaseSpec c;
    c.shape = s;
    c.bias = bias;
    c.logit_scale = scale;
    c.seed = seed;
    specs.push_back(c);
  };
  add({2, 16, 64, 1000}, false, 2.0, 1);
  add({4, 33, 96, 3001}, true, 8.0, 2);     // odd sizes: blocks and rows not multiples of the block width
  add({6, 7, 1, 476}, false, 3.1, 3);       // H = 1: one element per grad_x row
  add({2, 128, 512, 32000}, true, 30.0, 4);  // peaked softmax; grad_weight of 16M elements over many blocks
  return specs;
}

TEST(DeviceCompare, OurCpuBackendIsJudgedAsOnTheHost) {
  for (const CaseSpec& spec : problems()) {
    SCOPED_TRACE(spec.shape.to_string());
    Judged j = judged(spec);
    judge_everywhere(j, cpu_outputs(j.problem));
    judge_everywhere(j, cpu_outputs(j.problem, /*grad_f32=*/true));
    judge_everywhere(j, j.host_exact);  // float64 candidate: the exact outputs themselves
  }
}

TEST(DeviceCompare, PlantedWrongCandidatesAreJudgedAsOnTheHost) {
  for (const CaseSpec& spec : problems()) {
    SCOPED_TRACE(spec.shape.to_string());
    Judged j = judged(spec);
    const TensorMap good = cpu_outputs(j.problem);
    const std::int64_t H = spec.shape.H;

    TensorMap one_element = good;  // one grad_weight element off by the tensor's whole norm: past any bound
    auto w = one_element.at(output_name::grad_weight).as<bf16>();
    double norm = 0;
    for (const bf16 v : w) norm += static_cast<double>(static_cast<float>(v)) * static_cast<float>(v);
    w[w.size() / 3] = bf16(static_cast<float>(w[w.size() / 3]) + static_cast<float>(std::sqrt(norm)));
    EXPECT_FALSE(judge_everywhere(j, one_element).passed());

    TensorMap one_row = good;  // one grad_x row scaled by 1 + 2^-5: a row's bound, not the tensor's
    auto x = one_row.at(output_name::grad_x).as<bf16>();
    for (std::int64_t h = 0; h < H; ++h) x[static_cast<std::size_t>(H + h)] = bf16(1.03125f * static_cast<float>(x[static_cast<std::size_t>(H + h)]));
    judge_everywhere(j, one_row);

    TensorMap nan = good;  // NaN in grad_x, Inf in grad_weight
    nan.at(output_name::grad_x).as<bf16>()[1] = bf16(std::nanf(""));
    nan.at(output_name::grad_weight).as<bf16>()[7] = bf16(INFINITY);
    const Report r = judge_everywhere(j, nan);
    EXPECT_FALSE(r.passed());

    TensorMap all_wrong = good;  // every gradient element off by 1/8 (past strict at every shape here, H = 1 too)
    for (const char* name : {output_name::grad_x, output_name::grad_weight})
      for (bf16& v : all_wrong.at(name).as<bf16>()) v = bf16(1.125f * static_cast<float>(v));
    EXPECT_FALSE(judge_everywhere(j, all_wrong).passed());

    TensorMap wrong_shape = good;  // grad_weight transposed: fails before any reduction
    wrong_shape.at(output_name::grad_weight).shape = {H, spec.shape.V};
    EXPECT_FALSE(judge_everywhere(j, wrong_shape).passed());

    TensorMap missing = good;  // grad_x missing: not checked; grad_bias where there is no bias: unexpected
    missing.erase(output_name::grad_x);
    if (!spec.bias) missing[output_name::grad_bias] = Tensor(DType::BF16, {spec.shape.V});
    EXPECT_FALSE(judge_everywhere(j, missing).passed());
  }
}

// The bf16_logits profile's row pass on the device (device_logit_rows.cu) against the host's (logit_rows.cpp), each
// row's terms. Both evaluate the same float64 formulas; only the order of their sums differs. A logit is a sum of
// H products, so two orders differ by at most 2 gamma_H sum_h |x_h w_h| <= 2 H u64 xw, xw = max ||x_r|| max ||w_v||
// (Higham 3.1 and Cauchy-Schwarz): through exp that is a relative change of the softmax terms; a sum over V of
// nonnegative terms moves by at most 2 gamma_V relative. A row term multiplies these by at most (1 + zbound) per
// factor of z it holds (|z| <= xw + max |b_v| = zbound; C holds two): 4 (H xw + V) 2 u64 (1 + zbound)^2.
double row_terms_tolerance(const Problem& p) {
  auto max_row_norm = [](const InputValues& v, std::int64_t rows, std::int64_t cols) {
    double best = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      double sq = 0;
      for (std::int64_t c = 0; c < cols; ++c) sq += v.value(static_cast<std::size_t>(r * cols + c)) * v.value(static_cast<std::size_t>(r * cols + c));
      best = std::max(best, std::sqrt(sq));
    }
    return best;
  };
  const Shape& s = p.shape;
  const double xw = max_row_norm(p.x, s.N(), s.H) * max_row_norm(p.weight, s.V, s.H);
  const double bias = p.bias ? max_row_norm(*p.bias, s.V, 1) : 0.0;
  const double zbound = xw + bias;
  return 4 * (static_cast<double>(s.H) * xw + static_cast<double>(s.V)) * 2 * 0x1.0p-53 * (1 + zbound) * (1 + zbound);
}

TEST(DeviceLogitRows, MatchTheHostPassRowByRow) {
  std::vector<CaseSpec> specs = problems();
  CaseSpec f16 = specs[1], f32 = specs[1];
  f16.dtype = DType::F16;
  f32.dtype = DType::F32;
  specs.push_back(f16);
  specs.push_back(f32);
  for (const CaseSpec& spec : specs) {
    SCOPED_TRACE(spec.shape.to_string() + " " + input_dtype_name(spec.dtype));
    const Problem p = generate(spec);
    const double tolerance = row_terms_tolerance(p);
    for (const bool gradients : {false, true}) {
      const std::vector<LogitRow> host = logit_rows_on_host(p, gradients);
      const auto device = logit_rows_on_device(p, gradients);
      ASSERT_TRUE(device.has_value());
      ASSERT_EQ(device->size(), host.size());
      double worst = 0;
      auto close = [&](const char* what, std::size_t r, double h, double d) {
        const double scale = std::max(std::fabs(h), std::fabs(d));
        if (scale == 0) return;
        worst = std::max(worst, std::fabs(h - d) / scale);
        EXPECT_LE(std::fabs(h - d), tolerance * scale) << what << " of row " << r << ": host " << h << ", device " << d;
      };
      for (std::size_t r = 0; r < host.size(); ++r) {
        const LogitRow &h = host[r], &d = (*device)[r];
        close("abs_sum", r, h.abs_sum, d.abs_sum);
        close("sq_sum", r, h.sq_sum, d.sq_sum);
        close("worst_l", r, h.worst_l, d.worst_l);
        close("var_l", r, h.var_l, d.var_l);
        close("b_row", r, h.b_row, d.b_row);
        close("c_row", r, h.c_row, d.c_row);
        close("target_gap", r, h.target_gap, d.target_gap);
        EXPECT_EQ(h.target_gap == 0, d.target_gap == 0) << "row " << r << ": a target on one side only";
      }
      std::printf("  %s %s gradients=%d: largest relative difference %.2e (tolerance %.2e)\n",
                  spec.shape.to_string().c_str(), input_dtype_name(spec.dtype).c_str(), gradients ? 1 : 0, worst, tolerance);
    }
  }
}

TEST(DeviceCompare, ACandidateOnAnotherDeviceIsAnInputError) {
  Judged j = judged(problems().front());
  TensorMap good = cpu_outputs(j.problem);
  std::vector<std::shared_ptr<const void>> keep;
  MixedOutputs m = on_device(good, j.device_exact.gradients.begin()->second.device, keep);
  m.device.at(output_name::grad_x).device += 1;
  EXPECT_THROW(compare(j.scales, j.device_exact, m, strict_profile()), InputError);
}

}  // namespace
}  // namespace simpo::verifier
