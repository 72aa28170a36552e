// The sweep: random cases from the one distribution (case.h), each checked by check_case (properties.h), a
// failing case shrunk and written as a counterexample file. A library function (implementation + options ->
// result) so the CLI, the ctests and other front ends (the python binding) drive it the same way.
#pragma once

#include "verifier/properties.h"

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace simpo::verifier {

struct SweepOptions {
  std::uint64_t seed = 20260101;
  std::int64_t max_cases = 0;     // 0: no limit
  double time_budget_s = 60;      // 0: no limit (then max_cases must be set)
  bool stop_at_first_failure = false;
  bool shrink = true;
  std::string counterexample_dir; // empty: write no files
  Profile profile = strict_profile();  // what matches_reference judges with
  // Further profiles under which every judged case's outputs are compared too (no extra run): the report's one
  // row per profile (SweepResult::by_profile). The sweep's own profile is always among the rows.
  std::vector<Profile> also_profiles;
  CaseDistribution distribution;       // narrowings of the case distribution (case.h); default: none
  int shrink_attempts = 300;
  double shrink_seconds = 120;       // per counterexample (an external program that hangs costs a timeout per try)
  // Cases judged at once, on as many threads, when the implementation allows it (Implementation::concurrent);
  // 0: one per hardware thread. Cases are drawn in order and their outcomes taken in order, so the result of a
  // sweep of N cases does not depend on this (a time budget reaches a different N, as it always did).
  int threads = 0;
  std::function<void(std::int64_t cases, std::int64_t failures, double seconds)> progress;  // ~every second
};

struct Counterexample {
  std::int64_t case_index = 0;
  Case original, shrunk;
  Outcome outcome;          // on the shrunk case
  std::string inputs_path;  // empty when not written
  std::string replay;       // commands that replay it
};

// The determinism property's run-to-run difference of one output tensor over a sweep.
struct SpreadFinding {
  std::int64_t cases_compared = 0, cases_differing = 0;
  std::int64_t max_elements_differing = 0;
  double max_abs = 0, max_rel = 0;  // largest |run1 - run2| and ||run1 - run2|| / ||run1|| over the cases
  std::int64_t first_case = -1;     // the first case where the runs differed
};

// matches_reference under one profile, on every judged case's outputs.
struct ProfileTally {
  std::int64_t passed = 0, failed = 0;
  std::vector<Counterexample> first_failure;     // the first failing case (unshrunk), at most one
  std::vector<Counterexample> smallest_failure;  // the failing case of fewest N H V (unshrunk), at most one
};

struct SweepResult {
  std::int64_t cases = 0;  // drawn, excluded ones included
  double seconds = 0;
  Capabilities declared;   // what the implementation declared (capabilities.h)
  std::map<std::string, std::int64_t> excluded;  // drawn cases outside the declaration, by the key that excluded them
  std::int64_t excluded_cases() const;
  std::map<std::string, std::int64_t> passed, failed, skipped;  // by property
  std::vector<Counterexample> failures;
  std::map<std::string, double> worst_margin;  // by output tensor, over matches_reference checks that passed
  std::map<std::string, Case> worst_margin_case;  // the case where each worst margin was reached
  std::map<std::string, SpreadFinding> spread;  // by output tensor: the determinism property's findings
  std::map<std::string, ProfileTally> by_profile;  // by profile name: the sweep's profile and also_profiles
  double candidate_seconds = 0;  // time inside the implementation's first run of each judged case
  std::int64_t candidate_runs = 0;
};

// InputError when neither a case count nor a time budget bounds it.
SweepResult run_sweep(const Implementation&, const SweepOptions&);

// The per-property table (passed / failed / skipped), the exclusions by declared key, the run-to-run spread of an
// implementation not declared deterministic, the per-profile rows when there are several, then each counterexample with its shrunk case and replay
// commands; what `simpo-verify sweep` and the main job print.
std::string format_sweep(const SweepResult&, const std::string& impl);

}  // namespace simpo::verifier
