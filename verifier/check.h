// `simpo-verify check` as a library: the reference outputs for an inputs file (computed, or read from a file
// already on disk), and one candidate outputs file judged against them. Several candidates of one inputs file
// share one reference run. The fuzz harness and the python binding call these too.
#pragma once

#include "verifier/error_model.h"

#include <functional>
#include <string>

namespace simpo::verifier {

// The reference's outputs for `problem`: read from `reference_outputs_path` when it is not empty (a fixture's
// reference file, or one `compute --impl reference` wrote), which must hold every output SPEC gives this problem
// (gradients only when `gradients`; extra gradients are dropped when not) as F64 of SPEC's shapes, else an
// InputError naming what is wrong; otherwise computed by the float64 reference. `progress` may be empty;
// `off_target`, when given, receives the computed reference's off-target softmax for ProblemScales::of (left
// empty when the outputs were read from a file).
TensorMap reference_outputs_for(const Problem&, bool gradients, const std::string& reference_outputs_path = "",
                                const std::function<void(double)>& progress = {},
                                reference::OffTargetSoftmax* off_target = nullptr);

// Judges the outputs file at `candidate_path` (InputError when it cannot be read as an outputs file).
Report check_candidate_file(const ProblemScales&, const TensorMap& exact, const std::string& candidate_path,
                            const Profile&);

}  // namespace simpo::verifier
