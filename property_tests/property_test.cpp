// The properties of verifier/properties.h, checked by rapidcheck on the fused cpu backend (and the reference,
// which must satisfy them too). A failing case shrinks, is written as an inputs file under
// $SIMPO_COUNTEREXAMPLE_DIR (default: ./counterexamples), and the failure message prints the replay commands.
#include "property_tests/case_generator.h"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cstdlib>
#include <string>

namespace simpo::property_tests {
namespace {

std::string counterexample_dir() {
  const char* dir = std::getenv("SIMPO_COUNTEREXAMPLE_DIR");
  return dir && *dir ? dir : "counterexamples";
}

// Checks one property (after valid_input_agrees, which decides whether there is anything to compare) and turns
// a failure into a rapidcheck failure with the replay commands. Each failing attempt overwrites the same file,
// so after shrinking it holds the minimal case.
void expect_property(const verifier::Case& c, const verifier::Implementation& impl, const std::string& property) {
  // rapidcheck prints the distribution of these tags after the run: evidence the cases cover what they should.
  const auto& s = c.spec.shape;
  const std::int64_t work = s.N() * s.H * s.V;
  RC_TAG(work < 10'000 ? "N*H*V < 1e4" : work < 1'000'000 ? "N*H*V < 1e6" : "N*H*V >= 1e6");
  RC_TAG(ignore_pattern_name(c.spec.ignore));
  const auto outcomes = verifier::check_case(c, impl, {"valid_input_agrees", property});
  for (const auto& o : outcomes) {
    if (o.passed) continue;
    const std::string path = counterexample_dir() + "/" + impl.name + "-" + o.property + ".inputs.safetensors";
    const std::string replay = verifier::write_counterexample(c, impl.name, path);
    RC_FAIL(o.property + " failed on " + c.to_string() + ": " + o.detail + "\ninputs: " + path + "\nreplay:\n" + replay);
  }
}

const verifier::Implementation& cpu() {
  static const verifier::Implementation impl = verifier::fused_implementation(fused::Backend::cpu);
  return impl;
}

RC_GTEST_PROP(FusedCpu, MatchesReferenceUnderStrict, ()) { expect_property(*gen_case(), cpu(), "matches_reference"); }
RC_GTEST_PROP(FusedCpu, ChunkingChangesNothingBeyondFp32Noise, ()) {
  expect_property(*gen_case(), cpu(), "chunking_invariant");
}
RC_GTEST_PROP(FusedCpu, IgnoredRowsOfGradXAreExactlyZero, ()) { expect_property(*gen_case(), cpu(), "ignored_rows_zero"); }
RC_GTEST_PROP(FusedCpu, DuplicatingPairsKeepsLossAndHalvesGradients, ()) {
  expect_property(*gen_case(), cpu(), "duplicate_pairs");
}
RC_GTEST_PROP(FusedCpu, LossOnlyAgreesWithFull, ()) { expect_property(*gen_case(), cpu(), "loss_only_agrees"); }

// SPEC's other input dtypes: every property on f16 and f32 inputs (gradients in that dtype, judged against bounds
// for it; the run-to-run properties allow f16's subnormal rounding).
RC_GTEST_PROP(FusedCpu, EveryPropertyHoldsForF16AndF32Inputs, ()) {
  verifier::CaseDistribution d;
  d.dtypes = {DType::F16, DType::F32};
  const verifier::Case c = *gen_case(d);
  RC_TAG(input_dtype_name(c.spec.dtype));
  for (const char* p : {"matches_reference", "chunking_invariant", "ignored_rows_zero", "duplicate_pairs", "loss_only_agrees"})
    expect_property(c, cpu(), p);
}

// The same invariances hold for the oracle itself (its chunk size plays max_chunk_rows).
RC_GTEST_PROP(Reference, SatisfiesTheInvariances, ()) {
  const auto c = *gen_case();
  for (const char* p : {"chunking_invariant", "ignored_rows_zero", "duplicate_pairs", "loss_only_agrees"})
    expect_property(c, verifier::reference_implementation(), p);
}

// SPEC's error for a sequence with no completion token: every implementation raises it (unless
// empty_sequence = zero), naming the sequence.
RC_GTEST_PROP(FusedCpu, EmptySequenceIsTheSpecError, ()) {
  verifier::Case c = *gen_case();
  c.spec.ignore = IgnorePattern::empty_sequence;
  c.spec.hp.empty_sequence = EmptySequence::error;
  const Problem p = generate(c.spec);
  try {
    (void)cpu().compute(p, c.run_options());
  } catch (const InputError& e) {
    RC_ASSERT(std::string(e.what()).find("no completion token") != std::string::npos);
    return;
  }
  RC_FAIL("no InputError for a sequence with no completion token: " + c.to_string());
}

}  // namespace
}  // namespace simpo::property_tests
