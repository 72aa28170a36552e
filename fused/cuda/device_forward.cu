// The targets kernel and the forward outputs kernel of calls with the host's part on the device (device_forward.h).
#include "fused/cuda/device_forward.h"

#include <cmath>

#include "fused/cuda/cuda_check.h"
#include "fused/cuda/row_reduce.cuh"
#include "fused/simpo_math.h"

namespace simpo::fused::cuda {
namespace {

namespace m = ::simpo::fused::math;
using namespace ::simpo::fused::cuda::rows;

constexpr std::int64_t align8(std::int64_t bytes) { return (bytes + 7) / 8 * 8; }

// One block over every sequence: the targets are few (N int64) and one block's pass over them costs less than a
// second launch, and with no other block to wait for it writes n_chosen, invalid and nonfinite outright (no
// memset before it, no atomics).
__global__ void __launch_bounds__(kRowThreads) device_targets_kernel(const std::int64_t* target, std::int64_t B,
                                                                    std::int64_t T, std::int64_t V,
                                                                    std::int64_t ignore_index, bool empty_is_error,
                                                                    DeviceTargets out) {
  __shared__ double shared[kWarps];
  const std::int64_t P = B / 2;
  std::int64_t n_chosen = 0;  // thread 0's
  bool out_of_range = false, empty = false;
  for (std::int64_t b = 0; b < B; ++b) {
    double count = 0;  // exact: at most T
    for (std::int64_t i = threadIdx.x; i < T; i += kRowThreads) {
      const std::int64_t r = b * T + i, t = target[r];
      const bool ignored = t == ignore_index, valid = t >= 0 && t < V;
      if (!ignored && !valid) out_of_range = true;
      if (!ignored && valid) count += 1;
      out.checked[r] = ignored || !valid ? ignore_index : t;
    }
    const auto tokens = static_cast<std::int64_t>(block_sum(count, shared));
    if (threadIdx.x == 0) {
      out.completion_tokens[b] = tokens;
      if (b < P) n_chosen += tokens;
      if (tokens == 0 && empty_is_error) empty = true;
    }
    __syncthreads();  // thread 0 has read `shared` before the next sequence's sum writes it
  }
  out_of_range = __syncthreads_or(out_of_range);
  if (threadIdx.x == 0) {
    *out.n_chosen = n_chosen;
    *out.invalid = (out_of_range ? 1 : 0) | (empty ? 2 : 0);
    *out.nonfinite = 0;
  }
}

// One block: warp w takes pairs w, w + 8, ...; each lane 0 keeps its pairs' terms, summed over the block at the end.
__global__ void __launch_bounds__(kRowThreads) forward_outputs_kernel(ForwardOutputsParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t P = p.B / 2, T = p.T, N = p.B * p.T;
  const std::int64_t* n = p.targets.completion_tokens;
  double pref = 0, chosen_logprobs = 0;
  for (std::int64_t i = warp; i < P; i += kWarps) {
    double chosen = 0, rejected = 0;
    for (std::int64_t t = lane; t < T; t += 32) {
      const std::int64_t rc = i * T + t, rr = (P + i) * T + t;
      if (p.target[rc] != p.ignore_index) chosen += double(p.z_target[rc]) - double(p.lse[rc]);
      if (p.target[rr] != p.ignore_index) rejected += double(p.z_target[rr]) - double(p.lse[rr]);
    }
    chosen = warp_sum(chosen);
    rejected = warp_sum(rejected);
    if (lane == 0) {
      const double c = m::sequence_average(chosen, static_cast<long long>(n[i]));
      const double r = m::sequence_average(rejected, static_cast<long long>(n[P + i]));
      p.out[2][i] = static_cast<float>(c);
      p.out[3][i] = static_cast<float>(r);
      p.out[6][i] = static_cast<float>(p.beta * c);
      p.out[7][i] = static_cast<float>(p.beta * r);
      pref += m::pair_term(c, r, p.beta, p.gamma, p.label_smoothing).term;
      chosen_logprobs += chosen;
    }
  }
  // *_logits_mean: every position of the half, ignored ones included. Every row's statistics checked finite.
  double chosen_z = 0, rejected_z = 0;
  bool finite = true;
  for (std::int64_t r = threadIdx.x; r < N; r += kRowThreads) {
    (r < P * T ? chosen_z : rejected_z) += p.rowsum[r];
    finite = finite && isfinite(p.rowsum[r]) && isfinite(p.lse[r]) && isfinite(p.z_target[r]);
  }
  // Read before block_sum's barriers, as this kernel's own bit is set only after them.
  const bool targets_invalid = *p.targets.invalid != 0;
  __shared__ double s_pref[kWarps], s_chosen[kWarps], s_cz[kWarps], s_rz[kWarps];
  pref = block_sum(pref, s_pref);
  chosen_logprobs = block_sum(chosen_logprobs, s_chosen);
  chosen_z = block_sum(chosen_z, s_cz);
  rejected_z = block_sum(rejected_z, s_rz);
  const std::int64_t n_chosen = *p.targets.n_chosen;
  // SPEC's last target rule: the NLL term on with no chosen completion token is 0/0.
  const bool nll_without_chosen = p.compute_nll_loss && p.alpha != 0 && n_chosen == 0;
  const bool invalid = targets_invalid || nll_without_chosen;
  if (!__syncthreads_and(finite) && threadIdx.x == 0) *p.targets.nonfinite = 1;
  if (threadIdx.x == 0) {
    if (nll_without_chosen) atomicOr(p.targets.invalid, 4);
    pref /= static_cast<double>(P);
    const double nll = p.compute_nll_loss && n_chosen > 0 ? -chosen_logprobs / static_cast<double>(n_chosen) : 0.0;
    const double half_elements = static_cast<double>(P) * static_cast<double>(T) * static_cast<double>(p.V);
    p.out[0][0] = static_cast<float>(p.alpha * nll + pref);
    p.out[1][0] = static_cast<float>(nll);
    p.out[4][0] = static_cast<float>(chosen_z / half_elements);
    p.out[5][0] = static_cast<float>(rejected_z / half_elements);
  }
  if (!invalid) return;
  // An invalid call: NaN everywhere, over what was written above (block_sum's barrier orders the writes).
  __syncthreads();
  constexpr int kPerPair[4] = {2, 3, 6, 7}, kScalars[4] = {0, 1, 4, 5};
  for (std::int64_t i = threadIdx.x; i < P; i += kRowThreads)
    for (int o : kPerPair) p.out[o][i] = NAN;
  if (threadIdx.x == 0)
    for (int o : kScalars) p.out[o][0] = NAN;
}

}  // namespace

std::int64_t device_targets_bytes(std::int64_t N, std::int64_t B) { return align8((N + B + 1) * 8 + 8); }

DeviceTargets device_targets_at(void* base, std::int64_t N, std::int64_t B) {
  auto* p = static_cast<std::int64_t*>(base);
  return DeviceTargets{.checked = p, .completion_tokens = p + N, .n_chosen = p + N + B,
                       .invalid = reinterpret_cast<int*>(p + N + B + 1),
                       .nonfinite = reinterpret_cast<int*>(p + N + B + 1) + 1};
}

void launch_device_targets(const std::int64_t* target, std::int64_t B, std::int64_t T, std::int64_t V,
                           std::int64_t ignore_index, bool empty_is_error, const DeviceTargets& out,
                           cudaStream_t stream) {
  device_targets_kernel<<<1, kRowThreads, 0, stream>>>(target, B, T, V, ignore_index, empty_is_error, out);
  SIMPO_CUDA_CHECK_LAUNCH();
}

void launch_forward_outputs(const ForwardOutputsParams& p, cudaStream_t stream) {
  forward_outputs_kernel<<<1, kRowThreads, 0, stream>>>(p);
  SIMPO_CUDA_CHECK_LAUNCH();
}

}  // namespace simpo::fused::cuda
