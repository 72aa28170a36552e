// The properties every correct implementation of SPEC has, checked on generated cases. One definition serves
// the `simpo-verify` sweep, `simpo-verify mutants` and the rapidcheck tests in property_tests/:
//   valid_input_agrees   an input SPEC rejects (e.g. a sequence with no completion token) is an InputError for
//                        the candidate too, and one SPEC accepts is not
//   matches_reference    every output passes the strict error model against the float64 reference
//   chunking_invariant   the workspace budget / max_chunk_rows changes nothing beyond fp32 noise
//   ignored_rows_zero    grad_x rows at ignored positions are exactly zero
//   duplicate_pairs      duplicating every pair leaves the loss unchanged and halves each copy's gradient
//   loss_only_agrees     the forward-only run gives the full run's forward outputs
#pragma once

#include "problem/generate.h"
#include "verifier/error_model.h"
#include "verifier/implementation.h"

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace simpo::verifier {

// A generated case: the problem (a CaseSpec, deterministic in itself) and how the implementation is run.
struct Case {
  CaseSpec spec;
  std::int64_t max_chunk_rows = 0;
  std::int64_t workspace_bytes = fused::default_workspace_bytes;

  RunOptions run_options() const;
  std::string to_string() const;                             // one line: shape, hyperparameters, pattern, chunks
  std::string case_command(const std::string& impl) const;   // `simpo-verify case ...` that replays it
};

// The sweep's distribution over cases: mostly small (milliseconds each), shapes with primes and
// non-multiples of 8, every hyperparameter over SPEC's range, every ignore pattern, logit scales 0.1..30,
// and chunk caps that put boundaries in awkward places.
Case random_case(Rng&);

struct Outcome {
  bool passed = true;
  std::string property;
  std::string detail;  // why it failed
};

// Lazily computed results one case's properties share, so the reference runs once per case.
class CaseRun {
 public:
  CaseRun(const Case&, const Implementation&);
  const Case& test_case() const { return case_; }
  const Implementation& implementation() const { return impl_; }
  const Problem& problem();
  const ProblemScales& scales();
  bool spec_rejects();                  // the reference raised InputError for this problem
  const std::string& spec_error();      // its message
  const TensorMap& exact();             // the reference outputs (only when !spec_rejects())
  const TensorMap& candidate();         // the implementation's outputs with the case's run options
  TensorMap run(const Problem&, const RunOptions&) const;
  std::optional<Report> strict_report;  // set by matches_reference

 private:
  Case case_;
  Implementation impl_;
  std::optional<Problem> problem_;
  std::optional<ProblemScales> scales_;
  std::optional<TensorMap> exact_, candidate_;
  std::optional<std::string> spec_error_;
  bool reference_ran_ = false;
};

struct Property {
  std::string name;
  std::string claim;
  std::function<Outcome(CaseRun&)> check;
};
const std::vector<Property>& all_properties();
const Property& property_by_name(const std::string&);  // InputError for an unknown name

// Runs the properties (all, or those named) on one case, stopping at the first failure when asked.
std::vector<Outcome> check_case(const Case&, const Implementation&, const std::vector<std::string>& only = {},
                                bool stop_at_first_failure = false);

// Greedy shrinking for the sweep (the rapidcheck tests use rapidcheck's own): try smaller shapes, default
// hyperparameters, no bias, no ignore pattern, no chunk cap, other seeds, keeping each change under which
// `property` still fails on `impl`; at most `max_attempts` runs.
Case shrink(const Case&, const Implementation&, const std::string& property, int max_attempts = 300);

// Writes the case's inputs file (replayable with `simpo-verify check`) and returns the replay commands.
std::string write_counterexample(const Case&, const std::string& impl, const std::string& path);

// Two runs of fp32-accumulating code that differ only in summation order and chunking agree: scalars and
// per-pair outputs within twice their strict tolerance (fp32 noise); gradients within twice the internal error
// budget (gradient_internal_error) plus the output-rounding flips it can cause. Returns what differs, or nothing.
std::optional<std::string> disagreement(const ProblemScales&, const std::string& name, const Tensor& a,
                                        const Tensor& b);

struct SweepOptions {
  std::uint64_t seed = 20260101;
  std::int64_t max_cases = 0;     // 0: no limit
  double time_budget_s = 60;      // 0: no limit (then max_cases must be set)
  bool stop_at_first_failure = false;
  bool shrink = true;
  std::string counterexample_dir; // empty: write no files
  std::function<void(std::int64_t cases, std::int64_t failures, double seconds)> progress;  // ~every second
};

struct Counterexample {
  std::int64_t case_index = 0;
  Case original, shrunk;
  Outcome outcome;          // on the shrunk case
  std::string inputs_path;  // empty when not written
  std::string replay;       // commands that replay it
};

struct SweepResult {
  std::int64_t cases = 0;
  double seconds = 0;
  std::map<std::string, std::int64_t> passed, failed;  // by property
  std::vector<Counterexample> failures;
  std::map<std::string, double> worst_margin;  // by output tensor, over matches_reference checks that passed
};

SweepResult run_sweep(const Implementation&, const SweepOptions&);

}  // namespace simpo::verifier
