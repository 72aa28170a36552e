// One case's shared, lazily computed results: the problem, the float64 reference's outputs (or SPEC's refusal)
// and the candidate's outputs, so the properties of one case run the reference once.
#pragma once

#include "verifier/case.h"
#include "verifier/error_model.h"

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
  bool spec_rejects();                  // the reference raised InputError for this problem
  const std::string& spec_error();      // its message
  const TensorMap& exact();             // the reference outputs (only when !spec_rejects())
  const TensorMap& candidate();         // the implementation's outputs with the case's run options
  TensorMap run(const Problem&, const RunOptions&) const;
  std::optional<Report> strict_report;  // set by matches_reference

 private:
  Case case_;
  Implementation impl_;
  Profile profile_;
  std::optional<Problem> problem_;
  std::optional<ProblemScales> scales_;
  std::optional<TensorMap> exact_, candidate_;
  reference::OffTargetSoftmax off_target_;
  std::optional<std::string> spec_error_;
  bool reference_ran_ = false;
};

}  // namespace simpo::verifier
