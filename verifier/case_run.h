// One case's shared, lazily computed results: the problem, the float64 reference's outputs (or SPEC's refusal)
// and the candidate's outputs, so the properties of one case run the reference once.
#pragma once

#include "verifier/capabilities.h"
#include "verifier/case.h"
#include "verifier/error_model.h"

#include <map>
#include <optional>
#include <string>

namespace simpo::verifier {

class CaseRun {
 public:
  // `profile` is what matches_reference judges with (strict unless a sweep asks for another).
  CaseRun(const Case&, const Implementation&, const Profile& profile = strict_profile());
  const Profile& profile() const { return profile_; }
  const Case& test_case() const { return case_; }
  const Implementation& implementation() const { return impl_; }
  const Problem& problem();
  const ProblemScales& scales();
  const ProblemScales& scales_for(const Profile&);  // scales() with what the profile needs (bf16_logits: O(N H V))
  bool spec_rejects();                  // the reference raised InputError for this problem
  const std::string& spec_error();      // its message
  const TensorMap& exact();             // the reference outputs (only when !spec_rejects())
  const TensorMap& candidate();         // the implementation's outputs with the case's run options
  TensorMap run(const Problem&, const RunOptions&) const;
  std::optional<Report> strict_report;  // set by matches_reference

  // The implementation's declaration (asked once per implementation: Implementation::declared).
  const Capabilities& declared() const { return declared_; }
  // The capabilities key that excludes this case from judging, or nothing (capabilities.h: exclusion, and
  // invalid_inputs = unchecked for an input SPEC rejects that is not judged as the NaN convention).
  std::optional<std::string> excluded_by();
  // The problem has a sequence with no completion token, SPEC says error, and the implementation declares the
  // NaN convention: valid_input_agrees then requires outputs with a NaN loss (or the refusal, where "error" is
  // declared too).
  bool judged_as_nan_convention();

  // Set by the determinism property: run-to-run difference per tensor of two runs on the same inputs.
  struct Spread {
    std::int64_t elements_differing = 0;
    double max_abs = 0;  // largest |run1 - run2|
    double rel = 0;      // ||run1 - run2|| / ||run1||
  };
  std::optional<std::map<std::string, Spread>> spread;
  double candidate_seconds = 0;  // wall time of candidate()'s run (0 until it ran)

 private:
  Case case_;
  Implementation impl_;
  Profile profile_;
  Capabilities declared_;
  std::optional<Problem> problem_;
  std::optional<ProblemScales> scales_;
  std::optional<TensorMap> exact_, candidate_;
  reference::OffTargetSoftmax off_target_;
  std::optional<std::string> spec_error_;
  bool reference_ran_ = false;
};

}  // namespace simpo::verifier
