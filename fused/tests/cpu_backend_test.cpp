// The cpu backend's own tests, beside the suite both backends pass (backend_suite.cpp, built into this
// executable as the CpuBackend* tests): plan() cutting chunks exactly where a budget allows, and the fused entry
// point (validation, names, backend resolution), which needs no backend-specific code; f16 and f32 inputs
// judged by the verifier's strict profile (the bounds SPEC holds those dtypes to).
#include "fused/fused.h"
#include "fused/mutant.h"
#include "fused/schedule.h"
#include "fused/tests/backend_suite.h"
#include "problem/generate.h"
#include "reference/reference.h"
#include "verifier/error_model.h"

#include <gtest/gtest.h>

#include <cmath>

namespace simpo::fused {
namespace {

using namespace suite;

Options cpu_options() { return options_for(Backend::cpu); }

// ---- f16 and f32 inputs earn the strict profile's bounds for their dtypes ----

// Cases across the sweep's range (shapes, logit scales, bias, label smoothing, ignore patterns, chunking) with
// f16 and f32 inputs: every output passes strict, judged against bounds that follow the dtypes (an f32 candidate
// held to f32 arithmetic). Gradients in the inputs' dtype, and in F32 on request.
TEST(CpuBackendDtypes, F16AndF32InputsPassStrict) {
  struct Case {
    Shape shape;
    double scale;
    bool bias;
    double label_smoothing;
    IgnorePattern ignore;
    std::int64_t max_chunk_rows;
  };
  const Case cases[] = {{{2, 7, 33, 129}, 2.0, true, 0.0, IgnorePattern::prompt_prefix, 0},
                        {{4, 16, 64, 1021}, 30.0, false, 0.3, IgnorePattern::random, 5},
                        {{6, 3, 1, 2}, 0.1, true, 0.5, IgnorePattern::all_but_one, 1},
                        {{2, 40, 160, 509}, 8.0, true, 0.1, IgnorePattern::none, 0}};
  std::uint64_t seed = 100;
  for (DType dtype : {DType::F16, DType::F32})
    for (const Case& c : cases)
      for (bool grad_f32 : {false, true}) {
        CaseSpec spec = spec_of(c.shape, c.scale, ++seed);
        spec.dtype = dtype;
        spec.bias = c.bias;
        spec.hp.label_smoothing = c.label_smoothing;
        spec.ignore = c.ignore;
        SCOPED_TRACE(input_dtype_name(dtype) + " " + c.shape.to_string() + " scale " + std::to_string(c.scale) +
                     (grad_f32 ? " F32 grad_weight" : ""));
        const Problem problem = generate(spec);
        Options options = cpu_options();
        options.max_chunk_rows = c.max_chunk_rows;
        options.grad_weight_f32 = grad_f32;
        const TensorMap out = compute(problem, options);
        expect_dtypes(out, problem, options);
        const verifier::Report r = verifier::compare(problem, reference::compute(problem), out, verifier::strict_profile());
        EXPECT_TRUE(r.passed()) << verifier::format_table(r);
      }
}

// An f32 result computed through bf16 (the f32 inputs rounded to bf16, then the bf16 path, its gradients returned
// as F32) is what SPEC's f32 bounds exist to reject: every output fails but the logits means, whose input
// quantization averages out over P T V logits (1e-3 of a mean near 0, inside their absolute bound).
TEST(CpuBackendDtypes, TheBf16PathOnF32InputsFailsStrict) {
  CaseSpec spec = spec_of({4, 16, 64, 300}, 2.0, 77);
  spec.dtype = DType::F32;
  const Problem problem = generate(spec);
  spec.dtype = DType::BF16;  // the same draws rounded to bf16
  Options options = cpu_options();
  options.grad_weight_f32 = true;
  TensorMap through_bf16 = compute(generate(spec), options);
  const Tensor& gx = through_bf16.at(output_name::grad_x);
  Tensor gx32(DType::F32, gx.shape);
  for (std::int64_t i = 0; i < gx.numel(); ++i) gx32.as<float>()[static_cast<std::size_t>(i)] = static_cast<float>(gx.value(i));
  through_bf16[output_name::grad_x] = std::move(gx32);
  const TensorMap exact = reference::compute(problem);
  const verifier::Report r = verifier::compare(problem, exact, through_bf16, verifier::strict_profile());
  for (const auto& t : r.tensors) {
    if (t.name != output_name::chosen_logits_mean && t.name != output_name::rejected_logits_mean) {
      EXPECT_EQ(t.verdict, verifier::Verdict::failed) << t.name << "\n" << verifier::format_table(r);
    }
  }
  const verifier::Report own = verifier::compare(problem, exact, compute(problem, cpu_options()), verifier::strict_profile());
  EXPECT_TRUE(own.passed()) << verifier::format_table(own);
}

// Logit distances (16-bit logits, the default) are a bf16 path: f16 and f32 inputs keep dz from fp32 logits, so
// their outputs are the same bits with the option on or off; bf16 inputs' gradients differ.
TEST(CpuBackendDtypes, LogitDistancesApplyToBf16InputsAlone) {
  for (const DType dtype : {DType::F32, DType::F16, DType::BF16}) {
    CaseSpec spec = spec_of({.B = 2, .T = 30, .H = 64, .V = 400}, 30.0, 5);
    spec.dtype = dtype;
    const Problem problem = generate(spec);
    Options on = cpu_options(), off = cpu_options();
    on.logit_distances = true;
    off.logit_distances = false;
    const TensorMap a = compute(problem, on), b = compute(problem, off);
    const bool same = a.at(output_name::grad_weight).bytes == b.at(output_name::grad_weight).bytes;
    EXPECT_EQ(same, dtype != DType::BF16) << input_dtype_name(dtype);
  }
}

// ---- schedules and budgets: one result up to fp32 noise ----

TEST(CpuBackendSchedules, WorkspaceBudgetsGiveOneResult) {
  CaseSpec spec = spec_of({.B = 6, .T = 40, .H = 64, .V = 257}, 2.0, 41);
  spec.bias = true;
  const Problem problem = generate(spec);
  const TensorMap whole = compute(problem, cpu_options());
  const TensorMap exact = reference::compute(problem);
  const std::int64_t row_bytes = workspace_bytes_per_row(problem.shape, true);
  for (std::int64_t rows : {1, 7, 79, 80, 81, 160, 239}) {
    SCOPED_TRACE("budget of " + std::to_string(rows) + " rows");
    Options options = cpu_options();
    options.workspace_bytes = rows * row_bytes + row_bytes / 2;
    EXPECT_EQ(plan(problem.shape, options).chunk_rows, rows);
    expect_same_to_fp32_noise(compute(problem, options), whole, &exact);
  }
}

// ---- the entry point ----

TEST(FusedEntryPoint, ValidateOffSkipsOnlyTheValueScan) {
  Problem problem = generate(spec_of({.B = 2, .T = 4, .H = 8, .V = 16}, 2.0, 52));
  problem.x.as<bf16>()[5] = bf16(NAN);
  Options options = cpu_options();
  EXPECT_THROW(compute(problem, options), InputError);  // the scan names x and its first bad index
  options.validate = false;
  EXPECT_NO_THROW(compute(problem, options));  // the caller vouched for the values
  problem.shape.B = 3;  // shape rules are checked whatever the option
  EXPECT_THROW(compute(problem, options), InputError);
}

TEST(FusedEntryPoint, NamesRoundTrip) {
  for (Backend b : {Backend::automatic, Backend::cpu, Backend::cuda}) EXPECT_EQ(backend_from_name(backend_name(b)), b);
  EXPECT_THROW(backend_from_name("gpu"), InputError);
  EXPECT_EQ(all_mutants().size(), 17u);
  for (Mutant m : all_mutants()) {
    EXPECT_NE(m, Mutant::none);
    EXPECT_EQ(mutant_from_name(mutant_name(m)), m);
  }
  EXPECT_THROW(mutant_from_name("no_such_mutant"), InputError);
}

TEST(FusedEntryPoint, ResolveFollowsTheDevice) {
  EXPECT_EQ(resolve(Backend::cpu), Backend::cpu);
  EXPECT_EQ(resolve(Backend::automatic), cuda_available() ? Backend::cuda : Backend::cpu);
  if (!cuda_available()) {
    EXPECT_THROW(resolve(Backend::cuda), InputError);
  }
}

}  // namespace
}  // namespace simpo::fused
