// The cuda backend's plan for one step: every decision the runner makes before its first launch, and every byte
// of its workspace, computed on the host from the shape, the options and what the device offers. Host-only C++
// (no CUDA headers): built on every machine and unit-tested without a GPU (fused/tests/cuda_plan_test.cpp);
// the runner (device_fused.h) allocates what the plan says and walks its schedule (fused/schedule.h: walk).
//
// What a plan chooses, in order:
//   logits      the promoted CUTLASS GEMM (sm_90a, every promotion_k added into fp32 registers) or cuBLAS cut
//               along k into k_splits slices (elsewhere);
//   statistics  from the logits GEMM's epilogue (promoted, V % 4 == 0: no logits written for them) or a pass
//               over stored fp32 logits (row_stats_kernel);
//   kept        what a gradient chunk keeps for dz: 16-bit logit distances below their tile's row max
//               (Options::logit_distances, promoted, V % 8 == 0) or fp32 logits, dz written over either in place;
//   grad_weight where grad_W accumulates: the bf16 hi/lo pair over a bf16 output (sm_90a, H % 8 == 0), the
//               caller's fp32 output, or an fp32 accumulator of the runner's;
//   low memory  when the budget cannot hold one pair's rows and the epilogue statistics run: the statistics over
//               token chunks, then the backward a vocabulary slice at a time (README "The low-memory schedule").
#pragma once

#include "fused/fused.h"
#include "fused/schedule.h"
#include "problem/problem.h"

#include <cstdint>
#include <string>
#include <vector>

namespace simpo::fused::cuda {

// Row length of x, weight and the fp32 gradient buffers on the device: H (or V) rounded up to 8 elements so every
// row is 16-byte aligned for cuBLASLt, TMA and the vector loads; the extra columns hold zeros.
inline std::int64_t padded(std::int64_t n) { return (n + 7) / 8 * 8; }

// The epilogue statistics' column tile (the promoted GEMM's 192-wide N tile): one set of partials per row and tile.
inline constexpr std::int64_t statistics_tile_columns = 192;
inline std::int64_t statistics_tiles(std::int64_t V) {
  return (V + statistics_tile_columns - 1) / statistics_tile_columns;
}
// The k block the promoted GEMM promotes at (its mainloop's k tile): promotion_k is a multiple of it.
inline constexpr std::int64_t promotion_k_granule = 64;

// What the build and the device offer (device_features() in device_fused.h asks the device; tests pass any).
struct DeviceFeatures {
  // The sm_90a CUTLASS kernels were built and the device is compute capability 9.0: the promoted logits GEMM,
  // its statistics, distances and dz epilogues, and the hi/lo weight GEMM.
  bool sm90_kernels = false;
};

// What a caller may still choose; Tuning{} is the default every entry point runs. Tests and the benchmark set a
// field to reach a plan the default takes only for other shapes or budgets.
struct Tuning {
  // The logits through cuBLAS (k cut per Options::logits_k_slice) even where the promoted GEMM runs.
  bool cublas_logits = false;
  // automatic: the low-memory schedule where it can run and the budget cannot hold one pair's rows; always:
  // wherever it can run; never: the two_pass fallback.
  enum class LowMemory { automatic, always, never } low_memory = LowMemory::automatic;
  // The promoted GEMM's rows per launch where it keeps only the row statistics (the forward, the low-memory
  // statistics pass): at most this many (0: a chunk's part per launch), so that the launch's x rows stay in L2
  // beside the weight it streams. Where it also stores the chunk's distances, one launch per chunk measured as fast
  // (BENCHMARKS.md).
  std::int64_t statistics_launch_rows = 2048;
  // The low-memory schedule's grad_W slices in fp32 rows even where the hi/lo pair runs (as it does for H % 8 != 0
  // and fp32 outputs): the form the pair replaced, for timing the two in one process (cuda_bench).
  bool fp32_grad_w_slices = false;
};

// The bytes of a step's workspace, in order: cuBLASLt scratch, the [N] row statistics and [B] sequence arrays that
// live for the whole run, then the chunk buffers sized for the largest chunk: the kept logits (fp32, or 2-byte
// distances; dz is written over them in place), fp32 grad_x, the chunk's x rows gathered for the weight GEMM, and
// the epilogue statistics' tile partials (16 bytes per row and tile; with gradients all but the max share grad_x's
// bytes: they live only from the logits GEMM to their merge, before grad_x is written). Offsets from the
// workspace's start, each 256-byte aligned.
//
// A deferred weight finish (fused.h: DeviceCall::defer_weight_finish) keeps the last chunk's dz (in the kept
// logits' bytes), its x rows (gathered) and, in grad_x's bytes once that chunk's grad_x is finished, its targets
// (int64) followed by their coefficients (fp32): `deferred_targets`, 12 bytes a row where grad_x has 4 ld_h.
struct Layout {
  std::int64_t gemm = 0, gemm_bytes = 0;
  std::int64_t row_max = 0, lse = 0, z_target = 0, z_target_raw = 0, target_coef = 0, rowsum = 0, avg_grad = 0,
               completion_tokens = 0;
  std::int64_t fixed = 0;    // bytes before the chunk buffers (and room to align them)
  std::int64_t per_row = 0;  // bytes per chunk row
  std::int64_t logits = 0, grad_x = 0, x_rows = 0, tile_max = 0, tile_sum_exp = 0, tile_sum = 0;
  std::int64_t deferred_targets = 0;
  std::int64_t tile_ld = 0;  // rows of the tile partials' arrays (the largest chunk)
  std::int64_t total = 0;
};

// The low-memory schedule's workspace: the fixed part as above, the rows' coefficients k, then one region used
// twice: the statistics pass's tile partials for chunks of stat_rows token rows, then the backward's tile of
// block_rows token rows by slice_columns vocabulary columns (its bf16 dz from the GEMM's epilogue, or fp32 logits
// with dz in place) and the slice's grad_W accumulator where the caller's outputs do not hold it: the lo half of the
// hi/lo pair (bf16; hi is the bf16 output's rows), or fp32 rows where the pair cannot run (none beside an fp32
// grad_weight output, or the caller's lo).
struct SlicedLayout {
  std::int64_t stat_rows = 0, block_rows = 0, slice_columns = 0;
  std::int64_t row_k = 0;
  std::int64_t tile_max = 0, tile_sum_exp = 0, tile_sum = 0;  // the statistics pass
  std::int64_t tile = 0, grad_w_slice = 0;                    // the backward
  bool fits() const { return stat_rows > 0 && block_rows > 0 && slice_columns > 0; }
};

// How the logits GEMM runs: for bf16 inputs the promoted GEMM wherever it can (sm90_kernels,
// Options::logits_k_slice > 0), its last V % 4 columns through cuBLAS cut into k_splits slices; elsewhere, and for
// f16, cuBLAS cut into k_splits slices of logits_k_slice (one GEMM over all k for logits_k_slice = 0); f32 one fp32
// GEMM (no tensor cores, so no truncated accumulation to cut). The vocabulary-parallel ranks make the same choice.
struct LogitsGemm {
  bool promoted = false;
  std::int64_t promotion_k = 0;  // promoted: k per promotion, a multiple of promotion_k_granule
  std::int64_t statistics_launch_rows = 0;  // promoted: Tuning::statistics_launch_rows
  int k_splits = 1;
};
LogitsGemm logits_gemm(std::int64_t H, DType input, const Options&, const DeviceFeatures&, const Tuning& = {});

// The gradient outputs a caller gives the runner (device_fused.h, DeviceGradients).
struct GradientOutputs {
  bool grad_x = true;             // false: no grad_x (a frozen x)
  // Neither of these two: no grad_weight (a frozen LM head).
  bool grad_weight_f32 = false;   // an fp32 [V, ld_h] grad_weight (the output, or a buffer to accumulate in)
  bool grad_weight_16bit = false;  // a [V, H] grad_weight output in the inputs' 16-bit dtype (bf16 or f16)
  bool grad_weight_lo = false;     // the caller's [V, H] residue buffer: the hi/lo pair's lo, not the runner's
};

// A named piece of the workspace: [offset, offset + bytes), which may overlap the region named `shares_with`
// (the two are live at different times).
struct Region {
  std::string name;
  std::int64_t offset = 0, bytes = 0;
  std::string shares_with;
};

struct StepPlan {
  Schedule schedule;  // the chunks (for the low-memory schedule: its statistics pass, forward_only token chunks)
  bool gradients = false;
  LogitsGemm logits;
  bool epilogue_statistics = false;  // the statistics pass reduces in the logits GEMM's epilogue
  enum class Kept { none, fp32, distances } kept = Kept::none;  // what a gradient chunk keeps for dz
  // Where grad_W accumulated: the caller's fp32 output, its fp32 buffer under a bf16 output, the runner's own fp32
  // accumulator, the hi/lo pair (lo the runner's), or per vocabulary slice (the low-memory schedule finishes each
  // slice of the output before the next): in fp32 rows (`sliced`: the fp32 output's, or the workspace's rounded
  // into the bf16 output) or in the hi/lo pair (`sliced_hilo`: hi the bf16 output's rows, lo the workspace's slice
  // or the caller's lo; no rounding pass).
  enum class GradWeight { none, f32_output, f32_caller, f32_own, hilo, sliced, sliced_hilo } grad_weight =
      GradWeight::none;
  // Bytes of the runner's accumulator beside the workspace: lo of the hi/lo pair (V*H*2), an fp32 grad_W (V*ld_h*4),
  // or the low-memory schedule's fp32 grad_x (N*ld_h*4).
  std::int64_t accumulator_bytes = 0;
  Layout layout;
  bool low_memory = false;
  SlicedLayout sliced;
  bool dz_in_epilogue = false;  // low memory: each tile's dz from the logits GEMM's epilogue (V % 8 == 0)
  std::int64_t vocab_slice_columns = 0, vocab_slices = 0, block_rows = 0, row_blocks = 0;
  std::int64_t workspace_bytes = 0;  // the one workspace allocation, all scratch included
  // Every region of the workspace the step uses, each byte in one region but where a region shares another's
  // (Region::shares_with): the low-memory statistics pass and its backward use the same bytes one after the other.
  // (The chunked step's tile partials but the max live inside its grad_x region, from the logits GEMM to their
  // merge, before grad_x is written.)
  std::vector<Region> regions;

  bool logit_distances() const { return kept == Kept::distances; }
  std::string to_string() const;  // the schedule and its forms, for logs, reports and errors
  // The kernels, for reports: how the logits GEMM runs ("promoted GEMM every 256 k, statistics over <= 2048 rows a
  // launch, full step keeps 16-bit logit distances", "cuBLAS, k in 16 slice(s)") and where grad_W accumulates
  // ("bf16 hi/lo pair", "fp32 accumulator").
  std::string logits_form() const;
  std::string grad_weight_form() const;

  // The last chunk's weight GEMM can wait for the loss scale (fused.h: DeviceCall::defer_weight_finish): where
  // grad_W accumulates in the hi/lo pair, whose last GEMM can take the scale in its epilogue.
  bool defers_weight_finish() const { return grad_weight == GradWeight::hilo; }
  // A caller-owned workspace (fused.h: DeviceCall::workspace) holds the workspace, then from accumulator_offset()
  // the runner's accumulator: caller_workspace_bytes() in all.
  std::int64_t accumulator_offset() const { return (workspace_bytes + 255) / 256 * 256; }
  std::int64_t caller_workspace_bytes() const { return accumulator_offset() + accumulator_bytes; }
};

// The plan for a step over `shape` with inputs of dtype `input` (gradients: the outputs given, nullptr: forward
// only). The sm_90a kernels take bf16: f16 and f32 inputs get the plan of a device without them, with the x rows,
// dz and outputs in their dtype (f32: dz fp32 over its fp32 logits, element for element). Throws InputError when
// options.workspace_bytes cannot hold one token row (naming the bytes), or for a negative max_chunk_rows.
StepPlan plan_step(const Shape&, DType input, const Options&, const DeviceFeatures&, const GradientOutputs* gradients,
                   const Tuning& = {});

}  // namespace simpo::fused::cuda
