// The fused CUDA backend on inputs that already live on a CUDA device (torch or CuPy tensors), with no copy
// through the host: what simpo_verify.compute and simpo_verify.torch call for CUDA arrays.
//
// fused::compute takes a Problem, whose tensors are host vectors (problem/problem.h); the cuda backend's
// FusedRunner (fused/cuda/device_fused.h) takes device pointers. This is the missing entry between them, kept here
// (the cuda backend's folder belongs to its own helper); it uses only FusedRunner's public interface:
//   - validation: SPEC's shape/hyperparameter/target rules through simpo::validate on a proxy problem that has the
//     real target, B, T and V but H = 1 (x and weight are then B*T and V zeros, never read for values); the
//     NaN/Inf scan of x, weight and bias as one device kernel (skipped when options.validate is false);
//   - the targets (B*T int64) are copied to the host: the forward outputs' per-sequence math is host code;
//   - x and weight are used in place when H is a multiple of 8 and they are 16-byte aligned (cuBLASLt's rule),
//     otherwise copied on the device into padded rows;
//   - ordering: the runner's stream waits for `stream` (an event) before reading, and `stream` waits for the
//     runner's stream before anything reads the outputs, so the call is ordered as if it ran on `stream`.
#pragma once

#include "fused/fused.h"
#include "problem/problem.h"

#include <cstdint>
#include <map>
#include <string>

namespace simpo::python {

struct DeviceCall {
  Shape shape;
  int device = 0;
  std::uintptr_t stream = 0;  // cudaStream_t of the caller (0: the legacy default stream)
  // Device pointers: x bf16 [B,T,H], weight bf16 [V,H], bias bf16 [V] or 0, target int64 [B,T]; row-major, dense.
  std::uintptr_t x = 0, weight = 0, bias = 0, target = 0;
  // Outputs, dense, caller-allocated: grad_x bf16 [B,T,H]; grad_weight [V,H] and grad_bias [V], bf16 or (with
  // options.grad_weight_f32) f32. Unused without options.gradients.
  std::uintptr_t grad_x = 0, grad_weight = 0, grad_bias = 0;
  std::map<std::string, std::string> metadata;  // the hyperparameters, as in an inputs file
  fused::Options options;
};

struct DeviceResult {
  TensorMap forward;                   // loss, nll_loss, *_logps, *_logits_mean, *_rewards (F32, host)
  std::int64_t workspace_bytes = 0;    // the runner's scratch (kept between calls)
  // Beyond the workspace: this call's fp32 accumulators and padded copies, and the runner's grad_weight
  // accumulator (the lo half of the hi/lo pair, or an fp32 one; kept between calls like the workspace).
  std::int64_t extra_device_bytes = 0;
};

#if SIMPO_PYTHON_CUDA
bool device_entry_built();
DeviceResult compute_device(const DeviceCall&);
#else
inline bool device_entry_built() { return false; }
inline DeviceResult compute_device(const DeviceCall&) {
  throw InputError("inputs on a CUDA device, but this simpo_verify was built without the cuda backend (no nvcc at "
                   "build time): move them to the host, or rebuild where nvcc is installed");
}
#endif

}  // namespace simpo::python
