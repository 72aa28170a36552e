#include "verifier/check.h"

#include "problem/problem_io.h"
#include "reference/reference.h"

namespace simpo::verifier {

TensorMap reference_outputs_for(const Problem& problem, bool gradients, const std::string& path,
                                const std::function<void(double)>& progress, reference::OffTargetSoftmax* off_target) {
  if (path.empty()) {
    reference::Options options;
    options.gradients = gradients;
    options.progress = progress;
    options.off_target = off_target;
    return reference::compute(problem, options);
  }
  validate(problem);  // SPEC's verdict on the inputs comes first, as when computing
  TensorMap stored = load_outputs(path);
  TensorMap exact;
  for (const auto& name : all_output_names()) {
    const bool expected = name == output_name::grad_bias ? gradients && problem.has_bias()
                                                         : !is_gradient_output(name) || gradients;
    if (!expected) continue;
    auto it = stored.find(name);
    if (it == stored.end())
      throw InputError("--reference-outputs " + path + ": no " + name + " (needed for " + problem.shape.to_string() +
                       (problem.has_bias() ? " with bias" : "") + ")");
    if (it->second.dtype != DType::F64)
      throw InputError("--reference-outputs " + path + ": " + name + " is " + dtype_name(it->second.dtype) +
                       ", not F64: not a float64 reference's outputs");
    if (it->second.shape != output_shape(problem.shape, name))
      throw InputError("--reference-outputs " + path + ": " + name + " has shape " + shape_string(it->second.shape) +
                       ", but the inputs (" + problem.shape.to_string() + ") give it " +
                       shape_string(output_shape(problem.shape, name)) + ": outputs of another inputs file?");
    exact.emplace(name, std::move(it->second));
  }
  return exact;
}

Report check_candidate_file(const ProblemScales& scales, const TensorMap& exact, const std::string& candidate_path,
                            const Profile& profile) {
  return compare(scales, exact, load_outputs(candidate_path), profile);
}

}  // namespace simpo::verifier
