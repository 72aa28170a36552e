// What the verifier judges. An Implementation is a name and a function from a problem to SPEC's outputs; the
// verifier never looks further, so the fp64 reference, the fused backends and the fused backends with a fault
// injected (the mutants) are all judged by the same code.
#pragma once

#include "fused/fused.h"
#include "problem/problem.h"

#include <cstdint>
#include <functional>
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
};

struct Implementation {
  std::string name;  // "reference", "cpu", "cuda", "cpu+chunk_drops_tail"
  std::function<TensorMap(const Problem&, const RunOptions&)> compute;
};

Implementation reference_implementation();
// A fused backend, optionally with one deliberate fault (fused::Mutant) injected.
Implementation fused_implementation(fused::Backend, fused::Mutant = fused::Mutant::none);
// The correct implementations this build and machine can run: reference, cpu, and cuda when a device exists.
std::vector<Implementation> available_implementations();
// The fastest correct fused backend here: cuda when available, else cpu.
Implementation best_available();
// "reference", "cpu", "cuda", "auto" (best_available), or "<cpu|cuda>+<mutant name>". InputError otherwise.
Implementation implementation_by_name(const std::string& name);

}  // namespace simpo::verifier
