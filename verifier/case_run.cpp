#include "verifier/case_run.h"

#include "reference/reference.h"

#include <chrono>
#include <stdexcept>

namespace simpo::verifier {

CaseRun::CaseRun(const Case& c, const Implementation& impl, const Profile& profile)
    : case_(c), impl_(impl), profile_(profile), declared_(impl.declared()) {}

bool CaseRun::judged_as_nan_convention() {
  return declared_.declares_empty_sequence("nan") && problem().hp.empty_sequence == EmptySequence::error &&
         has_empty_sequence(problem());
}

std::optional<std::string> CaseRun::excluded_by() {
  if (auto key = exclusion(declared_, problem())) return key;
  if (declared_.invalid_inputs == "unchecked" && !judged_as_nan_convention() && spec_rejects()) return "invalid_inputs";
  return std::nullopt;
}

const Problem& CaseRun::problem() {
  if (!problem_) problem_ = generate(case_.spec);
  return *problem_;
}

const ProblemScales& CaseRun::scales() {
  if (!scales_) scales_ = spec_rejects() ? ProblemScales::of(problem()) : ProblemScales::of(problem(), &exact(), &off_target_);
  return *scales_;
}

const ProblemScales& CaseRun::scales_for(const Profile& profile) {
  scales();
  if (!spec_rejects()) scales_->prepare_for(profile, problem(), exact());
  return *scales_;
}

bool CaseRun::spec_rejects() {
  if (!reference_ran_) {
    reference_ran_ = true;
    try {
      // The oracle, with the by-product the error model needs (so the scales cost O(N), not O(N H V)).
      reference::Options options;
      options.off_target = &off_target_;
      exact_ = reference::compute(problem(), options);
    } catch (const InputError& e) {
      spec_error_ = e.what();
    }
  }
  return spec_error_.has_value();
}

const std::string& CaseRun::spec_error() {
  spec_rejects();
  static const std::string none;
  return spec_error_ ? *spec_error_ : none;
}

const TensorMap& CaseRun::exact() {
  if (spec_rejects()) throw std::logic_error("CaseRun::exact on an input SPEC rejects");
  return *exact_;
}

const TensorMap& CaseRun::candidate() {
  if (!candidate_) {
    const auto start = std::chrono::steady_clock::now();
    candidate_ = run(problem(), case_.run_options());
    candidate_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return *candidate_;
}

TensorMap CaseRun::run(const Problem& p, const RunOptions& options) const { return impl_.compute(p, options); }

}  // namespace simpo::verifier
