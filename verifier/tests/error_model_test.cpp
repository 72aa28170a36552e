// The error model on hand-made candidates: the exact outputs rounded to the candidate's dtype pass with ratio 1;
// a missing tensor is not checked and fails the report; NaN, wrong shape and wrong dtype fail; errors a little
// over the bounds fail; the peer and user profiles apply their elementwise tolerances.
#include "verifier/error_model.h"

#include "problem/generate.h"
#include "reference/reference.h"

#include <gtest/gtest.h>

#include <cmath>

namespace simpo::verifier {
namespace {

struct Fixture {
  Problem problem;
  TensorMap exact;
};

const Fixture& fixture() {
  static const Fixture f = [] {
    CaseSpec spec;
    spec.shape = {4, 16, 32, 96};
    spec.bias = true;
    spec.seed = 7;
    spec.ignore = IgnorePattern::random;
    Fixture x;
    x.problem = generate(spec);
    x.exact = reference::compute(x.problem);
    return x;
  }();
  return f;
}

// The exact outputs as a fused implementation would ideally return them: scalars F32, gradients BF16.
TensorMap rounded(const TensorMap& exact) {
  TensorMap out;
  for (const auto& [name, t] : exact) {
    const auto v = t.to_double();
    if (is_gradient_output(name)) {
      std::vector<bf16> b(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) b[i] = bf16(static_cast<float>(v[i]));
      out[name] = Tensor::from<bf16>(t.shape, b);
    } else {
      std::vector<float> f(v.begin(), v.end());
      out[name] = Tensor::from<float>(t.shape, f);
    }
  }
  return out;
}

// Adds `relative` * (a deterministic +-1 pattern) * |value| to every element of one tensor, in F64.
Tensor perturbed(const Tensor& t, double relative) {
  auto v = t.to_double();
  for (std::size_t i = 0; i < v.size(); ++i) v[i] *= 1 + relative * ((i * 2654435761u) % 3 == 0 ? 1 : -1);
  return Tensor::from<double>(t.shape, v);
}

// Returns a copy: a reference into a temporary Report (find(compare(...), ...)) dangled once the statement ended
// (ASan: heap-use-after-free in two tests below).
TensorReport find(const Report& r, const std::string& name) {
  for (const auto& t : r.tensors)
    if (t.name == name) return t;
  throw std::logic_error("no tensor " + name);
}

// The scales' q[r] (the off-target softmax norm behind the operand bound) from the reference's exact softmax
// (reference::OffTargetSoftmax, O(N)) and from the fp32 recomputation (O(N H V), when the exact outputs come from
// a file): both are widened by 2 e_l on top of the same q, and fp32 logits move q by at most ~2 e_l q, so the two
// differ by less than 2 e_l per row. Logit scale 30 puts most rows' softmax on one wrong token (the saturated
// branch), scale 2 spreads it; with bias and ignored rows.
TEST(ErrorModel, ScalesFromTheReferenceSoftmaxMatchTheRecomputation) {
  for (const double scale : {2.0, 30.0}) {
    CaseSpec spec;
    spec.shape = {2, 24, 40, 300};
    spec.bias = true;
    spec.seed = 11;
    spec.logit_scale = scale;
    spec.ignore = IgnorePattern::random;
    const Problem p = generate(spec);
    reference::OffTargetSoftmax off_target;
    reference::Options options;
    options.off_target = &off_target;
    const TensorMap exact = reference::compute(p, options);
    ASSERT_EQ(off_target.norm.size(), static_cast<std::size_t>(p.shape.N()));
    const ProblemScales fast = ProblemScales::of(p, &exact, &off_target), slow = ProblemScales::of(p, &exact);
    const double e_l = fast.logprob_error();
    int saturated = 0;
    for (std::int64_t r = 0; r < p.shape.N(); ++r) {
      EXPECT_NEAR(fast.row_q[r], slow.row_q[r], 2 * e_l) << "scale " << scale << " row " << r;
      EXPECT_LE(off_target.norm[r], 1.0);
      saturated += off_target.max[r] >= 0.5;
    }
    for (const char* name : {output_name::grad_x, output_name::grad_weight, output_name::grad_bias}) {
      EXPECT_NEAR(fast.operand_magnitude(name), slow.operand_magnitude(name), 1e-4 * slow.operand_magnitude(name))
          << "scale " << scale << " " << name;
      EXPECT_EQ(fast.gradient_magnitude(name), slow.gradient_magnitude(name)) << name;
    }
    if (scale == 30) {
      EXPECT_GT(saturated, p.shape.N() / 4) << "the saturated branch is exercised";
    }
  }
}

TEST(ErrorModel, RoundedExactOutputsPassStrictAtTheFloor) {
  const auto& f = fixture();
  const Report r = compare(f.problem, f.exact, rounded(f.exact), strict_profile());
  EXPECT_TRUE(r.passed()) << format_table(r);
  const auto& gx = find(r, "grad_x");
  EXPECT_NEAR(gx.ratio, 1.0, 1e-9);  // the candidate is the floor
  EXPECT_GT(gx.floor, 1e-3);         // bf16: ~1.66e-3 for typical values
  EXPECT_LT(gx.floor, 2.5e-3);
  EXPECT_LT(r.worst_margin(), 1.0);
}

TEST(ErrorModel, TheReferenceItselfPasses) {
  const auto& f = fixture();
  const Report r = compare(f.problem, f.exact, f.exact, strict_profile());
  EXPECT_TRUE(r.passed());
  EXPECT_EQ(find(r, "loss").rel_frob, 0.0);
}

TEST(ErrorModel, MissingTensorIsNotCheckedAndFailsTheReport) {
  const auto& f = fixture();
  TensorMap c = rounded(f.exact);
  c.erase("grad_weight");
  const Report r = compare(f.problem, f.exact, c, strict_profile());
  EXPECT_FALSE(r.passed());
  EXPECT_EQ(find(r, "grad_weight").verdict, Verdict::not_checked);
  EXPECT_EQ(r.count(Verdict::failed), 0);
}

TEST(ErrorModel, NanWhereTheReferenceIsFiniteFails) {
  const auto& f = fixture();
  TensorMap c = rounded(f.exact);
  c["grad_bias"].as<bf16>()[3] = bf16(NAN);
  const Report r = compare(f.problem, f.exact, c, peer_profile());  // even under the loosest profile
  EXPECT_EQ(find(r, "grad_bias").verdict, Verdict::failed);
  EXPECT_EQ(find(r, "grad_bias").non_finite, 1);
  EXPECT_NE(find(r, "grad_bias").reason.find("NaN"), std::string::npos);
}

TEST(ErrorModel, WrongShapeAndUnexpectedTensorsFail) {
  const auto& f = fixture();
  TensorMap c = rounded(f.exact);
  c["chosen_logps"] = Tensor(DType::F32, {3});
  c["bogus"] = Tensor(DType::F32, {});
  const Report r = compare(f.problem, f.exact, c, strict_profile());
  EXPECT_EQ(find(r, "chosen_logps").verdict, Verdict::failed);
  EXPECT_EQ(find(r, "bogus").verdict, Verdict::failed);
}

TEST(ErrorModel, GradientTwiceTheFloorFailsStrictButPassesPeer) {
  const auto& f = fixture();
  TensorMap c = rounded(f.exact);
  // ~4e-3 relative on every element: what bf16 accumulation across chunks produces; 2.4x the bf16 floor,
  // beyond 1.5 sqrt(floor^2 + op^2) = 2.1x.
  c["grad_weight"] = perturbed(f.exact.at("grad_weight"), 4e-3);
  EXPECT_EQ(find(compare(f.problem, f.exact, c, strict_profile()), "grad_weight").verdict, Verdict::failed);
  EXPECT_EQ(find(compare(f.problem, f.exact, c, peer_profile()), "grad_weight").verdict, Verdict::passed);
}

TEST(ErrorModel, LossOffByOnePerMilleFailsStrict) {
  const auto& f = fixture();
  TensorMap c = rounded(f.exact);
  const double loss = f.exact.at("loss").value(0);
  c["loss"] = Tensor::scalar<float>(static_cast<float>(loss * (1 + 1e-3)));
  // 1e-3 is what a bf16 accumulator in the row sum of exp does (the narrow_row_accumulator mutant).
  const TensorReport t = find(compare(f.problem, f.exact, c, strict_profile()), "loss");
  EXPECT_EQ(t.verdict, Verdict::failed) << "atol " << t.atol << " rtol " << t.rtol;
  // and a 1e-6 relative error (a few fp32 ulps) passes
  c["loss"] = Tensor::scalar<float>(static_cast<float>(loss * (1 + 1e-6)));
  EXPECT_EQ(find(compare(f.problem, f.exact, c, strict_profile()), "loss").verdict, Verdict::passed);
}

TEST(ErrorModel, OneWrongTokenRowOfGradXFailsThoughTheTensorNormBarelyMoves) {
  const auto& f = fixture();
  TensorMap c = rounded(f.exact);
  // The completion row with the smallest share of grad_x's norm, off by 2 %: diluted in the tensor's norm
  // (inside the Frobenius bound), but judged against its own budget.
  const Shape& s = f.problem.shape;
  const Tensor& exact_gx = f.exact.at("grad_x");
  std::int64_t row = -1;
  double smallest = INFINITY;
  for (std::int64_t r = 0; r < s.N(); ++r) {
    if (!f.problem.is_completion(r / s.T, r % s.T)) continue;
    double sq = 0;
    for (std::int64_t h = 0; h < s.H; ++h) sq += exact_gx.value(r * s.H + h) * exact_gx.value(r * s.H + h);
    if (sq < smallest) smallest = sq, row = r;
  }
  ASSERT_GE(row, 0);
  auto g = c["grad_x"].as<bf16>();
  for (std::int64_t h = 0; h < s.H; ++h) {
    auto& v = g[static_cast<std::size_t>(row * s.H + h)];
    v = bf16(static_cast<float>(v) * 1.02f);
  }
  const TensorReport t = find(compare(f.problem, f.exact, c, strict_profile()), "grad_x");
  EXPECT_EQ(t.verdict, Verdict::failed) << t.reason;
  EXPECT_EQ(t.rows_beyond, 1);
  EXPECT_LT(t.rel_frob, t.frob_bound);  // the tensor-level bound alone would have passed it
}

TEST(ErrorModel, UserTolerancesAreElementwise) {
  const auto& f = fixture();
  TensorMap c = rounded(f.exact);
  c["grad_x"] = perturbed(f.exact.at("grad_x"), 1e-2);
  EXPECT_EQ(find(compare(f.problem, f.exact, c, user_profile(2e-2, 0)), "grad_x").verdict, Verdict::passed);
  EXPECT_EQ(find(compare(f.problem, f.exact, c, user_profile(5e-3, 0)), "grad_x").verdict, Verdict::failed);
  EXPECT_THROW(user_profile(-1, 0), InputError);
  EXPECT_THROW(profile_from_name("lenient"), InputError);
}

TEST(ErrorModel, ExpectedRoundingErrorMatchesMeasuredBf16Floor) {
  // ANCHORS measured a bf16 floor of 1.66e-3 to 1.67e-3 on realistic gradients; the derivation gives 1.659e-3.
  EXPECT_NEAR(expected_rounding_error(DType::BF16), 1.659e-3, 1e-6);
}

// ---- the strict bounds follow the candidate's dtypes (SPEC) ----

// The fixture's case with inputs in `dtype` (the same draws, generate()), and its exact outputs.
Fixture fixture_in(DType dtype) {
  CaseSpec spec;
  spec.shape = {4, 16, 32, 96};
  spec.bias = true;
  spec.seed = 7;
  spec.ignore = IgnorePattern::random;
  spec.dtype = dtype;
  Fixture x;
  x.problem = generate(spec);
  x.exact = reference::compute(x.problem);
  return x;
}

// Every gradient of `values` stored as `dtype`, each value first rounded to `precision` (bf16, f16, f32): a
// candidate whose gradients are labelled `dtype` but hold only `precision`'s digits. Scalars: F32.
TensorMap stored_as(const TensorMap& values, DType dtype, DType precision) {
  TensorMap out;
  for (const auto& [name, t] : values) {
    auto v = t.to_double();
    const DType d = is_gradient_output(name) ? dtype : DType::F32;
    for (double& e : v) e = round_to(is_gradient_output(name) ? precision : DType::F32, e);
    Tensor c(d, t.shape);
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (d == DType::F16) c.as<f16>()[i] = f16(static_cast<float>(v[i]));
      else c.as<float>()[i] = static_cast<float>(v[i]);
    }
    out[name] = std::move(c);
  }
  return out;
}

TEST(ErrorModel, F16AndF32UnitRoundoffsAndRounding) {
  EXPECT_EQ(unit_roundoff(DType::F16), 0x1.0p-11);
  EXPECT_EQ(round_to(DType::F16, 1 + 0x1.0p-11), 1.0);  // a tie: to even
  EXPECT_EQ(round_to(DType::F16, 1 + 0x1.8p-11), 1 + 0x1.0p-10);
  EXPECT_EQ(round_to(DType::F32, 1 + 0x1.8p-24), 1 + 0x1.0p-23);
}

// An f32 candidate is held to f32 arithmetic: the exact outputs rounded to F32 pass at their (f32) floor; the same
// tensors holding only bf16's digits (an implementation that runs the bf16 pipeline and returns F32) fail, though
// they would be the floor of a bf16 candidate.
TEST(ErrorModel, F32CandidateIsHeldToF32) {
  const Fixture f = fixture_in(DType::F32);
  const Report exact_f32 = compare(f.problem, f.exact, stored_as(f.exact, DType::F32, DType::F32), strict_profile());
  EXPECT_TRUE(exact_f32.passed()) << format_table(exact_f32);
  EXPECT_LT(find(exact_f32, "grad_x").floor, 1e-7);
  EXPECT_NEAR(find(exact_f32, "grad_x").ratio, 1.0, 1e-9);

  const Report bf16_digits = compare(f.problem, f.exact, stored_as(f.exact, DType::F32, DType::BF16), strict_profile());
  EXPECT_FALSE(bf16_digits.passed());
  for (const char* name : {"grad_x", "grad_weight", "grad_bias"})
    EXPECT_EQ(find(bf16_digits, name).verdict, Verdict::failed) << name << "\n" << format_table(bf16_digits);

  // SPEC gives gradients the inputs' dtype: the exact gradients rounded to BF16 (at their own floor, which a bf16
  // candidate passes with) fail for f32 inputs, the reason saying why; F32 gradients of bf16 inputs are allowed.
  const Report coarser = compare(f.problem, f.exact, rounded(f.exact), strict_profile());
  for (const char* name : {"grad_x", "grad_weight", "grad_bias"}) {
    const TensorReport t = find(coarser, name);
    EXPECT_EQ(t.verdict, Verdict::failed) << name;
    EXPECT_NE(t.reason.find("BF16 but the inputs are F32"), std::string::npos) << t.reason;
    EXPECT_NEAR(t.ratio, 1.0, 1e-9) << name;  // measured all the same
  }
  EXPECT_EQ(find(coarser, "loss").verdict, Verdict::passed);
  const Fixture& bf = fixture();
  EXPECT_TRUE(compare(bf.problem, bf.exact, stored_as(bf.exact, DType::F32, DType::F32), strict_profile()).passed());

  // A candidate that rounds the f32 inputs to bf16 and then computes exactly: the quantization of its inputs is
  // the error f32 arithmetic does not make.
  const Fixture quantized = fixture_in(DType::BF16);  // the same draws, rounded to bf16
  const Report q = compare(f.problem, f.exact, stored_as(quantized.exact, DType::F32, DType::F32), strict_profile());
  EXPECT_FALSE(q.passed());
  EXPECT_EQ(find(q, "grad_x").verdict, Verdict::failed) << format_table(q);
  EXPECT_EQ(find(q, "loss").verdict, Verdict::failed) << format_table(q);
}

// f16 outputs are held to f16's spacing: the exact outputs rounded to F16 pass at the floor, the same values with
// bf16's digits in F16 tensors do not.
TEST(ErrorModel, F16CandidateIsHeldToF16Spacing) {
  const Fixture f = fixture_in(DType::F16);
  const Report exact_f16 = compare(f.problem, f.exact, stored_as(f.exact, DType::F16, DType::F16), strict_profile());
  EXPECT_TRUE(exact_f16.passed()) << format_table(exact_f16);
  const auto gx = find(exact_f16, "grad_x");
  EXPECT_NEAR(gx.ratio, 1.0, 1e-9);
  EXPECT_GT(gx.floor, 1e-4);  // f16: ~0.42 * 2^-11 = 2.1e-4 for typical values
  EXPECT_LT(gx.floor, 3e-4);

  const Report bf16_digits = compare(f.problem, f.exact, stored_as(f.exact, DType::F16, DType::BF16), strict_profile());
  for (const char* name : {"grad_x", "grad_weight", "grad_bias"})
    EXPECT_EQ(find(bf16_digits, name).verdict, Verdict::failed) << name << "\n" << format_table(bf16_digits);
}

// The dtype-dependent pieces: products exact in fp32 for bf16 and f16 inputs, rounded for f32 (one more u32 Z in
// e_z); the gradients' operand rounding u/sqrt(3) of the inputs' dtype, sqrt(2/3) u32 for f32.
TEST(ErrorModel, ScalesFollowTheInputDtype) {
  const Fixture b = fixture_in(DType::BF16), h = fixture_in(DType::F16), f = fixture_in(DType::F32);
  const ProblemScales sb = ProblemScales::of(b.problem, &b.exact), sh = ProblemScales::of(h.problem, &h.exact),
                      sf = ProblemScales::of(f.problem, &f.exact);
  EXPECT_EQ(sb.input_dtype, DType::BF16);
  EXPECT_EQ(sf.input_dtype, DType::F32);
  EXPECT_DOUBLE_EQ(sb.logit_error(), std::sqrt(32.0) * 0x1.0p-24 * sb.logit_bound);
  EXPECT_DOUBLE_EQ(sf.logit_error(), (std::sqrt(32.0) + 1) * 0x1.0p-24 * sf.logit_bound);
  EXPECT_DOUBLE_EQ(sb.operand_rounding(), 0x1.0p-8 / std::sqrt(3.0));
  EXPECT_DOUBLE_EQ(sh.operand_rounding(), 0x1.0p-11 / std::sqrt(3.0));
  EXPECT_DOUBLE_EQ(sf.operand_rounding(), std::sqrt(2.0 / 3.0) * 0x1.0p-24);
  // The f32 gradient budget is set by fp32's logit noise and accumulation, an order of magnitude below bf16's
  // (whose operand rounding dominates it); f16's lies between.
  for (const char* name : {"grad_x", "grad_weight", "grad_bias"}) {
    EXPECT_LT(gradient_internal_error(sf, name), gradient_internal_error(sb, name) / 10) << name;
    EXPECT_LT(gradient_internal_error(sh, name), gradient_internal_error(sb, name) / 3) << name;
  }
}

}  // namespace
}  // namespace simpo::verifier
