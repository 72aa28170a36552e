// What the verifier judges. An Implementation is a name and a function from a problem to SPEC's outputs; the
// verifier never looks further, so the fp64 reference, the fused backends, the fused backends with a fault
// injected (the mutants) and any external program (`exec:COMMAND`, exec_implementation.h) are all judged by the
// same code.
#pragma once

#include "fused/fused.h"
#include "fused/mutant.h"
#include "verifier/capabilities.h"
#include "problem/problem.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace simpo::verifier {

// The knobs a run may turn. Implementations ignore the ones that mean nothing to them (the reference has no
// workspace; it does take max_chunk_rows as its own chunk size, which must not change its result either).
struct RunOptions {
  bool gradients = true;
  bool grad_f32 = false;  // fused: grad_weight and grad_bias in F32
  std::int64_t workspace_bytes = fused::default_workspace_bytes;
  std::int64_t max_chunk_rows = 0;  // 0: the implementation decides
  bool validate = true;             // fused: false skips the NaN/Inf scan of the inputs (SPEC)
};

// The fused backends' options for one run: the one translation every caller uses (the CLI's implementations and the
// Python package).
fused::Options fused_options(fused::Backend, const RunOptions&);

// The one validation of run options, whatever the implementation (so no implementation accepts a negative
// max_chunk_rows that another refuses). InputError naming the option. Every Implementation
// made by the functions below calls it before computing; the CLI calls it before reading any file.
void validate(const RunOptions&);

// How an implementation is driven, beyond one run's options.
struct ImplementationOptions {
  double case_timeout_s = 120;  // exec: seconds one case may take before the program is killed
  // `--capabilities FILE.json`: the declaration the implementation is held to, instead of its own (an exec:
  // program's handshake answer, a built-in backend's declaration).
  std::optional<Capabilities> capabilities;
};
void validate(const ImplementationOptions&);

// An implementation that did not give a result for a reason other than refusing its inputs: an external
// program that died, answered garbage, wrote no or a malformed outputs file, or outlived the case timeout.
// (A refusal is an InputError, which valid_input_agrees compares with SPEC's; a fault is always a failure.)
struct ImplementationFault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Implementation {
  std::string name;  // "reference", "cpu", "cuda", "cpu+chunk_drops_tail", "exec:python3 x.py"
  std::function<TensorMap(const Problem&, const RunOptions&)> compute;
  // Whether max_chunk_rows and workspace_bytes reach the implementation. An external program cannot be given
  // them, so the properties that vary them are skipped for it (and the sweep draws no chunk caps for it).
  bool takes_chunking = true;
  // Whether compute may run on several threads at once (the sweep judges cases in parallel when it may). Our
  // implementations may; an external program (one process, one pipe) may not.
  bool concurrent = false;
  // What it declares it supports (capabilities.h): a sweep judges only the inputs declared and reports the rest
  // as excluded. An exec: program is asked once (SPEC's handshake); unset means all of SPEC.
  std::function<Capabilities()> capabilities;
  Capabilities declared() const { return capabilities ? capabilities() : Capabilities{}; }
  // What runs, in one line for a report's header (our backends: fused::describe, the device and its kernels);
  // unset for implementations that say nothing of themselves.
  std::function<std::string()> describe;
};

// Wraps `compute` so that it validates its RunOptions first (every Implementation is made through this).
Implementation make_implementation(std::string name, std::function<TensorMap(const Problem&, const RunOptions&)> compute,
                                   bool takes_chunking = true);

Implementation reference_implementation();
// A fused backend, optionally with one deliberate fault (fused::Mutant, planted in the cpu backend: fused/mutant.h)
// injected; a mutant with another backend is an InputError.
Implementation fused_implementation(fused::Backend, fused::Mutant = fused::Mutant::none);
// The fused step with the LM head split by vocabulary rows over `shards` ranks, their outputs gathered
// (fused/vocab_parallel): cpu, the G ranks' algebra in one process; cuda, the ranks on GPUs through NCCL (one GPU
// per rank, when there are G) or all on one GPU with in-process collectives, the name saying which. InputError
// naming the problem where it cannot run (no device, no CUDA build, G > V).
Implementation vocab_parallel_implementation(fused::Backend, int shards);
// The correct implementations this build and machine can run: reference, cpu, and cuda when a device exists.
std::vector<Implementation> available_implementations();
// The fastest correct fused backend here: cuda when available, else cpu.
Implementation best_available();
// "reference", "cpu", "cuda", "auto" (best_available), "<cpu|cuda>+<mutant name>", or "exec:COMMAND"
// (exec_implementation.h). InputError otherwise.
Implementation implementation_by_name(const std::string& name, const ImplementationOptions& = {});

// `name` quoted for a POSIX shell when it needs it ('exec:python3 x.py'), for replay commands a user can paste.
std::string shell_quote(const std::string&);

}  // namespace simpo::verifier
