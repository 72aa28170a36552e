#include "verifier/implementation.h"

#include "fused/vocab_parallel/vocab_parallel.h"
#include "reference/reference.h"
#include "verifier/exec_implementation.h"

#include <cctype>
#include <cmath>

namespace simpo::verifier {

namespace {
// Our implementations compute all of SPEC and fix their summation order (no atomics, chunks reduced in order):
// the same inputs give the same bits (the determinism property holds them to it).
Capabilities deterministic_declaration() {
  Capabilities c;
  c.deterministic = true;
  return c;
}
}  // namespace

void validate(const RunOptions& run) {
  if (run.max_chunk_rows < 0)
    throw InputError("--max-chunk-rows must be >= 0 (0 lets the implementation decide), got " +
                     std::to_string(run.max_chunk_rows));
  if (run.workspace_bytes <= 0)
    throw InputError("--workspace must be a positive number of bytes, got " + std::to_string(run.workspace_bytes));
}

void validate(const ImplementationOptions& options) {
  if (!(std::isfinite(options.case_timeout_s) && options.case_timeout_s > 0))
    throw InputError("--case-timeout must be a finite number of seconds > 0, got " + std::to_string(options.case_timeout_s));
}

Implementation make_implementation(std::string name, std::function<TensorMap(const Problem&, const RunOptions&)> compute,
                                   bool takes_chunking) {
  Implementation impl;
  impl.name = std::move(name);
  impl.takes_chunking = takes_chunking;
  impl.compute = [compute = std::move(compute)](const Problem& problem, const RunOptions& run) {
    validate(run);
    return compute(problem, run);
  };
  return impl;
}

Implementation reference_implementation() {
  Implementation impl = make_implementation("reference", [](const Problem& problem, const RunOptions& run) {
    reference::Options options;
    options.gradients = run.gradients;
    options.chunk_rows = run.max_chunk_rows;
    return reference::compute(problem, options);
  });
  impl.concurrent = true;
  impl.capabilities = deterministic_declaration;
  return impl;
}

fused::Options fused_options(fused::Backend backend, const RunOptions& run) {
  fused::Options options;
  options.backend = backend;
  options.gradients = run.gradients;
  options.grad_weight_f32 = run.grad_f32;
  options.workspace_bytes = run.workspace_bytes;
  options.max_chunk_rows = run.max_chunk_rows;
  options.validate = run.validate;
  return options;
}

Implementation fused_implementation(fused::Backend backend, fused::Mutant mutant) {
  std::string name = fused::backend_name(backend);
  if (mutant != fused::Mutant::none) {
    if (backend != fused::Backend::cpu)
      throw InputError("mutant " + fused::mutant_name(mutant) + " with the " + fused::backend_name(backend) +
                       " backend: mutants are planted in the cpu backend (cpu+" + fused::mutant_name(mutant) + ")");
    name.append("+").append(fused::mutant_name(mutant));  // (GCC 12 -Wrestrict misfires on "+" + string)
  }
  Implementation impl = make_implementation(name, [backend, mutant](const Problem& problem, const RunOptions& run) {
    if (mutant != fused::Mutant::none) return fused::compute_mutant(problem, fused_options(backend, run), mutant);
    return fused::compute(problem, fused_options(backend, run));
  });
  impl.concurrent = true;  // each call owns its buffers (and on cuda its stream)
  impl.capabilities = deterministic_declaration;
  impl.describe = [backend] { return fused::describe(backend); };
  return impl;
}

Implementation vocab_parallel_implementation(fused::Backend backend, int shards) {
  if (backend == fused::Backend::cuda) {
    // NCCL with one GPU per rank where there are enough, else the G ranks on one GPU (in-process collectives);
    // the name says which. InputError naming the problem where neither can run.
    const fused::vocab_parallel::CudaPlan plan = fused::vocab_parallel::plan_cuda(shards);
    const fused::vocab_parallel::Communication communication = plan.communication;
    Implementation impl = make_implementation(
        "cuda/vocab-shards=" + std::to_string(shards) + " (" + plan.description + ")",
        [shards, communication](const Problem& problem, const RunOptions& run) {
          return fused::vocab_parallel::gather(fused::vocab_parallel::compute_ranks_cuda(
              problem, fused_options(fused::Backend::cuda, run), shards, communication));
        });
    // One NCCL communicator's collectives from two threads at once could interleave on the GPUs and deadlock.
    impl.concurrent = communication != fused::vocab_parallel::Communication::nccl;
    return impl;
  }
  if (backend != fused::Backend::cpu)
    throw InputError("--vocab-shards with the " + fused::backend_name(backend) + " backend: only cpu and cuda run it");
  Implementation impl = make_implementation(
      "cpu/vocab-shards=" + std::to_string(shards), [shards](const Problem& problem, const RunOptions& run) {
        return fused::vocab_parallel::compute(problem, fused_options(fused::Backend::cpu, run), shards);
      });
  impl.concurrent = true;
  return impl;
}

std::vector<Implementation> available_implementations() {
  std::vector<Implementation> all = {reference_implementation(), fused_implementation(fused::Backend::cpu)};
  if (fused::cuda_available()) all.push_back(fused_implementation(fused::Backend::cuda));
  return all;
}

Implementation best_available() {
  return fused_implementation(fused::cuda_available() ? fused::Backend::cuda : fused::Backend::cpu);
}

static Implementation implementation_named(const std::string& name, const ImplementationOptions& options);

Implementation implementation_by_name(const std::string& name, const ImplementationOptions& options) {
  Implementation impl = implementation_named(name, options);
  if (options.capabilities) impl.capabilities = [declared = *options.capabilities] { return declared; };
  return impl;
}

static Implementation implementation_named(const std::string& name, const ImplementationOptions& options) {
  validate(options);
  if (name.rfind("exec:", 0) == 0) return exec_implementation(name.substr(5), options);
  if (name == "reference") return reference_implementation();
  if (name == "reference-cuda") {  // SPEC: the float64 reference on the GPU (an InputError naming why where it cannot run)
    Implementation impl = make_implementation("reference-cuda", [](const Problem& problem, const RunOptions& run) {
      reference::Options options;
      options.device = reference::Device::cuda;
      options.gradients = run.gradients;
      options.chunk_rows = run.max_chunk_rows;
      return reference::compute(problem, options);
    });
    impl.concurrent = true;  // one stream and cuBLAS handle per thread
    impl.capabilities = deterministic_declaration;
    return impl;
  }
  if (name == "auto") return best_available();
  const auto plus = name.find('+');
  const fused::Backend backend = fused::backend_from_name(name.substr(0, plus));
  if (backend == fused::Backend::cuda && !fused::cuda_available())
    throw InputError("implementation \"" + name + "\": no CUDA device here (or the cuda backend was not built)");
  const fused::Mutant mutant =
      plus == std::string::npos ? fused::Mutant::none : fused::mutant_from_name(name.substr(plus + 1));
  return fused_implementation(fused::resolve(backend), mutant);
}

std::string shell_quote(const std::string& s) {
  bool plain = !s.empty();
  for (char ch : s)
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || std::string("-_./:=+,@%").find(ch) != std::string::npos))
      plain = false;
  if (plain) return s;
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

}  // namespace simpo::verifier
