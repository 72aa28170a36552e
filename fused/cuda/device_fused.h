// The fused algorithm on inputs already on the device: what cuda::compute runs after uploading, and what the
// benchmark times (so the numbers exclude host transfers). One FusedRunner owns a stream, the cuBLAS handles
// and the workspace, and can be reused across calls of any size (the handles are made once; the workspace is
// reallocated when the size changes).
#pragma once

#include "fused/cuda/device_buffer.h"
#include "fused/cuda/gemm.h"
#include "fused/cuda/promoted_gemm.h"
#include "fused/cuda/promoted_stats.h"
#include "fused/forward_outputs.h"
#include "fused/fused.h"
#include "fused/schedule.h"
#include "problem/problem.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace simpo::fused::cuda {

// Row length of x, weight and the fp32 gradient buffers on the device: H rounded up to 8 elements so every
// row is 16-byte aligned for cuBLASLt and the vector loads; the extra columns hold zeros.
inline std::int64_t padded(std::int64_t n) { return (n + 7) / 8 * 8; }

struct DeviceProblem {
  Shape shape;
  Hyperparameters hp;
  std::int64_t ld_h = 0;                 // padded(H)
  const __nv_bfloat16* x = nullptr;      // [N, ld_h], padding columns zero
  const __nv_bfloat16* weight = nullptr; // [V, ld_h], padding columns zero
  const __nv_bfloat16* bias = nullptr;   // [V] or nullptr
  const std::int64_t* target = nullptr;  // [N]
  Targets targets;                       // host: n[b] and N_c (fused/forward_outputs.h)
};

// grad_weight: with grad_weight_bf16 unset, `grad_weight` is the fp32 output and its own accumulator. With
// grad_weight_bf16 set, run() accumulates where Tuning::hilo_grad_weight and the device allow: in the bf16 hi/lo
// pair (hilo_gemm.h: hi is grad_weight_bf16 itself, lo a [V, H] bf16 buffer the runner owns, 1 GiB at the
// published shape) on sm_90 with CUTLASS and H % 8 == 0; else in an fp32 accumulator, `grad_weight` when the caller
// gives one (nullptr is fine), else one the runner owns. RunReport says which and what the runner allocated.
struct DeviceGradients {
  __nv_bfloat16* grad_x = nullptr;            // [N, H], the output
  float* grad_weight = nullptr;               // [V, ld_h] fp32 output / accumulator, or nullptr (see above)
  float* grad_bias = nullptr;                 // [V] fp32, or nullptr without a bias; run() zeroes it first
  __nv_bfloat16* grad_weight_bf16 = nullptr;  // [V, H] or nullptr: the bf16 output (see above)
  __nv_bfloat16* grad_bias_bf16 = nullptr;    // [V] or nullptr: run() rounds grad_bias into it
};

// What one run used, for tests, logs and the benchmark.
struct RunReport {
  Schedule schedule;
  std::int64_t workspace_bytes = 0;  // the one workspace allocation, all scratch included
  int gemm_fallbacks = 0;            // GEMMs that went to cublasGemmEx instead of cuBLASLt
  // Where grad_W accumulated, and the bytes of the accumulator the runner allocated for it (kept across runs, like
  // the workspace): lo of the hi/lo pair (V*H*2), or an fp32 one (V*ld_h*4) when the caller gave none.
  // sliced: the low-memory schedule writes each vocabulary slice of the output once (no grad_W accumulator;
  // accumulator_bytes is then its fp32 grad_x accumulator, N * ld_h * 4).
  enum class GradWeight { none, f32_output, f32_caller, f32_own, hilo, sliced } grad_weight = GradWeight::none;
  std::int64_t accumulator_bytes = 0;
  // The low-memory schedule (Tuning::low_memory): > 0 when it ran, the columns of its vocabulary slices and the
  // rows of the blocks each slice's backward goes through; the `schedule` above is then its statistics pass
  // (forward_only chunks of token rows).
  std::int64_t vocab_slice_columns = 0;
  std::int64_t vocab_slices = 0;
  std::int64_t block_rows = 0;
  std::int64_t row_blocks = 0;
  int weight_gemm_sms = 0;  // > 0: the gradient GEMMs ran side by side, the weight GEMM on this many SMs
  bool logit_distances = false;  // the chunk kept 16-bit logit distances rather than fp32 logits
  std::string to_string() const;  // the schedule, and the slices when there are any
};

// How the logits GEMM runs. cuda::compute(problem, options) takes it from options (tuning_for); the
// benchmarks may set it directly.
struct Tuning {
  enum class Logits {
    promoted,  // promoted_gemm.h (sm_90 with CUTLASS): one GEMM, partial sums promoted to fp32 every promotion_k
    cublas,    // Gemms::logits: k cut into logits_k_splits cuBLAS GEMMs summed in the fp32 epilogue
  };
  Logits logits = Logits::cublas;
  // cublas: 1 is fastest; s slices cut the tensor cores' fp32 accumulation bias of the logits, and so the
  // relative error of loss/nll/logps, about s-fold, for s - 1 extra passes over the chunk logits.
  int logits_k_splits = 1;
  // promoted: k per promotion (a multiple of promoted_k_granule; 0: never, for measuring what it costs) and
  // the compiled variant and tile order (promoted_gemm.h).
  std::int64_t promotion_k = 256;
  PromotedSchedule promoted;
  // Forward-only chunks of at most this many rows (0: as tall as the budget allows). The promoted GEMM ran
  // 15% slower than cuBLAS on the forward's ~4100-row chunks but level with it on the full step's 2048-row ones
  // (BENCHMARKS.md, 2026-12-03): a 2048 x 4096 bf16 x chunk (16 MiB) stays in L2 while the weight streams.
  std::int64_t forward_chunk_rows = 0;
  // The same cap where the forward takes its statistics from the epilogue (no logits stored): W is read once per
  // chunk and a 4096-row x chunk (32 MiB at H = 4096) still fits L2, so taller chunks pay (1.07-1.08x against
  // 1.09-1.11x with 2048 rows at B = 4..16 on the H200, BENCHMARKS.md, eighth round); tuning_for keeps the chunk's
  // x within 32 MiB for other H. 0: as tall as the budget allows.
  std::int64_t forward_stats_chunk_rows = 0;
  // promoted, V % 4 == 0, variant 0: the row statistics from the logits GEMM's epilogue (promoted_stats.h), so
  // the forward writes no logits and the full step has no separate pass reading them. forward (the default): the
  // forward-only schedule, 1.07-1.08x its floor (with forward_stats_chunk_rows) against 1.17-1.19x storing logits
  // for row_stats_kernel; the full
  // step stores its logits for dz anyway, and there the epilogue measured level with the separate pass (both on
  // the H200, BENCHMARKS.md, eighth round). always: every schedule; never: row_stats_kernel everywhere.
  enum class EpilogueStats { never, forward, always } epilogue_stats = EpilogueStats::forward;
  // With gradients, V % 8 == 0 and the epilogue statistics available: the full step stores each logit as its
  // 16-bit distance below its tile's row max (promoted_stats.h) instead of fp32, with the statistics from the same
  // epilogue, and dz reads the distances back (dz_from_distances_kernel, in place): half the store, half dz's read,
  // no row_stats_kernel pass, and chunks of distance_chunk_rows (tuning_for: x within 32 MiB, 4096 rows at H =
  // 4096) in the memory 2048 fp32 rows took, so the weight GEMM's read-modify-write of the grad_W pair happens half
  // as often. Each softmax value moves by <= 2^-12 relative (an eighth of dz's own bf16 rounding); the scalars
  // do not change. Off until the device measures it (BENCHMARKS.md, ninth round).
  bool logit_distances = false;
  std::int64_t distance_chunk_rows = 0;  // 0: as tall as the budget allows
  // The gradient GEMMs once per chunk over both of a three_pass chunk's parts (x rows gathered), so the fp32
  // grad_W accumulator is read and written once per chunk; false: once per part, as before (for comparing).
  bool gradient_gemms_per_chunk = true;
  // With it, the logits GEMM too runs once over a three_pass chunk's gathered rows rather than once per part: W
  // is read once per chunk, and one 2048-row GEMM ends in one partial wave of tiles instead of two 1024-row ones.
  bool logits_gemm_per_chunk = true;
  // A bf16 grad_weight output accumulates in the bf16 hi/lo pair (hilo_gemm.h) where it can run (sm_90 with
  // CUTLASS, H % 8 == 0): half the memory of the fp32 accumulator, same traffic. false: the fp32 accumulator
  // everywhere (for comparing). hilo_variant: hilo_gemm.h's compiled tile/schedule.
  bool hilo_grad_weight = true;
  int hilo_variant = 0;
  // > 0: each chunk's two gradient GEMMs run side by side, the hi/lo weight GEMM's persistent grid on this many
  // SMs and grad_x on a second stream planned for the rest (cuBLASLt's SM count target), so the weight GEMM's
  // memory-bound epilogue (4.2 GB read-modify-write per chunk at the published shape) overlaps grad_x's tensor-core
  // work instead of idling the tensor cores of every SM at once. Same results (the weight GEMM's tiles are the
  // same whichever SM runs them; grad_x's kernel may differ, within fp32 rounding). 0: one after the other (the
  // default until the device measures it: BENCHMARKS.md, ninth round). Only with the hi/lo pair; must be below the
  // device's SM count.
  int weight_gemm_sms = 0;
  // The low-memory schedule (fused_runner.cu, README "The low-memory schedule"): the statistics first, from the
  // logits GEMM's epilogue over token chunks (no logits stored), the pair math, then the backward one slice of
  // the vocabulary at a time over all rows (the slice's logits recomputed, dz, its grad_W rows written once,
  // grad_x summed into an fp32 accumulator). It needs the epilogue statistics (sm_90 with CUTLASS, V % 4 == 0).
  // automatic: where it can run and the budget cannot hold one pair's rows (the two_pass fallback's case);
  // always: wherever it can run; never: the two_pass fallback.
  enum class LowMemory { automatic, always, never } low_memory = LowMemory::automatic;
};
// The default for a device and H: promoted every logits_k_slice (rounded to the k tile) where
// promoted_logits_available(), else that many cuBLAS slices; logits_k_slice = 0 is one cuBLAS GEMM anywhere.
Tuning tuning_for(std::int64_t H, const Options&);

class FusedRunner {
 public:
  FusedRunner();
  ~FusedRunner();
  FusedRunner(const FusedRunner&) = delete;
  FusedRunner& operator=(const FusedRunner&) = delete;

  cudaStream_t stream() const { return stream_; }

  // Enqueues the whole algorithm on stream() (gradients == nullptr: forward only), then waits once, at the
  // end, for the N rows' statistics. Throws InputError when options.workspace_bytes cannot hold one row.
  RowStats run(const DeviceProblem&, const DeviceGradients* gradients, const Options&, const Tuning& = {});

  const RunReport& last_report() const { return report_; }

  // Frees the workspace and the runner's grad_W accumulator (stream-ordered) and keeps the stream and cuBLAS
  // handles: a runner kept between calls holds no scratch while idle; the next run allocates again, from the
  // stream-ordered pool.
  void release_workspace();

 private:
  RowStats run_low_memory(const DeviceProblem&, const DeviceGradients&, const Options&, const Tuning&);
  char* allocate_workspace(std::int64_t total, std::int64_t gemm_offset, std::int64_t gemm_bytes);
  void allocate_accumulator(std::size_t bytes, const char* purpose);
  RowStats download_row_stats(std::int64_t N, const float* lse, const float* z_target, const double* rowsum);

  cudaStream_t stream_ = nullptr;
  // grad_x beside the weight GEMM (Tuning::weight_gemm_sms): its stream, and the events that fork and join it.
  cudaStream_t side_stream_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  int device_sms_ = 0;
  DeviceBuffer workspace_;
  DeviceBuffer accumulator_;  // lo of the hi/lo pair, an fp32 grad_W or grad_x accumulator (RunReport::accumulator_bytes)
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
