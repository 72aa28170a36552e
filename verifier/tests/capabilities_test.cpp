// Declared capabilities (SPEC "External implementations"): parsing names the bad key, a declaration excludes the
// drawn cases outside it (counted by key, never judged), the exec: handshake holds a program to its answer and
// an older program to all of SPEC, the nan convention is judged as such, and the determinism property holds a
// declared-deterministic implementation to identical bits.
#include "verifier/capabilities.h"
#include "verifier/exec_implementation.h"
#include "verifier/properties.h"

#include <gtest/gtest.h>

#include <cmath>

namespace simpo::verifier {
namespace {

#define EXPECT_CONTAINS(haystack, needle) EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

std::string error_of(const std::string& text) {
  try {
    (void)capabilities_from_json(text, "test");
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(Capabilities, ParsesEveryKey) {
  const Capabilities c = capabilities_from_json(
      R"({"dtypes": ["bf16", "f32"], "bias": false, "label_smoothing": true, "empty_sequence": ["nan"],
          "invalid_inputs": "unchecked", "max_shape": {"B": 8, "V": 1000}, "deterministic": false})",
      "test");
  EXPECT_EQ(c.dtypes->size(), 2u);
  EXPECT_FALSE(*c.bias);
  EXPECT_TRUE(*c.label_smoothing);
  EXPECT_TRUE(c.declares_empty_sequence("nan"));
  EXPECT_FALSE(c.declares_empty_sequence("error"));
  EXPECT_EQ(*c.invalid_inputs, "unchecked");
  EXPECT_EQ(*c.max_B, 8);
  EXPECT_FALSE(c.max_T.has_value());
  EXPECT_EQ(*c.max_V, 1000);
  EXPECT_FALSE(c.is_deterministic());
  // Round trip.
  const Capabilities again = capabilities_from_json(c.to_json(), "round trip");
  EXPECT_EQ(again.to_json(), c.to_json());
  EXPECT_TRUE(capabilities_from_json("{}", "test").all_of_spec());
}

TEST(Capabilities, MalformedNamesTheKey) {
  EXPECT_CONTAINS(error_of(R"({"dtype": ["bf16"]})"), "unknown capabilities key \"dtype\"");
  EXPECT_CONTAINS(error_of(R"({"dtypes": ["fp8"]})"), "\"dtypes\"");
  EXPECT_CONTAINS(error_of(R"({"dtypes": "bf16"})"), "\"dtypes\"");
  EXPECT_CONTAINS(error_of(R"({"bias": "yes"})"), "\"bias\"");
  EXPECT_CONTAINS(error_of(R"({"empty_sequence": ["inf"]})"), "\"empty_sequence\"");
  EXPECT_CONTAINS(error_of(R"({"invalid_inputs": "maybe"})"), "\"invalid_inputs\"");
  EXPECT_CONTAINS(error_of(R"({"max_shape": {"B": 0}})"), "\"max_shape.B\"");
  EXPECT_CONTAINS(error_of(R"({"max_shape": {"N": 4}})"), "\"max_shape\"");
  EXPECT_CONTAINS(error_of(R"({"deterministic": 1})"), "\"deterministic\"");
  EXPECT_CONTAINS(error_of("[1, 2]"), "must be a JSON object");
}

Problem problem_of(CaseSpec spec) { return generate(spec); }

TEST(Capabilities, ExclusionByKey) {
  CaseSpec spec;
  spec.shape = {4, 3, 8, 16};
  spec.seed = 1;
  spec.ignore = IgnorePattern::none;
  const Problem plain = problem_of(spec);
  EXPECT_FALSE(exclusion(Capabilities{}, plain));
  Capabilities c;
  c.dtypes = std::vector<std::string>{"f32"};  // the case is bf16 (CaseSpec's default)
  EXPECT_EQ(exclusion(c, plain), "dtypes");
  spec.dtype = DType::F32;
  EXPECT_FALSE(exclusion(c, problem_of(spec))) << "an f32 case is what f32 declares";
  spec.dtype = DType::BF16;
  c = {};
  c.max_V = 15;
  EXPECT_EQ(exclusion(c, plain), "max_shape");
  c.max_V = 16;
  EXPECT_FALSE(exclusion(c, plain));
  c = {};
  c.bias = false;
  spec.bias = true;
  EXPECT_EQ(exclusion(c, problem_of(spec)), "bias");
  spec.bias = false;
  c = {};
  c.label_smoothing = false;
  spec.hp.label_smoothing = 0.1;
  EXPECT_EQ(exclusion(c, problem_of(spec)), "label_smoothing");
  spec.hp.label_smoothing = 0;
  // Empty sequences: zero needs "zero"; SPEC's error needs "error" or "nan".
  spec.ignore = IgnorePattern::empty_sequence;
  const Problem empty_error = problem_of(spec);
  spec.hp.empty_sequence = EmptySequence::zero;
  const Problem empty_zero = problem_of(spec);
  ASSERT_TRUE(has_empty_sequence(empty_error));
  c = {};
  c.empty_sequence = std::vector<std::string>{"nan"};
  EXPECT_FALSE(exclusion(c, empty_error));
  EXPECT_EQ(exclusion(c, empty_zero), "empty_sequence");
  EXPECT_FALSE(exclusion(c, plain));  // no empty sequence: the convention does not matter
  c.empty_sequence = std::vector<std::string>{"zero"};
  EXPECT_EQ(exclusion(c, empty_error), "empty_sequence");
  EXPECT_FALSE(exclusion(c, empty_zero));
}

// A correct implementation that computes outputs for an empty sequence with a NaN loss (the peers' convention).
Implementation nan_convention(bool nan) {
  const Implementation cpu = fused_implementation(fused::Backend::cpu);
  Implementation impl = make_implementation("nan_convention", [cpu, nan](const Problem& p, const RunOptions& run) {
    if (!has_empty_sequence(p) || p.hp.empty_sequence == EmptySequence::zero) return cpu.compute(p, run);
    Problem zero = p;
    zero.hp.empty_sequence = EmptySequence::zero;
    TensorMap out;
    try {
      out = cpu.compute(zero, run);
    } catch (const InputError&) {  // no chosen completion token: the NLL is 0/0 too
      zero.hp.compute_nll_loss = false;
      out = cpu.compute(zero, run);
    }
    if (nan) out.at(output_name::loss).as<float>()[0] = NAN;
    return out;
  });
  Capabilities c;
  c.empty_sequence = std::vector<std::string>{"nan"};
  impl.capabilities = [c] { return c; };
  return impl;
}

TEST(Capabilities, NanConventionIsJudgedAsDeclared) {
  SweepOptions options;
  options.max_cases = 200;
  options.time_budget_s = 0;
  options.seed = 7;
  options.threads = 1;
  const SweepResult good = run_sweep(nan_convention(true), options);
  EXPECT_TRUE(good.failures.empty()) << format_sweep(good, "nan_convention");
  EXPECT_GT(good.excluded.at("empty_sequence"), 0);  // empty_sequence = zero cases: not declared
  // Returning a finite loss where it declared NaN fails, as does SPEC's refusal.
  options.stop_at_first_failure = true;
  options.shrink = false;
  const SweepResult finite = run_sweep(nan_convention(false), options);
  ASSERT_FALSE(finite.failures.empty());
  EXPECT_EQ(finite.failures[0].outcome.property, "valid_input_agrees");
  EXPECT_CONTAINS(finite.failures[0].outcome.detail, "declares the nan convention");
  Implementation cpu = fused_implementation(fused::Backend::cpu);
  cpu.capabilities = nan_convention(true).capabilities;
  const SweepResult refuses = run_sweep(cpu, options);
  ASSERT_FALSE(refuses.failures.empty());
  EXPECT_CONTAINS(refuses.failures[0].outcome.detail, "refused the input");
  // Both conventions declared: SPEC's refusal and NaN outputs both pass.
  Capabilities both;
  both.empty_sequence = std::vector<std::string>{"error", "nan"};
  cpu.capabilities = [both] { return both; };
  Implementation nan_both = nan_convention(true);
  nan_both.capabilities = cpu.capabilities;
  options.stop_at_first_failure = false;
  EXPECT_TRUE(run_sweep(cpu, options).failures.empty());
  EXPECT_TRUE(run_sweep(nan_both, options).failures.empty());
}

TEST(Capabilities, ExcludedCasesAreCountedNeverJudged) {
  SweepOptions options;
  options.max_cases = 100;
  options.time_budget_s = 0;
  options.threads = 1;
  Implementation cpu = fused_implementation(fused::Backend::cpu);
  Capabilities c;
  c.bias = false;
  c.label_smoothing = false;
  cpu.capabilities = [c] { return c; };
  const SweepResult r = run_sweep(cpu, options);
  const SweepResult all = run_sweep(fused_implementation(fused::Backend::cpu), options);
  EXPECT_EQ(r.cases, 100);
  EXPECT_GT(r.excluded.at("bias"), 20);
  EXPECT_GT(r.excluded.at("label_smoothing"), 5);
  EXPECT_EQ(r.passed.at("valid_input_agrees") + r.excluded_cases(), all.passed.at("valid_input_agrees"));
  EXPECT_CONTAINS(format_sweep(r, "cpu"), "excluded by the declaration");
  c = {};
  c.dtypes = std::vector<std::string>{"f16"};
  cpu.capabilities = [c] { return c; };
  EXPECT_EQ(run_sweep(cpu, options).excluded.at("dtypes"), 100);
}

TEST(Determinism, OurCpuBackendIsDeclaredAndPasses) {
  const Implementation cpu = fused_implementation(fused::Backend::cpu);
  EXPECT_TRUE(cpu.declared().is_deterministic());
  EXPECT_TRUE(reference_implementation().declared().is_deterministic());
  SweepOptions options;
  options.max_cases = 150;
  options.time_budget_s = 0;
  const SweepResult r = run_sweep(cpu, options);
  EXPECT_TRUE(r.failures.empty()) << format_sweep(r, "cpu");
  EXPECT_GT(r.passed.at("deterministic"), 100);
  for (const auto& [tensor, f] : r.spread) EXPECT_EQ(f.cases_differing, 0) << tensor;
}

// One ulp in one element of grad_x on every other run.
Implementation flips_one_ulp(bool declared_deterministic) {
  const Implementation cpu = fused_implementation(fused::Backend::cpu);
  auto calls = std::make_shared<int>(0);
  Implementation impl = make_implementation("flips_one_ulp", [cpu, calls](const Problem& p, const RunOptions& run) {
    TensorMap out = cpu.compute(p, run);
    auto it = out.find(output_name::grad_x);
    if (it != out.end() && (++*calls % 2) == 0) it->second.bytes[0] ^= std::byte{1};  // the lowest mantissa bit of element 0
    return out;
  });
  Capabilities c;
  c.deterministic = declared_deterministic;
  impl.capabilities = [c] { return c; };
  return impl;
}

TEST(Determinism, APlantedOneUlpDifferenceIsFound) {
  SweepOptions options;
  options.max_cases = 30;
  options.time_budget_s = 0;
  options.threads = 1;
  options.shrink = false;
  const SweepResult declared = run_sweep(flips_one_ulp(true), options);
  ASSERT_GT(declared.failed.count("deterministic"), 0u) << format_sweep(declared, "flips_one_ulp");
  EXPECT_GT(declared.failed.at("deterministic"), 0);
  // Not declared: a finding in the report, never a failure.
  const SweepResult undeclared = run_sweep(flips_one_ulp(false), options);
  EXPECT_EQ(undeclared.failed.count("deterministic"), 0u);
  ASSERT_TRUE(undeclared.spread.count(output_name::grad_x));
  EXPECT_GT(undeclared.spread.at(output_name::grad_x).cases_differing, 0);
  EXPECT_EQ(undeclared.spread.at(output_name::grad_x).max_elements_differing, 1);
  EXPECT_CONTAINS(format_sweep(undeclared, "flips_one_ulp"), "not declared deterministic: a finding");
}

#ifdef SIMPO_VERIFY_CLI
// The handshake: a program that declares is held to it; an older one (answers {"ok": false} to it, or dies on it)
// is held to all of SPEC and still runs every case.
const std::string compute_with_cli = std::string(SIMPO_VERIFY_CLI) + " compute --impl cpu --inputs \"$i\" --out \"$o\"";
const std::string read_paths = R"sh(i=$(echo "$l" | sed 's/.*"inputs":"\([^"]*\)".*/\1/'); o=$(echo "$l" | sed 's/.*"outputs":"\([^"]*\)".*/\1/'); )sh";

std::string persistent_program(const std::string& on_capabilities) {
  return "while read l; do case \"$l\" in *capabilities*) " + on_capabilities + " ;; *) " + read_paths +
         compute_with_cli + " 2>/dev/null && echo '{\"ok\": true}' ;; esac; done";
}

TEST(Exec, CapabilitiesHandshake) {
  const Implementation declaring =
      exec_implementation(persistent_program(R"(echo '{"ok": true, "capabilities": {"bias": false, "deterministic": true}}')"));
  const Capabilities c = declaring.declared();
  EXPECT_FALSE(*c.bias);
  EXPECT_TRUE(c.is_deterministic());
  const Implementation older = exec_implementation(persistent_program(R"(echo '{"ok": false, "error": "no inputs"}')"));
  EXPECT_TRUE(older.declared().all_of_spec());
  const Implementation dies = exec_implementation(persistent_program("exit 3"));
  EXPECT_TRUE(dies.declared().all_of_spec());
  CaseSpec spec;
  spec.shape = {2, 2, 3, 4};
  EXPECT_NO_THROW((void)dies.compute(generate(spec), RunOptions{}));  // restarted for the first case
  const Implementation malformed =
      exec_implementation(persistent_program(R"(echo '{"ok": true, "capabilities": {"dtypes": "bf16"}}')"));
  EXPECT_THROW((void)malformed.declared(), InputError);
  // --capabilities overrides: a one-shot program is asked nothing.
  ImplementationOptions options;
  options.capabilities = capabilities_from_json(R"({"label_smoothing": false})", "test");
  const Implementation one_shot = exec_implementation("true {inputs}", options);
  EXPECT_FALSE(*one_shot.declared().label_smoothing);
  EXPECT_TRUE(exec_implementation("true {inputs}").declared().all_of_spec());
}
#endif

}  // namespace
}  // namespace simpo::verifier
