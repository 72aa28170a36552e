#include "fused/cuda/plan.h"

#include <algorithm>

namespace simpo::fused::cuda {
namespace {

constexpr std::int64_t kAlign = 256;  // every workspace piece starts 256-byte aligned (cuBLASLt's best case)
std::int64_t align_up(std::int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
constexpr int kChunkBuffers = 6;  // Layout's chunk buffers, each aligned: `fixed` holds room for their padding

// cuBLASLt's scratch: 32 MiB is NVIDIA's recommendation for Hopper; small budgets give it an eighth.
std::int64_t gemm_workspace_bytes(std::int64_t budget) {
  return std::min<std::int64_t>(std::int64_t{32} << 20, budget / 8 / kAlign * kAlign);
}

// The chunk height at which the weight streams past an x chunk that stays in L2: the chunk's bf16 x within
// 32 MiB, in multiples of the GEMM's 128-row tile (4096 rows at H = 4096). Taller chunks read W fewer times; past
// L2, x would be re-read from memory for every column tile.
std::int64_t l2_resident_rows(std::int64_t H) {
  const std::int64_t rows = (std::int64_t{32} << 20) / (2 * std::max<std::int64_t>(H, 1));
  return std::clamp<std::int64_t>(rows / 128 * 128, 128, 4096);
}
// The forward's chunk height where the promoted GEMM stores fp32 logits for row_stats_kernel: it ran level with
// cuBLAS at 2048-row chunks and slower at the taller ones the budget allows (fused/cuda/BENCHMARKS.md).
constexpr std::int64_t kStoredForwardRows = 2048;

// The fixed part of Layout (everything but the chunk buffers) and the bytes per chunk row. `tiles` > 0 when the
// statistics come from the GEMM's epilogue; `logit_bytes` 2 for distances, 4 for fp32 logits.
Layout fixed_layout(const Shape& s, std::int64_t budget, bool gradients, std::int64_t tiles, std::int64_t logit_bytes,
                    std::int64_t element_bytes) {
  Layout l;
  const std::int64_t N = s.N(), B = s.B, ld_v = padded(s.V), ld_h = padded(s.H);
  std::int64_t at = 0;
  auto take = [&](std::int64_t bytes) {
    const std::int64_t offset = at;
    at += align_up(bytes);
    return offset;
  };
  l.gemm_bytes = gemm_workspace_bytes(budget);
  l.gemm = take(l.gemm_bytes);
  l.row_max = take(N * 4);
  l.lse = take(N * 4);
  l.z_target = take(N * 4);
  l.z_target_raw = take(tiles > 0 ? N * 4 : 0);
  l.target_coef = take(N * 4);
  l.rowsum = take(N * 8);
  l.avg_grad = take(B * 8);
  l.completion_tokens = take(B * 8);
  l.fixed = at + kChunkBuffers * kAlign;
  // The forward with epilogue statistics keeps no logits: 16 bytes of tile partials per row and tile.
  const bool keeps_logits = gradients || tiles == 0;
  l.per_row = (keeps_logits ? ld_v * logit_bytes : 0) +
              (gradients ? std::max(ld_h * 4, tiles * 12) + ld_h * element_bytes + tiles * 4 : tiles * 16);
  return l;
}

void place_chunk_buffers(Layout& l, const Shape& s, std::int64_t rows, bool gradients, std::int64_t tiles,
                         std::int64_t logit_bytes, std::int64_t element_bytes) {
  const std::int64_t ld_v = padded(s.V), ld_h = padded(s.H);
  const bool keeps_logits = gradients || tiles == 0;
  const std::int64_t sum_exp_bytes = align_up(tiles * rows * 4), sum_bytes = align_up(tiles * rows * 8);
  std::int64_t at = l.fixed - kChunkBuffers * kAlign;
  l.tile_ld = rows;
  l.logits = at;
  at += align_up(keeps_logits ? rows * ld_v * logit_bytes : 0);
  l.grad_x = at;
  l.deferred_targets = at;
  if (gradients) {  // tile_sum_exp and tile_sum inside grad_x's bytes (see Layout), and a deferred finish's targets
    l.tile_sum_exp = at;
    l.tile_sum = at + sum_exp_bytes;
    at += std::max(align_up(rows * ld_h * 4), sum_exp_bytes + sum_bytes);
  }
  l.x_rows = at;
  at += align_up(gradients ? rows * ld_h * element_bytes : 0);
  l.tile_max = at;
  at += align_up(tiles * rows * 4);
  if (!gradients) {
    l.tile_sum_exp = at;
    at += sum_exp_bytes;
    l.tile_sum = at;
    at += sum_bytes;
  }
  l.total = at;
}

// The low-memory backward's tile shape. Each vocabulary slice after the first reads and writes the fp32 grad_x
// accumulator ([N, ld_h]) once, and each row block after the first the slice's grad_W rows (fp32, or the hi/lo
// pair: 8 bytes an element either way), so with S_v slices and S_r blocks the accumulators move ~8 H (S_v N + S_r V)
// bytes (the GEMMs' bf16 operands in the same proportion). The shape is the one of least S_v N + S_r V that fits
// the region, rows in multiples of 128 (the GEMM's M tile) or all N, columns in multiples of 192 (whole tiles of
// the promoted GEMM: a partial tile costs a whole one, and every slice start stays 16-byte aligned). A slice column
// takes `slice_column_bytes` of the region beside the tile's (its grad_W row where the outputs do not hold it).
struct BackwardTile {
  std::int64_t rows = 0, columns = 0;
};
BackwardTile backward_tile(std::int64_t N, std::int64_t V, std::int64_t region, std::int64_t element_bytes,
                           std::int64_t slice_column_bytes) {
  const std::int64_t max_columns = (V + 191) / 192 * 192;
  BackwardTile best;
  double best_cost = 0;
  auto consider = [&](std::int64_t rows) {
    const std::int64_t per_column = rows * element_bytes + slice_column_bytes;
    const std::int64_t columns = std::min(max_columns, (region - 2 * kAlign) / per_column / 192 * 192);
    if (columns <= 0) return;
    const double cost = static_cast<double>((V + columns - 1) / columns) * static_cast<double>(N) +
                        static_cast<double>((N + rows - 1) / rows - 1) * static_cast<double>(V);
    if (best.rows == 0 || cost < best_cost) best = {rows, columns}, best_cost = cost;
  };
  consider(N);
  for (std::int64_t rows = 128; rows < N; rows += 128) consider(rows);
  return best;
}

// The low-memory layout after `fixed`; total in `total`. Not fits() when the budget has no room for it.
SlicedLayout sliced_layout(const Shape& s, std::int64_t budget, const Layout& fixed, std::int64_t tiles,
                           bool dz_in_epilogue, std::int64_t slice_column_bytes, std::int64_t& total) {
  SlicedLayout l;
  const std::int64_t N = s.N();
  l.row_k = fixed.fixed - kChunkBuffers * kAlign;
  const std::int64_t start = l.row_k + align_up(N * 4), region = budget - fixed.fixed - align_up(N * 4);
  if (region <= 0) return l;
  l.stat_rows = std::min(N, region / (tiles * 16));
  const BackwardTile tile = backward_tile(N, s.V, region, dz_in_epilogue ? 2 : 4, slice_column_bytes);
  l.block_rows = tile.rows;
  l.slice_columns = tile.columns;
  if (!l.fits()) return l;
  l.tile_max = start;
  l.tile_sum_exp = l.tile_max + align_up(tiles * l.stat_rows * 4);
  l.tile_sum = l.tile_sum_exp + align_up(tiles * l.stat_rows * 4);
  const std::int64_t end_stats = l.tile_sum + align_up(tiles * l.stat_rows * 8);
  l.tile = start;
  l.grad_w_slice = l.tile + align_up(l.block_rows * l.slice_columns * (dz_in_epilogue ? 2 : 4));
  const std::int64_t end_slice = l.grad_w_slice + align_up(l.slice_columns * slice_column_bytes);
  total = std::max(end_stats, end_slice);
  return l;
}

// The regions of the fixed part of a layout.
std::vector<Region> fixed_regions(const Shape& s, const Layout& l) {
  const std::int64_t N = s.N(), B = s.B;
  return {{"GEMM scratch", l.gemm, l.gemm_bytes, {}},
          {"row max", l.row_max, N * 4, {}},
          {"lse", l.lse, N * 4, {}},
          {"target logit", l.z_target, N * 4, {}},
          {"raw target logit", l.z_target_raw, l.z_target_raw == l.target_coef ? 0 : N * 4, {}},
          {"target coefficient", l.target_coef, N * 4, {}},
          {"row sum", l.rowsum, N * 8, {}},
          {"dL/davg", l.avg_grad, B * 8, {}},
          {"completion tokens", l.completion_tokens, B * 8, {}}};
}

}  // namespace

std::string StepPlan::to_string() const {
  if (!low_memory) return schedule.to_string() + (logit_distances() ? ", 16-bit logit distances" : "");
  return "low-memory: statistics in " + schedule.to_string() + ", then " + std::to_string(vocab_slices) +
         " vocabulary slices of <= " + std::to_string(vocab_slice_columns) + " columns, each in " +
         std::to_string(row_blocks) + " row block(s) of <= " + std::to_string(block_rows) + " rows";
}

std::string StepPlan::logits_form() const {
  if (!logits.promoted) return "cuBLAS, k in " + std::to_string(logits.k_splits) + " slice(s)";
  return "promoted GEMM every " + std::to_string(logits.promotion_k) + " k" +
         (logits.statistics_launch_rows > 0
              ? ", statistics over <= " + std::to_string(logits.statistics_launch_rows) + " rows a launch"
              : "") +
         ", full step keeps " +
         (logit_distances() ? "16-bit logit distances" : "fp32 logits");
}

std::string StepPlan::grad_weight_form() const {
  switch (grad_weight) {
    case GradWeight::none: return "none";
    case GradWeight::hilo: return "bf16 hi/lo pair";
    case GradWeight::sliced: return "fp32 per vocabulary slice";
    case GradWeight::sliced_hilo: return "bf16 hi/lo pair per vocabulary slice";
    default: return "fp32 accumulator";
  }
}

LogitsGemm logits_gemm(std::int64_t H, DType input, const Options& options, const DeviceFeatures& device,
                       const Tuning& tuning) {
  LogitsGemm g;
  const std::int64_t slice = input == DType::F32 ? 0 : options.logits_k_slice;
  if (slice > 0 && device.sm90_kernels && input == DType::BF16 && !tuning.cublas_logits) {
    g.promoted = true;
    g.promotion_k = std::max(promotion_k_granule, slice / promotion_k_granule * promotion_k_granule);
    g.statistics_launch_rows = std::max<std::int64_t>(0, tuning.statistics_launch_rows);
    g.k_splits = static_cast<int>((padded(H) + g.promotion_k - 1) / g.promotion_k);
  } else {
    g.k_splits = slice > 0 ? static_cast<int>(std::max<std::int64_t>(1, (H + slice - 1) / slice)) : 1;
  }
  return g;
}

StepPlan plan_step(const Shape& s, DType input, const Options& options, const DeviceFeatures& features,
                   const GradientOutputs* outputs, const Tuning& tuning) {
  StepPlan plan;
  const DeviceFeatures device = input == DType::BF16 ? features : DeviceFeatures{};  // the sm_90a kernels take bf16
  const std::int64_t element = input == DType::F32 ? 4 : 2;
  const bool gradients = outputs != nullptr;
  plan.gradients = gradients;
  const std::int64_t N = s.N(), T = s.T, V = s.V, H = s.H, ld_h = padded(H);
  const std::int64_t budget = std::max<std::int64_t>(options.workspace_bytes, 0), tiles = statistics_tiles(V);

  plan.logits = logits_gemm(H, input, options, device, tuning);
  const bool promoted = plan.logits.promoted;
  const bool statistics_in_epilogue = promoted && V % 4 == 0;  // promoted_logits_stats's unit, the promoted GEMM's
  const bool distances = gradients && options.logit_distances && statistics_in_epilogue && V % 8 == 0;

  auto layout_for = [&](bool epilogue, bool with_distances) {
    return fixed_layout(s, budget, gradients, epilogue ? tiles : 0, with_distances ? 2 : 4, element);
  };
  auto rows_fitting = [&](const Layout& l) { return budget > l.fixed ? (budget - l.fixed) / l.per_row : 0; };

  // The low-memory schedule: below one pair's rows, the backward goes a vocabulary slice at a time.
  const bool low_memory_possible =
      gradients && outputs->grad_x && (outputs->grad_weight_f32 || outputs->grad_weight_16bit) &&
      statistics_in_epilogue && tuning.low_memory != Tuning::LowMemory::never &&
      (tuning.low_memory == Tuning::LowMemory::always || rows_fitting(layout_for(distances, distances)) < 2 * T);
  if (low_memory_possible) {
    const Layout fixed = fixed_layout(s, budget, /*gradients=*/true, tiles, 4, element);
    const bool dz_in_epilogue = V % 8 == 0;  // its bf16 TMA store takes groups of 8 columns
    // The slice's grad_W in the hi/lo pair over the bf16 output where the hi/lo GEMM runs (as the chunked step's),
    // else in fp32: the caller's fp32 rows, or the workspace's.
    const bool slice_hilo =
        !outputs->grad_weight_f32 && device.sm90_kernels && H % 8 == 0 && !tuning.fp32_grad_w_slices;
    const std::int64_t slice_column_bytes =
        outputs->grad_weight_f32 ? 0 : slice_hilo ? (outputs->grad_weight_lo ? 0 : H * 2) : ld_h * 4;
    std::int64_t total = 0;
    const SlicedLayout sliced = sliced_layout(s, budget, fixed, tiles, dz_in_epilogue, slice_column_bytes, total);
    if (sliced.fits()) {
      plan.low_memory = true;
      plan.layout = fixed;
      plan.sliced = sliced;
      plan.dz_in_epilogue = dz_in_epilogue;
      plan.epilogue_statistics = true;
      Options statistics_options = options;
      statistics_options.gradients = false;
      plan.schedule = plan_rows(s, sliced.stat_rows, statistics_options);
      plan.schedule.bytes_per_row = tiles * 16;
      plan.workspace_bytes = total;
      plan.vocab_slice_columns = sliced.slice_columns;
      plan.vocab_slices = (V + sliced.slice_columns - 1) / sliced.slice_columns;
      plan.block_rows = sliced.block_rows;
      plan.row_blocks = (N + sliced.block_rows - 1) / sliced.block_rows;
      plan.grad_weight = slice_hilo ? StepPlan::GradWeight::sliced_hilo : StepPlan::GradWeight::sliced;
      plan.accumulator_bytes = N * ld_h * 4;
      plan.regions = fixed_regions(s, fixed);
      plan.regions.push_back({"row coefficients k", sliced.row_k, N * 4, {}});
      // The statistics pass, then (in the same bytes) the backward's tile and grad_W slice.
      const std::int64_t stat_rows = sliced.stat_rows, element = dz_in_epilogue ? 2 : 4;
      plan.regions.push_back({"statistics pass: tile partials", sliced.tile_max,
                              sliced.tile_sum + tiles * stat_rows * 8 - sliced.tile_max, {}});
      const std::string statistics = "statistics pass: tile partials";
      plan.regions.push_back({"backward: tile", sliced.tile, sliced.block_rows * sliced.slice_columns * element,
                              statistics});
      if (slice_column_bytes > 0)
        plan.regions.push_back({slice_hilo ? "backward: grad_W slice's lo" : "backward: grad_W slice",
                                sliced.grad_w_slice, sliced.slice_columns * slice_column_bytes, statistics});
      return plan;
    }
  }

  // The forward takes its statistics from the epilogue (no logits written); the full step where it keeps
  // distances (the statistics come from the same epilogue), else from row_stats_kernel over its fp32 logits.
  plan.epilogue_statistics = statistics_in_epilogue && (!gradients || distances);
  plan.kept = !gradients ? StepPlan::Kept::none : distances ? StepPlan::Kept::distances : StepPlan::Kept::fp32;
  Layout layout = layout_for(plan.epilogue_statistics, distances);

  if (gradients) {
    if (!outputs->grad_weight_16bit && !outputs->grad_weight_f32) {
      plan.grad_weight = StepPlan::GradWeight::none;
    } else if (!outputs->grad_weight_16bit) {
      plan.grad_weight = StepPlan::GradWeight::f32_output;
    } else if (device.sm90_kernels && H % 8 == 0) {  // the hi/lo GEMM's TMA rows of hi are the output's H columns
      plan.grad_weight = StepPlan::GradWeight::hilo;
      plan.accumulator_bytes = outputs->grad_weight_lo ? 0 : V * H * 2;
    } else if (outputs->grad_weight_f32) {
      plan.grad_weight = StepPlan::GradWeight::f32_caller;
    } else {
      plan.grad_weight = StepPlan::GradWeight::f32_own;
      plan.accumulator_bytes = V * ld_h * 4;
    }
  }

  const std::int64_t rows_that_fit = rows_fitting(layout);
  if (rows_that_fit < 1)
    throw InputError("cuda backend: workspace of " + std::to_string(options.workspace_bytes) +
                     " bytes cannot hold one token row of " + s.to_string() + ": it needs " +
                     std::to_string(layout.fixed + layout.per_row) + " bytes (" + std::to_string(layout.fixed) +
                     " fixed: GEMM scratch and row statistics, plus " + std::to_string(layout.per_row) + " per row)");
  const std::int64_t cap = !gradients ? (plan.epilogue_statistics ? l2_resident_rows(H) : promoted ? kStoredForwardRows : 0)
                           : distances ? l2_resident_rows(H)
                                       : 0;
  Options plan_options = options;
  plan_options.gradients = gradients;
  if (cap > 0) plan_options.max_chunk_rows = options.max_chunk_rows > 0 ? std::min(options.max_chunk_rows, cap) : cap;
  plan.schedule = plan_rows(s, rows_that_fit, plan_options);
  plan.schedule.bytes_per_row = layout.per_row;
  place_chunk_buffers(layout, s, plan.schedule.max_rows(), gradients, plan.epilogue_statistics ? tiles : 0,
                      distances ? 2 : 4, element);
  plan.layout = layout;
  plan.workspace_bytes = layout.total;
  plan.regions = fixed_regions(s, layout);
  const std::int64_t rows = plan.schedule.max_rows(), ld_v = padded(V), tiles_kept = plan.epilogue_statistics ? tiles : 0;
  const std::int64_t kept_bytes = plan.kept == StepPlan::Kept::distances ? rows * ld_v * 2
                                  : plan.kept == StepPlan::Kept::fp32 || !plan.epilogue_statistics ? rows * ld_v * 4
                                                                                                   : 0;
  plan.regions.push_back({"kept logits (dz in place)", layout.logits, kept_bytes, {}});
  if (gradients) {
    const std::string grad_x = "grad_x rows (tile partials but the max before it)";
    plan.regions.push_back({grad_x, layout.grad_x, std::max(rows * ld_h * 4, tiles_kept * rows * 12), {}});
    if (plan.defers_weight_finish())
      plan.regions.push_back({"deferred weight finish: the last chunk's targets and coefficients",
                              layout.deferred_targets, rows * 12, grad_x});
    plan.regions.push_back({"gathered x rows", layout.x_rows, rows * ld_h * element, {}});
    plan.regions.push_back({"tile max", layout.tile_max, tiles_kept * rows * 4, {}});
  } else {
    plan.regions.push_back({"tile max", layout.tile_max, tiles_kept * rows * 4, {}});
    plan.regions.push_back({"tile sum of exp", layout.tile_sum_exp, tiles_kept * rows * 4, {}});
    plan.regions.push_back({"tile sum", layout.tile_sum, tiles_kept * rows * 8, {}});
  }
  return plan;
}

}  // namespace simpo::fused::cuda
