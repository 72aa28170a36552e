// The host's part of a step on the device (fused.h: DeviceCall::forward_on_device): the targets' counts and checks
// before the step, the forward outputs and the verdict on them after it. The
// synchronous path does both on the host (fused/forward_outputs.cpp: read_targets, validate, forward_outputs); these
// kernels compute the same quantities with the same formulas (fused/simpo_math.h), in double.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace simpo::fused::cuda {

// What the targets kernel leaves for the step and the forward outputs, in one device buffer (device_targets_bytes).
struct DeviceTargets {
  std::int64_t* checked = nullptr;            // [N] the targets, an invalid one replaced by ignore_index
  std::int64_t* completion_tokens = nullptr;  // [B] n[b]
  std::int64_t* n_chosen = nullptr;           // [1] N_c = sum of n[b] over b < P
  // [1] bit 0: a target outside [0, V); bit 1: an empty sequence (empty_sequence = error); bit 2 (the forward
  // outputs kernel's): the NLL term on with no chosen completion token.
  int* invalid = nullptr;
  int* nonfinite = nullptr;  // [1] beside `invalid`: 1 where a row statistic is not finite (the forward outputs kernel)
};
std::int64_t device_targets_bytes(std::int64_t N, std::int64_t B);
DeviceTargets device_targets_at(void* base, std::int64_t N, std::int64_t B);

// One kernel (one block) per call: for each sequence b, n[b], the completion tokens (target != ignore_index); a
// target outside [0, V) sets invalid bit 0 and is written to `checked` as ignore_index (so no kernel of the step
// indexes with it); a sequence with no completion token sets bit 1 when empty_is_error (SPEC's empty_sequence =
// error). Writes N_c (an integer sum), invalid, and nonfinite = 0 (the forward outputs kernel's to set): `out`
// needs no clearing first.
void launch_device_targets(const std::int64_t* target, std::int64_t B, std::int64_t T, std::int64_t V,
                           std::int64_t ignore_index, bool empty_is_error, const DeviceTargets&, cudaStream_t);

// SPEC's eight forward outputs from the step's row statistics (fused/forward_outputs.h's RowStats convention: only
// l = z_target - lse is read), in fused/forward_outputs.cpp's formulas. One block. Every output NaN where the
// targets kernel flagged the call invalid, or where the NLL term is on (compute_nll_loss, alpha != 0) with no
// chosen completion token (SPEC: 0/0; invalid bit 2). Sets `nonfinite` where any row's lse, z_target or rowsum is
// not finite: the host's finite_statistics, for SPEC's NaN/Inf rule (cuda_backend.cu).
struct ForwardOutputsParams {
  std::int64_t B, T, V;
  std::int64_t ignore_index;
  double beta, gamma, label_smoothing, alpha;
  bool compute_nll_loss;
  const std::int64_t* target;  // [N], checked
  const float* lse;            // [N]
  const float* z_target;       // [N]
  const double* rowsum;        // [N]
  DeviceTargets targets;
  // loss, nll_loss, chosen_logps [P], rejected_logps [P], chosen_logits_mean, rejected_logits_mean,
  // chosen_rewards [P], rejected_rewards [P] (problem.h's output order), fp32.
  float* out[8];
};
void launch_forward_outputs(const ForwardOutputsParams&, cudaStream_t);

}  // namespace simpo::fused::cuda
