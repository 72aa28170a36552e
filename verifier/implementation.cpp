#include "verifier/implementation.h"

#include "reference/reference.h"

namespace simpo::verifier {

Implementation reference_implementation() {
  return {"reference", [](const Problem& problem, const RunOptions& run) {
            reference::Options options;
            options.gradients = run.gradients;
            options.chunk_rows = run.max_chunk_rows;
            return reference::compute(problem, options);
          }};
}

Implementation fused_implementation(fused::Backend backend, fused::Mutant mutant) {
  std::string name = fused::backend_name(backend);
  if (mutant != fused::Mutant::none) name.append("+").append(fused::mutant_name(mutant));  // (GCC 12 -Wrestrict misfires on "+" + string)
  return {name, [backend, mutant](const Problem& problem, const RunOptions& run) {
            fused::Options options;
            options.backend = backend;
            options.gradients = run.gradients;
            options.grad_weight_f32 = run.grad_f32;
            options.workspace_bytes = run.workspace_bytes;
            options.max_chunk_rows = run.max_chunk_rows;
            options.mutant = mutant;
            return fused::compute(problem, options);
          }};
}

std::vector<Implementation> available_implementations() {
  std::vector<Implementation> all = {reference_implementation(), fused_implementation(fused::Backend::cpu)};
  if (fused::cuda_available()) all.push_back(fused_implementation(fused::Backend::cuda));
  return all;
}

Implementation best_available() {
  return fused_implementation(fused::cuda_available() ? fused::Backend::cuda : fused::Backend::cpu);
}

Implementation implementation_by_name(const std::string& name) {
  if (name == "reference") return reference_implementation();
  if (name == "auto") return best_available();
  const auto plus = name.find('+');
  const fused::Backend backend = fused::backend_from_name(name.substr(0, plus));
  if (backend == fused::Backend::cuda && !fused::cuda_available())
    throw InputError("implementation \"" + name + "\": no CUDA device here (or the cuda backend was not built)");
  const fused::Mutant mutant =
      plus == std::string::npos ? fused::Mutant::none : fused::mutant_from_name(name.substr(plus + 1));
  return fused_implementation(fused::resolve(backend), mutant);
}

}  // namespace simpo::verifier
