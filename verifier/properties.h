// The properties every correct implementation of SPEC has, checked on generated cases. One definition serves
// the `simpo-verify` sweep, `simpo-verify mutants` and the rapidcheck tests in property_tests/:
//   valid_input_agrees   an input SPEC rejects (e.g. a sequence with no completion token) is an InputError for
//                        the candidate too, and one SPEC accepts is not
//   matches_reference    every output passes the strict error model (or the sweep's profile) against the reference
//   chunking_invariant   the workspace budget / max_chunk_rows changes nothing beyond fp32 noise (skipped for
//                        an implementation that cannot be given them: an external program)
//   ignored_rows_zero    grad_x rows at ignored positions are exactly zero
//   duplicate_pairs      duplicating every pair leaves the loss unchanged and halves each copy's gradient
//   loss_only_agrees     the forward-only run gives the full run's forward outputs
//   deterministic        a second run on the same inputs gives the same bits: required where the implementation
//                        declares it (capabilities.h), otherwise its spread is recorded as a finding (CaseRun::spread)
//
// A case outside the implementation's declared capabilities is not judged at all (check_case returns no outcome).
//
// The verifier's pieces, one header each (this one includes them all):
//   case.h            a case, its fields, the one case distribution     case_run.h   one case's shared results
//   properties.h      the seven properties and the per-case check        shrink.h     greedy shrinking
//   counterexample.h  counterexample files and replay commands           sweep.h      the sweep loop
#pragma once

#include "verifier/case.h"
#include "verifier/case_run.h"
#include "verifier/error_model.h"
#include "verifier/implementation.h"

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace simpo::verifier {

struct Outcome {
  bool passed = true;
  std::string property;
  std::string detail;    // why it failed, or why it was skipped
  bool skipped = false;  // the implementation cannot be given what the property varies (passed stays true)
};

struct Property {
  std::string name;
  std::string claim;
  std::function<Outcome(CaseRun&)> check;
  bool needs_chunking = false;  // varies max_chunk_rows / workspace: skipped unless Implementation::takes_chunking
};
const std::vector<Property>& all_properties();
const Property& property_by_name(const std::string&);  // InputError for an unknown name

// The per-case check, used by the sweep, the shrinker and the rapidcheck tests alike: runs the properties (all,
// or those named) on one case, in all_properties() order. A property that throws fails with the message; an
// ImplementationFault (what an external program did instead of answering) also ends the case, so a program that
// hangs costs one case timeout per case, not one per property. Stops after valid_input_agrees when SPEC rejects
// the input (nothing more to compare), and at the first failure when asked.
std::vector<Outcome> check_case(CaseRun&, const std::vector<std::string>& only = {}, bool stop_at_first_failure = false);
std::vector<Outcome> check_case(const Case&, const Implementation&, const std::vector<std::string>& only = {},
                                bool stop_at_first_failure = false, const Profile& = strict_profile());

// Two runs of fp32-accumulating code that differ only in summation order and chunking agree: scalars and
// per-pair outputs within twice their strict tolerance (fp32 noise); gradients within twice the internal error
// budget (gradient_internal_error) plus the output-rounding flips it can cause. Returns what differs, or nothing.
std::optional<std::string> disagreement(const ProblemScales&, const std::string& name, const Tensor& a,
                                        const Tensor& b);

}  // namespace simpo::verifier

#include "verifier/counterexample.h"
#include "verifier/shrink.h"
#include "verifier/sweep.h"
