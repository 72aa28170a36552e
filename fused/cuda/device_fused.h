// The fused algorithm on inputs already on the device: what cuda::compute runs after uploading, and what the
// benchmark times (so the numbers exclude host transfers). One FusedRunner owns a stream, the cuBLAS handles
// and the workspace, and can be reused across calls of any size (the handles are made once; the workspace is
// reallocated when the size changes).
#pragma once

#include "fused/cuda/device_buffer.h"
#include "fused/cuda/device_forward.h"
#include "fused/cuda/gemm.h"
#include "fused/cuda/kernels.h"
#include "fused/cuda/plan.h"
#include "fused/forward_outputs.h"
#include "fused/fused.h"
#include "fused/schedule.h"
#include "problem/problem.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace simpo::fused::cuda {

// T: the inputs' element type, __nv_bfloat16 (the product's path, every sm_90a kernel), __half or float (the
// cuBLAS path with dz and the outputs in that type: plan_step).
template <class T>
struct DeviceProblemOf {
  Shape shape;
  Hyperparameters hp;
  std::int64_t ld_h = 0;                 // padded(H)
  const T* x = nullptr;                  // [N, ld_h], padding columns zero
  const T* weight = nullptr;             // [V, ld_h], padding columns zero
  const T* bias = nullptr;               // [V] or nullptr
  const std::int64_t* target = nullptr;  // [N]
  Targets targets;                       // host: n[b] and N_c (fused/forward_outputs.h)
  // A call with the host's part on the device (fused.h: DeviceCall::forward_on_device): n[b] and N_c there
  // (device_forward.h), `target` its checked targets; `targets` is then unused. Not for f16 (its dz scale is planned
  // from n[b] on the host).
  DeviceTargets on_device;
};
using DeviceProblem = DeviceProblemOf<__nv_bfloat16>;

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<__nv_bfloat16>() { return DType::BF16; }
template <> constexpr DType dtype_of<__half>() { return DType::F16; }
template <> constexpr DType dtype_of<float>() { return DType::F32; }

// grad_weight: with grad_weight_16bit unset, `grad_weight` is the fp32 output and its own accumulator (f32 inputs:
// always). With grad_weight_16bit set, run() accumulates where the device allows: in the bf16 hi/lo pair
// (hilo_gemm.h: hi is grad_weight_16bit itself, lo a [V, H] bf16 buffer the runner owns, 1 GiB at the published
// shape) for bf16 inputs on sm_90 with CUTLASS and H % 8 == 0; else in an fp32 accumulator, `grad_weight` when the
// caller gives one (nullptr is fine), else one the runner owns. RunReport says which and what the runner allocated.
// A null grad_x, or grad_weight and grad_weight_16bit both null: that gradient is not computed (a frozen input,
// Options::grad_x / grad_weight). The *_lo buffers (16-bit outputs only, each optional) receive the outputs'
// rounding residues (fused.h: DeviceCall::grad_x_lo); a grad_weight_lo is then also the hi/lo pair's lo.
template <class T>
struct DeviceGradientsOf {
  T* grad_x = nullptr;             // [N, H], the output, or nullptr
  float* grad_weight = nullptr;    // [V, ld_h] fp32 output / accumulator, or nullptr (see above)
  float* grad_bias = nullptr;      // [V] fp32, or nullptr without a bias; run() zeroes it first
  T* grad_weight_16bit = nullptr;  // [V, H] or nullptr: the output in the inputs' 16-bit dtype (see above)
  T* grad_bias_16bit = nullptr;    // [V] or nullptr: run() rounds grad_bias into it
  T *grad_x_lo = nullptr, *grad_weight_lo = nullptr, *grad_bias_lo = nullptr;
};
using DeviceGradients = DeviceGradientsOf<__nv_bfloat16>;

// What one run did: its plan (plan.h), how many GEMMs cuBLASLt refused (they went to cublasGemmEx), and whether
// it left its last chunk's weight gradient for later (FusedRunner::run's `deferred`).
struct RunReport : StepPlan {
  int gemm_fallbacks = 0;
  bool deferred_weight = false;
};

// What this build and the current device offer the plan.
DeviceFeatures device_features();

// One chunk's weight gradient into the bf16 hi/lo pair (hilo_gemm.h): the GEMM over the whole groups of 8 rows of
// W, hilo_tail_kernel over the last V % 8, then the one-hot target term, per target once (launch_target_rows), each
// step scaled by `scale` (accumulate_hilo_chunk; a finish's terms come first). What a chunk's backward runs with
// scale 1, and what a deferred finish runs with the loss scale.
struct HiLoChunk {
  std::int64_t rows = 0, V = 0, H = 0;
  const __nv_bfloat16* dz = nullptr;  // [rows, ld_dz]
  std::int64_t ld_dz = 0;
  const __nv_bfloat16* x = nullptr;  // the chunk's x rows, [rows, ld_x] in chunk order
  std::int64_t ld_x = 0;
  // The target term's rows: x rows `target_x` [.., ld_x] (the inputs' x with the chunk's global rows, or the chunk's
  // own rows with rows 0..rows-1), their targets and coefficients k (1 - p_t) indexed alike.
  const __nv_bfloat16* target_x = nullptr;
  ChunkRows target_rows;
  const std::int64_t* target = nullptr;
  const float* target_coef = nullptr;
  __nv_bfloat16 *hi = nullptr, *lo = nullptr;  // [V, H]
  bool overwrite = false;                      // the step's first weight GEMM: the pair is written, not read
  // The step's last weight GEMM into a pair an earlier chunk wrote: its target terms go into the pair first
  // (add_hilo_target_terms, at scale 1: the GEMM's epilogue then scales the whole sum and rounds it once), and the
  // GEMM writes hi alone (PairOutput::hi) unless lo is the caller's (`lo_is_output`: DeviceCall::grad_weight_lo,
  // the rounding residue it reads).
  bool finish = false;
  bool lo_is_output = false;
  void* gemm_scratch = nullptr;
  std::size_t gemm_scratch_bytes = 0;
};
void accumulate_hilo_chunk(const HiLoChunk&, Scale scale, cudaStream_t);
// The chunk's target terms into the pair (launch_target_rows): after the GEMM, or before it for a finish.
void add_hilo_target_terms(const HiLoChunk&, Scale scale, cudaStream_t);

// Caller-owned memory for a run (fused.h: DeviceCall::workspace): the plan's workspace, then its accumulator from
// StepPlan::accumulator_offset(); at least StepPlan::caller_workspace_bytes(), 256-byte aligned.
struct CallerMemory {
  char* base = nullptr;
  std::int64_t bytes = 0;
};

// Runs plans on one stream. Owns the stream, the cuBLAS handles and the workspace, and can be reused across
// calls of any size (the handles are made once; the workspace is reallocated when the plan's size changes).
class FusedRunner {
 public:
  FusedRunner();
  ~FusedRunner();
  FusedRunner(const FusedRunner&) = delete;
  FusedRunner& operator=(const FusedRunner&) = delete;

  cudaStream_t stream() const { return stream_; }

  // Plans the step (plan_step) and enqueues it on stream() (gradients == nullptr: forward only), then waits once,
  // at the end, for the N rows' statistics. With forward_out (eight device float buffers in problem.h's output
  // order, a forward_on_device call's: the problem's `on_device` set) the forward outputs are computed on the device
  // into them instead, as soon as every row's statistics exist (walk()'s statistics_known), followed for a validated
  // run by the verdict (verdict()); nothing is waited for, and the RowStats returned are empty. Throws InputError
  // when options.workspace_bytes cannot hold one row.
  // T: __nv_bfloat16, __half or float (explicit instantiations in fused_runner.cu).
  // memory: the run's scratch and accumulator there instead of the runner's own (which is freed: the two are never
  // held at once); InputError when it is smaller than the plan's caller_workspace_bytes(). deferred (with memory,
  // where the plan's defers_weight_finish()): the last chunk's weight gradient is not run but described there, its
  // operands gathered into `memory` (its dz and x rows where they are, its targets and coefficients in
  // Layout::deferred_targets); last_report().deferred_weight says whether it was.
  template <class T>
  RowStats run(const DeviceProblemOf<T>&, const std::type_identity_t<DeviceGradientsOf<T>>* gradients, const Options&,
               const Tuning& = {}, const CallerMemory* memory = nullptr, HiLoChunk* deferred = nullptr,
               float* const* forward_out = nullptr);

  // A validated forward_out run's checks (device_forward.h's invalid and nonfinite), once the device has made them:
  // waits for the run's forward outputs only, which a step with gradients enqueues before its last backward.
  struct Verdict {
    bool invalid_targets = false;       // a target SPEC refuses (the host's validate() says which)
    bool nonfinite_statistics = false;  // a row's lse, z_target or rowsum not finite (SPEC's NaN/Inf rule)
  };
  Verdict verdict();

  const RunReport& last_report() const { return report_; }

  // A call's stream order: follow(caller) makes the runner's stream wait for the caller's work so far (the event is
  // caller_ready(), for other streams that read the inputs); precede(caller) makes the caller's stream wait for
  // the runner's work so far. The events are the runner's own, made once.
  void follow(cudaStream_t caller);
  void precede(cudaStream_t caller);
  cudaEvent_t caller_ready() const { return caller_ready_; }

  // The targets kernel's buffer (device_forward.h) for N rows and B sequences, the runner's, kept across calls
  // (stream-ordered: the next call's targets kernel writes it only after this call's step has read it).
  DeviceTargets device_targets(std::int64_t N, std::int64_t B);

  // Frees the workspace, the runner's accumulator and its targets buffer (stream-ordered) and keeps the stream, the
  // events and cuBLAS handles: a runner kept between calls holds no scratch while idle; the next run allocates
  // again, from the stream-ordered pool.
  void release_workspace();

 private:
  char* allocate_workspace(const Layout&, std::int64_t total);
  void bind_gemm_scratch(void* scratch, std::int64_t bytes);
  void* allocate_accumulator(std::size_t bytes, const char* purpose);
  RowStats download_row_stats(std::int64_t N, const float* lse, const float* z_target, const double* rowsum);
  // Where the step reads n[b]: the device's targets kernel's counts where the call has them, else the host's,
  // copied to `to` (the workspace's slot), which it returns.
  template <class T>
  const std::int64_t* completion_tokens(const DeviceProblemOf<T>&, std::int64_t* to);

  cudaStream_t stream_ = nullptr;
  HostStaging staging_;              // the token counts up, the row statistics down
  cudaEvent_t tokens_copied_ = nullptr;  // the last copy up from staging_ (whose bytes the next run rewrites)
  HostStaging verdict_;                   // a forward_out run's verdict, copied down
  cudaEvent_t verdict_ready_ = nullptr;   // recorded after that copy
  cudaEvent_t caller_ready_ = nullptr, run_done_ = nullptr;  // follow() and precede()
  DeviceBuffer targets_;                  // device_targets()
  DeviceBuffer workspace_;
  DeviceBuffer accumulator_;  // lo of the hi/lo pair, an fp32 grad_W or grad_x accumulator (StepPlan::accumulator_bytes)
  std::unique_ptr<Gemms> gemms_;
  std::int64_t gemm_bytes_ = 0;  // the cuBLASLt scratch gemms_ was made with
  RunReport report_;
};

// cuda::compute (cuda_backend.h) with explicit tuning.
TensorMap compute(const Problem&, const Options&, const Tuning&);

// A host problem's inputs on the device, owned, and the DeviceProblem that views them: x and weight as [rows,
// ld_h] with zero padding columns, the bias (when the problem has one), the targets. Stream-ordered on `stream`
// (enqueued, not waited for). What cuda::compute uploads; the tests and benchmarks that drive a FusedRunner
// themselves use the same.
struct DeviceInputs {
  DeviceBuffer x, weight, bias, target;
  DeviceProblem problem;
};
DeviceInputs upload_inputs(const Problem&, cudaStream_t stream);

}  // namespace simpo::fused::cuda

// fused.h's pending weight gradient: the last chunk's weight GEMM of a deferred call, its operands in the call's
// workspace, on `device`; `finished` once finish_weight_gradient_on_device has enqueued it.
struct simpo::fused::PendingWeightGradient::State {
  int device = 0;
  cuda::HiLoChunk chunk;
  bool finished = false;
};
