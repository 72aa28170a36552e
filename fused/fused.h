// The optimized implementation: chunked, bf16, f16 or f32 in, fp32 accumulation, never the whole [B*T, V] logits.
// Two backends run one algorithm: `cuda` (cuBLASLt + our kernels, the product) and `cpu` (the same chunk
// schedule and numerics in portable C++, for CI and GPU-less machines). The per-token and per-sequence math
// both use lives in fused/simpo_math.h.
#pragma once

#include "problem/problem.h"

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace simpo::fused {

enum class Backend { automatic, cpu, cuda };
std::string backend_name(Backend);
Backend backend_from_name(const std::string&);  // "auto", "cpu", "cuda"; throws InputError


inline constexpr std::int64_t default_workspace_bytes = std::int64_t{2} << 30;  // 2 GiB
inline constexpr std::int64_t min_workspace_bytes = std::int64_t{64} << 20;     // 64 MiB

struct Options {
  Backend backend = Backend::automatic;
  bool gradients = true;           // false: forward only (loss and auxiliary outputs)
  // With gradients, which to compute: a frozen input (a LoRA model's LM head, frozen hidden states) gets no gradient
  // output and its gradient GEMM does not run. grad_bias goes with grad_weight. At least one must be set.
  bool grad_x = true;
  bool grad_weight = true;
  bool grad_weight_f32 = false;    // grad_weight and grad_bias in F32 instead of the inputs' dtype
  bool validate = true;            // false skips only SPEC's NaN/Inf rule on the inputs' values
  // Scratch the algorithm may hold at once (chunk logits, dz, per-chunk grad_x). The grad_weight accumulator is
  // extra: the output itself when F32 is asked for, else on cuda lo of a bf16 hi/lo pair (V*H*2 bytes, sm_90) or an
  // fp32 one (V*H*4); the cuda low-memory schedule keeps an fp32 grad_x (N*H*4) instead. A budget that cannot hold
  // the smallest chunk is an InputError naming both sizes.
  std::int64_t workspace_bytes = default_workspace_bytes;
  // Upper bound on token rows per chunk (0: the budget decides). Tests use it to put chunk boundaries at
  // awkward places without huge shapes; it never changes the result beyond fp32 noise.
  std::int64_t max_chunk_rows = 0;
  // cuda only: the logits GEMM accumulates at most this many hidden units in the tensor cores before the
  // partial sums are added in ordinary fp32. The tensor cores' fp32 accumulation rounds toward zero (a bias that
  // grows with k: fused/cuda/BENCHMARKS.md), which alone breaks the 5e-7 bar on loss/nll/logps. On sm_90 one GEMM promotes every this many k (rounded to 64), at
  // about the cost of an unpromoted GEMM; elsewhere k is cut into cuBLAS slices of this size, each extra slice
  // one more pass over the fp32 chunk logits. 0: one cuBLAS GEMM over all of H (biased scalars). Gradients are
  // unaffected either way.
  std::int64_t logits_k_slice = 256;
  // The backward's dz from 16-bit logit distances (fused/simpo_math.h) rather than fp32 logits: each logit read
  // back as its tile's row max minus a multiple of 2^-11, so each softmax value moves by <= 2^-12 relative (an
  // eighth of dz's own bf16 rounding); the scalars do not change. On cuda the full step then keeps 2 bytes per logit
  // (where the promoted GEMM's epilogue statistics run and V % 8 == 0; elsewhere fp32 logits): half the store and
  // dz's read, twice the rows per chunk, the faster step (fused/cuda/BENCHMARKS.md). On cpu dz takes the same
  // rounding, so the backends compute the same numbers. bf16 inputs only: f16 and f32 keep dz from fp32 logits.
  bool logit_distances = true;
};

bool cuda_built();      // the cuda backend was built (nvcc at configure time)
bool cuda_available();  // a CUDA device is present and the cuda backend was built
Backend resolve(Backend);  // automatic -> cuda when available, else cpu; cuda without a device: InputError
// One line saying what runs for `backend` (resolved first): for cuda the device, its compute capability and the
// kernels the step takes there (cuda::describe_device); for cpu the portable step.
std::string describe(Backend);

// SPEC's outputs: scalars and per-pair tensors F32, grad_x in the inputs' dtype, grad_weight/grad_bias in the
// inputs' dtype or F32. Both backends take every input dtype; on cuda bf16 runs the sm_90a kernels where built,
// f16 the tensor cores through cuBLAS with the logits GEMM cut along k, f32 fp32 GEMMs (fused/cuda/README.md).
TensorMap compute(const Problem&, const Options& = {});

// Inputs already on a CUDA device (torch, CuPy): the cuda backend on caller-owned device memory, nothing copied
// through the host but the targets (N int64: SPEC's checks and the per-sequence math of the forward outputs are
// host code), or, with forward_on_device, nothing at all.
struct DeviceCall {
  Shape shape;
  Hyperparameters hp;
  DType input_dtype = DType::BF16;  // of x, weight and bias: bf16, f16 or f32
  int device = 0;
  std::uintptr_t stream = 0;  // the caller's cudaStream_t (0: the legacy default stream); the call is ordered on it
  // Inputs, dense and row-major, of input_dtype: x [B,T,H], weight [V,H], bias [V] (0: none); target int64 [B,T].
  std::uintptr_t x = 0, weight = 0, bias = 0, target = 0;
  // Outputs, dense, the caller's: grad_x [B,T,H] in input_dtype; grad_weight [V,H] and grad_bias [V] in input_dtype
  // or (with options.grad_weight_f32) f32, each 16-byte aligned. Unused without options.gradients (grad_x without
  // options.grad_x, grad_weight and grad_bias without options.grad_weight).
  std::uintptr_t grad_x = 0, grad_weight = 0, grad_bias = 0;
  // Optional, for 16-bit outputs (bf16, f16): buffers shaped and typed like grad_x, grad_weight, grad_bias that
  // receive each output's rounding residue, lo = T(g - T(g)) of the fp32 value g whose rounding T(g) is the output.
  // With them scale_gradient_on_device gives T(s g) for any s later with one rounding: what a caller needs whose
  // scale comes after the step (autograd's grad_output). 0: none.
  std::uintptr_t grad_x_lo = 0, grad_weight_lo = 0, grad_bias_lo = 0;
  Options options;
  // Keep the backend's scratch for the next call (a training loop calls once per step); false frees it at the end.
  bool keep_workspace = false;
  // Optional: caller-owned device memory (256-byte aligned, at least device_workspace(call).bytes) that holds this
  // call's scratch and accumulator instead of the backend's own; the backend then frees its own for the call, so
  // the two are never held at once. 0: the backend's own.
  std::uintptr_t workspace = 0;
  std::int64_t workspace_size = 0;
  // Where the step accumulates grad_weight in the bf16 hi/lo pair (device_workspace says: bf16 inputs and output,
  // the sm_90a kernels, H % 8 == 0, the chunked schedule), leave the last chunk's weight GEMM and its target term
  // for finish_weight_gradient_on_device, which runs them with the loss scale known: DeviceResult::pending. Needs
  // `workspace`: the pending GEMM's operands (that chunk's dz and x rows, its targets and coefficients) and the
  // pair's lo (unless grad_weight_lo is given) stay in it until the finish, so that other calls may run in between.
  // grad_x and grad_bias are complete when the call returns, as without it. Where the pair does not run nothing is
  // deferred (pending empty) and the call is the whole step.
  bool defer_weight_finish = false;
  // The host's part of the step on the device: the targets counted and checked there (an invalid one rewritten as
  // ignore_index, so that no kernel indexes with it) and the forward outputs computed there, into `forward_out`:
  // eight device float32 buffers in problem.h's output order (loss, nll_loss, chosen_logps [P], rejected_logps [P],
  // chosen_logits_mean, rejected_logits_mean, chosen_rewards [P], rejected_rewards [P]); DeviceResult::forward stays
  // empty. The host never waits before the step's first launch. With options.validate the call synchronizes once,
  // on the device's verdict, which exists once the forward's row statistics do (a chunked step's last backward may
  // still run when it returns, ordered before the caller's later work as every call's outputs are), and raises
  // SPEC's errors there, with the messages of the host's checks (the targets are read by the host only where the
  // device found one invalid; the NaN/Inf rule as without forward_on_device). Without it the call is
  // asynchronous, no host synchronization at all: it returns once its work is enqueued, and what SPEC makes
  // an InputError (a target outside [0, V), with empty_sequence = error a sequence without completion tokens, the
  // NLL term on with no chosen completion token) makes every forward output NaN (the gradients are then computed as
  // if such targets were ignore_index). bf16 and f32 inputs (f16's dz scale is planned from the targets on the host).
  bool forward_on_device = false;
  std::array<std::uintptr_t, 8> forward_out{};
};

// The scratch a call needs in DeviceCall::workspace, and whether its grad_weight can be deferred
// (DeviceCall::defer_weight_finish), from its plan: shape, input dtype, options, the gradient outputs given, the
// device. Plans only (no launch, no validation): a call compute_on_device would refuse gives {0, false}, and
// compute_on_device says why.
struct DeviceWorkspace {
  std::int64_t bytes = 0;
  bool defers_weight_finish = false;
};
DeviceWorkspace device_workspace(const DeviceCall&);

// What a deferred call (DeviceCall::defer_weight_finish) left to do: the last chunk's weight GEMM over operands in
// its workspace, into grad_weight. Copies share one state; finish_weight_gradient_on_device runs it once.
struct PendingWeightGradient {
  struct State;                  // the cuda backend's (fused/cuda/device_fused.h)
  std::shared_ptr<State> state;  // null: nothing was deferred
  bool waiting() const;          // deferred and not finished yet
};

struct DeviceResult {
  TensorMap forward;                  // loss, nll_loss, *_logps, *_logits_mean, *_rewards (F32, host)
  // The backend's own scratch (0 when the call ran in DeviceCall::workspace).
  std::int64_t workspace_bytes = 0;
  // Beyond the workspace: this call's padded copies and fp32 accumulators, and the backend's grad_weight
  // accumulator (the lo half of the hi/lo pair, or an fp32 one) unless it lived in DeviceCall::workspace.
  std::int64_t extra_device_bytes = 0;
  std::string plan;                   // the plan that ran (fused/cuda/plan.h), for logs
  PendingWeightGradient pending;      // with defer_weight_finish, where it applied
};
// Validates as compute() does (SPEC's rules; the NaN/Inf rule on the device unless options.validate is false).
// InputError where the build has no cuda backend.
DeviceResult compute_on_device(const DeviceCall&);

// The deferred weight gradient of `pending` with the loss scale s (autograd's grad_output), ordered on `stream`
// (after the call that deferred it, which had finished when it returned): the last chunk's GEMM adds its
// accumulator into the pair with s in its epilogue, hi = T(s (acc + hi + lo)) with one rounding, then the
// chunk's target term, s times its fp32 sum. grad_weight is then what the step run with grad_scale s would give (up
// to the fp32 rounding of the scaled sum), and at s = 1 bit for bit the step without deferral. The call's
// workspace and grad_weight must still be alive. InputError for a pending with nothing waiting (none deferred, or
// finished already) and for a non-finite s.
void finish_weight_gradient_on_device(const PendingWeightGradient& pending, double scale, std::uintptr_t stream);

// A float32 scale on the device, read by the kernels when they run: autograd's grad_output as a tensor, so that
// backward never synchronizes to learn it. Its value is not checked (a non-finite one gives non-finite gradients).
struct DeviceScalar {
  std::uintptr_t address = 0;
};
// The same finish with s read on the device.
void finish_weight_gradient_on_device(const PendingWeightGradient& pending, DeviceScalar scale, std::uintptr_t stream);

// out[i] = T(scale (hi[i] + lo[i])) for n elements of dtype T (lo 0: T(scale hi[i])), ordered on `stream` of `device`:
// a gradient of compute_on_device and its residue (DeviceCall::grad_x_lo...) scaled with one rounding, as if the step
// had run with grad_scale times `scale`. out may be hi. InputError where the build has no cuda backend.
void scale_gradient_on_device(DType dtype, std::uintptr_t hi, std::uintptr_t lo, std::int64_t n, double scale,
                              std::uintptr_t out, int device, std::uintptr_t stream);
// The same with the scale read on the device; where it is 1, out = hi (nothing written when out is hi): the step's
// own rounding, which T(hi + lo) can differ from on a tie.
void scale_gradient_on_device(DType dtype, std::uintptr_t hi, std::uintptr_t lo, std::int64_t n, DeviceScalar scale,
                              std::uintptr_t out, int device, std::uintptr_t stream);

}  // namespace simpo::fused
