#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_fused.h"
#include "fused/cuda/hilo_gemm.h"
#include "fused/cuda/kernels.h"
#include "fused/cuda/promoted_dz.h"
#include "fused/cuda/promoted_gemm.h"

#include <algorithm>

namespace simpo::fused::cuda {
namespace {

constexpr std::int64_t kAlign = 256;  // every workspace piece starts 256-byte aligned (cuBLASLt's best case)
std::int64_t align_up(std::int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// cuBLASLt's scratch: 32 MiB is NVIDIA's recommendation for Hopper; small budgets give it an eighth.
std::int64_t gemm_workspace_bytes(std::int64_t budget) {
  return std::min<std::int64_t>(std::int64_t{32} << 20, budget / 8 / kAlign * kAlign);
}

// The workspace, in order: cuBLASLt scratch, the [N] row statistics and [B] sequence arrays that live for the
// whole run, then the chunk buffers sized for the largest chunk: fp32 logits (with gradients, each row's bf16 dz
// is written over the first half of its logits bytes: dz_kernel, in place) or their 16-bit distances
// (`logit_bytes` 2: Tuning::logit_distances, dz over them in place), fp32 grad_x, the chunk's x rows gathered for
// the weight GEMM, and the epilogue statistics' tile partials. `tiles` > 0 when the logits GEMM's epilogue reduces
// the statistics (promoted_stats.h; 16 bytes per row and 192-column tile), 0 for row_stats_kernel over stored
// logits; with it the forward-only schedule keeps no logits buffer at all. With gradients, the partials but the
// max (which the distances' dz reads) live only from the logits GEMM to their merge, before the chunk's grad_x is
// written, so they take grad_x's bytes.
struct Layout {
  std::int64_t gemm = 0, row_max = 0, lse = 0, z_target = 0, z_target_raw = 0, target_coef = 0, rowsum = 0,
               avg_grad = 0, completion_tokens = 0, fixed = 0;
  std::int64_t tiles = 0;
  std::int64_t logit_bytes = 4;
  std::int64_t per_row = 0;  // this backend's bytes per chunk row (padded rows; cf. workspace_bytes_per_row)
  std::int64_t logits = 0, grad_x = 0, x_rows = 0, tile_max = 0, tile_sum_exp = 0, tile_sum = 0, total = 0;
  bool keeps_logits(bool gradients) const { return gradients || tiles == 0; }
};

Layout fixed_layout(const Shape& s, std::int64_t budget, bool gradients, std::int64_t tiles,
                    std::int64_t logit_bytes = 4) {
  Layout l;
  l.logit_bytes = logit_bytes;
  const std::int64_t N = s.N(), B = s.B, ld_v = padded(s.V), ld_h = padded(s.H);
  std::int64_t at = 0;
  auto take = [&](std::int64_t bytes) {
    const std::int64_t offset = at;
    at += align_up(bytes);
    return offset;
  };
  l.tiles = tiles;
  l.gemm = take(gemm_workspace_bytes(budget));
  l.row_max = take(N * 4);
  l.lse = take(N * 4);
  l.z_target = take(N * 4);
  l.z_target_raw = take(tiles > 0 ? N * 4 : 0);
  l.target_coef = take(N * 4);
  l.rowsum = take(N * 8);
  l.avg_grad = take(B * 8);
  l.completion_tokens = take(B * 8);
  l.fixed = at + 6 * kAlign;  // room to align the six chunk buffers
  l.per_row = (l.keeps_logits(gradients) ? ld_v * logit_bytes : 0) +
              (gradients ? std::max(ld_h * 4, tiles * 12) + ld_h * 2 + tiles * 4 : tiles * 16);
  return l;
}

void place_chunk_buffers(Layout& l, const Shape& s, std::int64_t rows, bool gradients) {
  const std::int64_t ld_v = padded(s.V), ld_h = padded(s.H);
  const std::int64_t gradient_rows = gradients ? rows : 0;  // forward only: logits (or tile partials) alone
  const std::int64_t sum_exp_bytes = align_up(l.tiles * rows * 4), sum_bytes = align_up(l.tiles * rows * 8);
  std::int64_t at = l.fixed - 6 * kAlign;
  l.logits = at;
  at += align_up(l.keeps_logits(gradients) ? rows * ld_v * l.logit_bytes : 0);
  l.grad_x = at;
  if (gradients) {  // tile_sum_exp and tile_sum inside grad_x's bytes (see Layout)
    l.tile_sum_exp = at;
    l.tile_sum = at + sum_exp_bytes;
    at += std::max(align_up(rows * ld_h * 4), sum_exp_bytes + sum_bytes);
  }
  l.x_rows = at;
  at += align_up(gradient_rows * ld_h * 2);
  l.tile_max = at;
  at += align_up(l.tiles * rows * 4);
  if (!gradients) {
    l.tile_sum_exp = at;
    at += sum_exp_bytes;
    l.tile_sum = at;
    at += sum_bytes;
  }
  l.total = at;
}

// The low-memory schedule's workspace (Tuning::low_memory): the fixed part as above (with the epilogue
// statistics' raw target logits), then one region used twice. The statistics pass holds there the epilogue's
// tile partials for chunks of `stat_rows` token rows; the backward then holds one tile of `block_rows` token rows
// by `slice_columns` vocabulary columns: its bf16 dz straight from the logits GEMM's epilogue (promoted_dz.h,
// where V % 8 == 0) or its fp32 logits with dz written in place, and, when no fp32 grad_weight is given to write
// into, the vocabulary slice's fp32 grad_W rows, which accumulate over the slice's row blocks. Before the
// region: the rows' coefficients k, which the dz epilogue reads.
// Columns come in multiples of 192: whole tiles of the promoted GEMM (a partial tile costs a whole one), which
// also keeps every slice start 16-byte aligned for the bias loads and the fp32 store's groups of 4 whole.
struct SlicedLayout {
  Layout fixed;
  std::int64_t stat_rows = 0, block_rows = 0, slice_columns = 0;
  std::int64_t row_k = 0;                                       // [N] float
  std::int64_t tile_max = 0, tile_sum_exp = 0, tile_sum = 0;  // statistics pass
  std::int64_t tile = 0, grad_w_slice = 0;                      // backward: dz or logits, grad_W rows
  std::int64_t total = 0;
  bool fits() const { return stat_rows > 0 && block_rows > 0 && slice_columns > 0; }
};

// The backward's tile shape. Each vocabulary slice after the first reads and writes the fp32 grad_x
// accumulator ([N, ld_h]) once, and each row block after the first the slice's fp32 grad_W rows, so with S_v
// slices and S_r blocks the accumulators move ~8 H (S_v N + S_r V) bytes (the GEMMs' bf16 operands x and W are
// re-read in the same proportion). One block of all N rows (S_r = 1) is the narrowest slice and the most grad_x
// passes: 223 of them, ~120 GB, at B = 16 with 64 MiB (BENCHMARKS.md, seventh round). The shape is the one of
// least S_v N + S_r V that fits the region, rows in multiples of 128 (the GEMM's M tile) or all N.
struct BackwardTile {
  std::int64_t rows = 0, columns = 0;
};

BackwardTile backward_tile(std::int64_t N, std::int64_t V, std::int64_t ld_h, std::int64_t region,
                           std::int64_t element_bytes, bool grad_w_slice) {
  const std::int64_t max_columns = (V + 191) / 192 * 192;
  BackwardTile best;
  double best_cost = 0;
  auto consider = [&](std::int64_t rows) {
    // the tile's dz (2 bytes) or fp32 logits (4) at ld = columns, plus the slice's fp32 grad_W rows
    const std::int64_t per_column = rows * element_bytes + (grad_w_slice ? ld_h * 4 : 0);
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

// dz from the logits GEMM's epilogue: its bf16 TMA store takes groups of 8 columns, and every slice is whole
// groups where V % 8 == 0 (slices are multiples of 192 columns).
bool dz_in_epilogue(const Shape& s) { return s.V % 8 == 0 && promoted_dz_available(); }

SlicedLayout sliced_layout(const Shape& s, std::int64_t budget, std::int64_t tiles, bool grad_w_slice) {
  SlicedLayout l;
  l.fixed = fixed_layout(s, budget, /*gradients=*/true, tiles);
  const std::int64_t N = s.N(), ld_h = padded(s.H);
  l.row_k = l.fixed.fixed - 6 * kAlign;
  const std::int64_t start = l.row_k + align_up(N * 4), region = budget - l.fixed.fixed - align_up(N * 4);
  if (region <= 0) return l;
  l.stat_rows = std::min(N, region / (tiles * 16));
  const BackwardTile tile = backward_tile(N, s.V, ld_h, region, dz_in_epilogue(s) ? 2 : 4, grad_w_slice);
  l.block_rows = tile.rows;
  l.slice_columns = tile.columns;
  if (!l.fits()) return l;
  l.tile_max = start;
  l.tile_sum_exp = l.tile_max + align_up(tiles * l.stat_rows * 4);
  l.tile_sum = l.tile_sum_exp + align_up(tiles * l.stat_rows * 4);
  const std::int64_t end_stats = l.tile_sum + align_up(tiles * l.stat_rows * 8);
  l.tile = start;
  l.grad_w_slice = l.tile + align_up(l.block_rows * l.slice_columns * (dz_in_epilogue(s) ? 2 : 4));
  const std::int64_t end_slice = l.grad_w_slice + align_up(grad_w_slice ? l.slice_columns * ld_h * 4 : 0);
  l.total = std::max(end_stats, end_slice);
  return l;
}

}  // namespace

std::string RunReport::to_string() const {
  if (vocab_slice_columns == 0)
    return schedule.to_string() + (logit_distances ? ", 16-bit logit distances" : "") +
           (weight_gemm_sms > 0
                ? ", gradient GEMMs side by side (weight GEMM on " + std::to_string(weight_gemm_sms) + " SMs)"
                : "");
  return "low-memory: statistics in " + schedule.to_string() + ", then " + std::to_string(vocab_slices) +
         " vocabulary slices of <= " + std::to_string(vocab_slice_columns) + " columns, each in " +
         std::to_string(row_blocks) + " row block(s) of <= " + std::to_string(block_rows) + " rows";
}

FusedRunner::FusedRunner() {
  SIMPO_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  SIMPO_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
  SIMPO_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  SIMPO_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
  int device = 0;
  SIMPO_CUDA_CHECK(cudaGetDevice(&device));
  SIMPO_CUDA_CHECK(cudaDeviceGetAttribute(&device_sms_, cudaDevAttrMultiProcessorCount, device));
}

FusedRunner::~FusedRunner() {
  gemms_.reset();
  workspace_ = DeviceBuffer();  // its free is ordered on stream_, so before the stream goes
  accumulator_ = DeviceBuffer();
  if (join_) cudaEventDestroy(join_);
  if (fork_) cudaEventDestroy(fork_);
  if (side_stream_) cudaStreamDestroy(side_stream_);
  if (stream_) cudaStreamDestroy(stream_);
}

void FusedRunner::release_workspace() {
  workspace_ = DeviceBuffer();
  accumulator_ = DeviceBuffer();
}

// One allocation for all scratch, reused across runs of the same size; the cuBLAS handles are made once.
char* FusedRunner::allocate_workspace(std::int64_t total, std::int64_t gemm_offset, std::int64_t gemm_bytes) {
  if (!gemms_ || workspace_.bytes() != static_cast<std::size_t>(total) || gemm_bytes != gemm_bytes_) {
    workspace_ = DeviceBuffer();  // free the old one first: peak memory is one workspace, never two
    workspace_ = DeviceBuffer(static_cast<std::size_t>(total), "the fused workspace", stream_);
    void* gemm_scratch = workspace_.as<char>() + gemm_offset;
    if (gemms_) gemms_->set_workspace(gemm_scratch, static_cast<std::size_t>(gemm_bytes));
    else gemms_ = std::make_unique<Gemms>(stream_, gemm_scratch, static_cast<std::size_t>(gemm_bytes));
    gemm_bytes_ = gemm_bytes;
  }
  return workspace_.as<char>();
}

// The runner's own buffer for an accumulator, kept across runs of the same size.
void FusedRunner::allocate_accumulator(std::size_t bytes, const char* purpose) {
  if (accumulator_.bytes() == bytes) return;
  accumulator_ = DeviceBuffer();
  accumulator_ = DeviceBuffer(bytes, purpose, stream_);
}

RowStats FusedRunner::download_row_stats(std::int64_t N, const float* lse, const float* z_target,
                                         const double* rowsum) {
  RowStats stats(N);
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(stats.lse.data(), lse, N * 4, cudaMemcpyDeviceToHost, stream_));
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(stats.z_target.data(), z_target, N * 4, cudaMemcpyDeviceToHost, stream_));
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(stats.rowsum.data(), rowsum, N * 8, cudaMemcpyDeviceToHost, stream_));
  SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream_));
  report_.gemm_fallbacks = gemms_->fallback_calls();
  return stats;
}

RowStats FusedRunner::run(const DeviceProblem& p, const DeviceGradients* g, const Options& options,
                          const Tuning& tuning) {
  const Shape& s = p.shape;
  const Hyperparameters& hp = p.hp;
  const std::int64_t N = s.N(), B = s.B, P = s.P(), T = s.T, V = s.V, H = s.H;
  const std::int64_t ld_v = padded(V), ld_h = p.ld_h;
  const bool gradients = g != nullptr;
  if (ld_h != padded(H)) throw CudaError("DeviceProblem::ld_h must be padded(H)");
  if (g && !g->grad_weight_bf16 && !g->grad_weight)
    throw CudaError("DeviceGradients: neither grad_weight nor grad_weight_bf16 is set");
  if (tuning.weight_gemm_sms < 0 || tuning.weight_gemm_sms >= device_sms_)
    throw CudaError("Tuning::weight_gemm_sms = " + std::to_string(tuning.weight_gemm_sms) +
                    ": 0 runs the gradient GEMMs one after the other; side by side the weight GEMM takes 1 to " +
                    std::to_string(device_sms_ - 1) + " of this device's " + std::to_string(device_sms_) +
                    " SMs and grad_x the rest");
  report_.weight_gemm_sms = 0;
  report_.logit_distances = false;

  // The plan of fused/schedule.h for the rows this backend's layout fits in options.workspace_bytes (padded
  // rows, fixed scratch first), unless the low-memory schedule takes the run.
  const std::int64_t budget = options.workspace_bytes;
  const bool epilogue_stats_run = tuning.logits == Tuning::Logits::promoted && V % 4 == 0 &&
                                  tuning.promoted.variant == 0 && promoted_stats_available();
  auto layout_for = [&](bool with_epilogue_stats, bool with_distances = false) {
    return fixed_layout(s, std::max<std::int64_t>(budget, 0), gradients,
                        with_epilogue_stats ? promoted_stats_tiles(V) : 0, with_distances ? 2 : 4);
  };
  auto rows_fitting = [&](const Layout& l) { return budget > l.fixed ? (budget - l.fixed) / l.per_row : 0; };
  // Tight budgets (Tuning::low_memory): below one pair's rows, the backward goes a vocabulary slice at a time
  // and the forward stores no logits (the epilogue statistics need 16 bytes per row and tile, not 4 per logit).
  const bool epilogue_stats_asked = tuning.epilogue_stats == Tuning::EpilogueStats::always ||
                                    (tuning.epilogue_stats == Tuning::EpilogueStats::forward && !gradients);
  // Tuning::logit_distances: the chunk keeps 16-bit distances, its statistics come from the same epilogue.
  const bool distances = gradients && tuning.logit_distances && epilogue_stats_run && V % 8 == 0;
  const bool low_memory = epilogue_stats_run && tuning.low_memory != Tuning::LowMemory::never &&
                          (tuning.low_memory == Tuning::LowMemory::always ||
                           rows_fitting(layout_for(epilogue_stats_asked || distances, distances)) < 2 * T);
  report_.vocab_slice_columns = report_.vocab_slices = report_.block_rows = report_.row_blocks = 0;
  if (gradients && low_memory) {
    const SlicedLayout sliced = sliced_layout(s, std::max<std::int64_t>(budget, 0), promoted_stats_tiles(V),
                                              /*grad_w_slice=*/g->grad_weight == nullptr);
    if (sliced.fits()) return run_low_memory(p, *g, options, tuning);
  }
  report_.logit_distances = distances;
  const bool epilogue_stats =
      epilogue_stats_run && (epilogue_stats_asked || distances || (!gradients && low_memory));
  Layout layout = layout_for(epilogue_stats, distances);
  const std::int64_t rows_that_fit = rows_fitting(layout);

  // Where grad_W accumulates (device_fused.h, DeviceGradients): the caller's fp32 output; with a bf16 output, the
  // hi/lo pair (hi: that output, lo: this runner's bf16 buffer) where the hi/lo GEMM runs and H % 8 == 0 (its TMA
  // rows of hi are the output's dense H columns), else an fp32 accumulator, the caller's or this runner's.
  report_.grad_weight = RunReport::GradWeight::none;
  report_.accumulator_bytes = 0;
  float* grad_weight_f32 = nullptr;
  __nv_bfloat16 *hi = nullptr, *lo = nullptr;
  if (g) {
    if (!g->grad_weight_bf16) {
      grad_weight_f32 = g->grad_weight;
      report_.grad_weight = RunReport::GradWeight::f32_output;
    } else if (tuning.hilo_grad_weight && H % 8 == 0 && hilo_gemm_available()) {
      const std::size_t bytes = static_cast<std::size_t>(V * H * 2);
      allocate_accumulator(bytes, "the bf16 lo half of the grad_weight hi/lo pair");
      hi = g->grad_weight_bf16;
      lo = accumulator_.as<__nv_bfloat16>();
      report_.grad_weight = RunReport::GradWeight::hilo;
      report_.weight_gemm_sms = tuning.weight_gemm_sms;
      report_.accumulator_bytes = static_cast<std::int64_t>(bytes);
    } else if (g->grad_weight) {
      grad_weight_f32 = g->grad_weight;
      report_.grad_weight = RunReport::GradWeight::f32_caller;
    } else {
      const std::size_t bytes = static_cast<std::size_t>(V * ld_h * 4);
      allocate_accumulator(bytes, "the fp32 grad_weight accumulator");
      grad_weight_f32 = accumulator_.as<float>();
      report_.grad_weight = RunReport::GradWeight::f32_own;
      report_.accumulator_bytes = static_cast<std::int64_t>(bytes);
    }
  }

  if (rows_that_fit < 1)
    throw InputError("cuda backend: workspace of " + std::to_string(budget) + " bytes cannot hold one token row of " +
                     s.to_string() + ": it needs " + std::to_string(layout.fixed + layout.per_row) + " bytes (" +
                     std::to_string(layout.fixed) + " fixed: GEMM scratch and row statistics, plus " +
                     std::to_string(layout.per_row) + " per row)");
  Options plan_options = options;
  plan_options.gradients = gradients;
  const std::int64_t forward_cap = epilogue_stats ? tuning.forward_stats_chunk_rows : tuning.forward_chunk_rows;
  const std::int64_t cap = !gradients ? forward_cap : distances ? tuning.distance_chunk_rows : 0;
  if (cap > 0) plan_options.max_chunk_rows = options.max_chunk_rows > 0 ? std::min(options.max_chunk_rows, cap) : cap;
  report_.schedule = plan_rows(s, rows_that_fit, plan_options);
  report_.schedule.bytes_per_row = layout.per_row;
  place_chunk_buffers(layout, s, report_.schedule.max_rows(), gradients);
  report_.workspace_bytes = layout.total;

  char* base = allocate_workspace(layout.total, layout.gemm, gemm_workspace_bytes(budget));
  float* row_max = reinterpret_cast<float*>(base + layout.row_max);
  float* lse = reinterpret_cast<float*>(base + layout.lse);
  float* z_target = reinterpret_cast<float*>(base + layout.z_target);
  float* target_coef = reinterpret_cast<float*>(base + layout.target_coef);
  double* rowsum = reinterpret_cast<double*>(base + layout.rowsum);
  float* z_target_raw = reinterpret_cast<float*>(base + layout.z_target_raw);
  float* tile_max = reinterpret_cast<float*>(base + layout.tile_max);
  float* tile_sum_exp = reinterpret_cast<float*>(base + layout.tile_sum_exp);
  double* tile_sum = reinterpret_cast<double*>(base + layout.tile_sum);
  const std::int64_t tile_ld = report_.schedule.max_rows();
  double* avg_grad = reinterpret_cast<double*>(base + layout.avg_grad);
  auto* completion_tokens = reinterpret_cast<std::int64_t*>(base + layout.completion_tokens);
  float* logits = reinterpret_cast<float*>(base + layout.logits);
  auto* logit_distances = reinterpret_cast<std::uint16_t*>(base + layout.logits);  // the same bytes, [rows, ld_v]
  // dz in place: row i of the chunk's bf16 dz starts where its fp32 logits row starts (dz_kernel reads each
  // 2048-column step before writing over it), or over its distances, element for element.
  auto* dz = reinterpret_cast<__nv_bfloat16*>(logits);
  const std::int64_t ld_dz = distances ? ld_v : 2 * ld_v;
  float* grad_x_part = reinterpret_cast<float*>(base + layout.grad_x);
  auto* x_rows = reinterpret_cast<__nv_bfloat16*>(base + layout.x_rows);

  SIMPO_CUDA_CHECK(cudaMemcpyAsync(completion_tokens, p.targets.n.data(), B * 8, cudaMemcpyHostToDevice, stream_));
  // grad_weight needs no clearing: the first weight GEMM writes it with beta = 0 (every chunk has rows), the hi/lo
  // pair likewise (hilo_gemm.h).
  if (g && g->grad_bias) SIMPO_CUDA_CHECK(cudaMemsetAsync(g->grad_bias, 0, V * 4, stream_));
  bool first_weight_gemm = true;

  const PairParams pair_params{T, P, hp.ignore_index, hp.beta, hp.gamma, hp.label_smoothing};
  const double nll_weight =
      hp.compute_nll_loss && p.targets.n_chosen > 0 ? hp.alpha / static_cast<double>(p.targets.n_chosen) : 0.0;
  const CoefficientParams coefficients{T, P, hp.grad_scale, nll_weight, avg_grad, completion_tokens};

  // A chunk's parts are stacked in its buffers: part i starts at buffer row `offset`.
  auto part_logits = [&](const RowRange& part, std::int64_t offset) {
    return LogitRows{logits + offset * ld_v, ld_v, part.rows(), part.begin, V, p.bias, p.target, hp.ignore_index};
  };
  // A three_pass chunk's x rows (two parts) copied together into x_rows, where both the logits GEMM and the weight
  // GEMM take them: one GEMM of the chunk's rows instead of one per part (W read once per chunk, not twice).
  auto gather_x = [&](const Chunk& c) -> const __nv_bfloat16* {
    if (c.part_count == 1) return p.x + c.parts[0].begin * ld_h;
    std::int64_t offset = 0;
    for (int i = 0; i < c.part_count; ++i) {
      SIMPO_CUDA_CHECK(cudaMemcpyAsync(x_rows + offset * ld_h, p.x + c.parts[i].begin * ld_h,
                                       c.parts[i].rows() * ld_h * 2, cudaMemcpyDeviceToDevice, stream_));
      offset += c.parts[i].rows();
    }
    return x_rows;
  };
  // The logits of `rows` rows of x (ld_h) into the chunk's buffer from row `offset`: the promoted GEMM over whole
  // groups of 4 fp32 columns, the last V % 4 through cuBLAS, cut along k as often as the promotion, so they carry
  // the same small bias.
  auto logits_rows = [&](std::int64_t rows, const __nv_bfloat16* x_rows_at, std::int64_t offset) {
    float* out = logits + offset * ld_v;
    const std::int64_t V4 = tuning.logits == Tuning::Logits::promoted ? V / 4 * 4 : 0;
    if (V4 > 0)
      promoted_logits(rows, V4, ld_h, x_rows_at, p.weight, out, ld_v, tuning.promotion_k, stream_,
                      base + layout.gemm, static_cast<std::size_t>(gemm_bytes_), tuning.promoted);
    const int tail_splits = V4 == 0 ? tuning.logits_k_splits
                            : tuning.promotion_k > 0
                                ? static_cast<int>((ld_h + tuning.promotion_k - 1) / tuning.promotion_k)
                                : 1;
    if (V4 < V) gemms_->logits(rows, V - V4, ld_h, x_rows_at, p.weight + V4 * ld_h, out + V4, ld_v, tail_splits);
  };
  // with_stats: the pass that produces the row statistics; store: whether dz will read this chunk's logits
  // (only the epilogue statistics can skip storing them: row_stats_kernel reads them); x_chunk: the chunk's rows
  // gathered (gather_x) for one GEMM over them all (Tuning::logits_gemm_per_chunk), or nullptr for a GEMM per part.
  // With distances every stored chunk is distances, from the statistics GEMM (the two_pass schedule's second
  // pass writes the same partials again, unmerged).
  auto logits_of = [&](const Chunk& c, bool with_stats, bool store, const __nv_bfloat16* x_chunk = nullptr) {
    const bool from_epilogue = (with_stats && epilogue_stats) || (store && distances);
    if (x_chunk != nullptr && !from_epilogue) {
      logits_rows(c.rows(), x_chunk, 0);
      std::int64_t offset = 0;
      for (int i = 0; with_stats && i < c.part_count; ++i) {
        launch_row_stats(part_logits(c.parts[i], offset), row_max, lse, z_target, rowsum, stream_);
        offset += c.parts[i].rows();
      }
      return;
    }
    std::int64_t offset = 0;
    for (int i = 0; i < c.part_count; ++i) {
      const RowRange& part = c.parts[i];
      const __nv_bfloat16* x_part = p.x + part.begin * ld_h;
      float* logits_part = logits + offset * ld_v;
      if (from_epilogue) {
        LogitTileStats out;
        out.bias = p.bias;
        out.target = p.target + part.begin;
        out.ignore_index = hp.ignore_index;
        out.ld = tile_ld;
        out.tile_max = tile_max + offset;
        out.tile_sum_exp = tile_sum_exp + offset;
        out.tile_sum = tile_sum + offset;
        out.z_target = z_target_raw + part.begin;
        if (store && distances)
          promoted_logits_distances(part.rows(), V, ld_h, x_part, p.weight, logit_distances + offset * ld_v, ld_v,
                                    tuning.promotion_k, out, stream_, base + layout.gemm,
                                    static_cast<std::size_t>(gemm_bytes_));
        else
          promoted_logits_stats(part.rows(), V, ld_h, x_part, p.weight, store ? logits_part : nullptr, ld_v,
                                tuning.promotion_k, out, stream_, base + layout.gemm,
                                static_cast<std::size_t>(gemm_bytes_));
        const TileStatsRows tiles{tile_max + offset, tile_sum_exp + offset, tile_sum + offset, tile_ld, layout.tiles,
                                  part.rows(), part.begin, z_target_raw, p.target, hp.ignore_index};
        if (with_stats) launch_merge_tile_stats(tiles, row_max, lse, z_target, rowsum, stream_);
        offset += part.rows();
        continue;
      }
      logits_rows(part.rows(), x_part, offset);
      if (with_stats) launch_row_stats(part_logits(part, offset), row_max, lse, z_target, rowsum, stream_);
      offset += part.rows();
    }
  };
  // dz per part, then each gradient GEMM once per chunk over all its rows: a three_pass chunk's two parts
  // (chosen rows, rejected rows) would otherwise read and write the whole fp32 grad_W accumulator twice. The
  // weight GEMM wants the chunk's x rows contiguous: x_chunk, two parts' rows copied together by gather_x (16 MiB
  // for 2048 rows at H = 4096, against 4 GiB of accumulator traffic saved). `at`: the chunk's first buffer row.
  auto backward_rows = [&](const Chunk& c, std::int64_t at, const __nv_bfloat16* x_chunk) {
    const std::int64_t rows = c.rows();
    __nv_bfloat16* dz_rows = dz + at * ld_dz;
    float* gx_rows = grad_x_part + at * ld_h;
    std::int64_t offset = at;
    for (int i = 0; i < c.part_count; ++i) {
      const RowRange& part = c.parts[i];
      if (distances)
        launch_dz_from_distances(LogitDistanceRows{logit_distances + offset * ld_v, ld_v, part.rows(), part.begin, V,
                                                   tile_max + offset, tile_ld, promoted_stats_tile_columns, p.target,
                                                   hp.ignore_index},
                                 coefficients, row_max, lse, z_target, dz + offset * ld_dz, ld_dz, target_coef,
                                 stream_);
      else
        launch_dz(part_logits(part, offset), coefficients, row_max, lse, z_target, dz + offset * ld_dz, ld_dz,
                  target_coef, stream_);
      offset += part.rows();
    }
    // Side by side (Tuning::weight_gemm_sms): the weight GEMM's persistent grid is launched first and holds its
    // SMs; grad_x follows on the side stream, from the same point (dz written), planned for the SMs left, with the
    // cuBLASLt scratch to itself (the weight GEMM takes none). The main stream joins it before grad_x is read.
    const bool side_by_side = hi != nullptr && tuning.weight_gemm_sms > 0;
    if (side_by_side) SIMPO_CUDA_CHECK(cudaEventRecord(fork_, stream_));
    else gemms_->grad_x(rows, V, ld_h, dz_rows, ld_dz, p.weight, gx_rows);
    if (hi) {
      // The GEMM takes whole groups of 8 rows of W (TMA along V); the last V % 8 a plain kernel. Then the target
      // term, per target once, after both (each reads and writes the pair).
      const std::int64_t V8 = V / 8 * 8;
      hilo_accumulate_grad_weight(rows, V8, H, dz_rows, ld_dz, x_chunk, ld_h, hi, lo, H, first_weight_gemm, stream_,
                                  side_by_side ? nullptr : base + layout.gemm,
                                  side_by_side ? 0 : static_cast<std::size_t>(gemm_bytes_), tuning.hilo_variant,
                                  tuning.weight_gemm_sms);
      if (side_by_side) {
        SIMPO_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, fork_, 0));
        gemms_->grad_x(rows, V, ld_h, dz_rows, ld_dz, p.weight, gx_rows, /*accumulate=*/false,
                       GemmPlacement{side_stream_, device_sms_ - tuning.weight_gemm_sms});
        SIMPO_CUDA_CHECK(cudaEventRecord(join_, side_stream_));
      }
      launch_hilo_tail(rows, V8, V, H, dz_rows, ld_dz, x_chunk, ld_h, hi, lo, H, first_weight_gemm, stream_);
      ChunkRows chunk_rows;
      for (int i = 0; i < c.part_count; ++i) {
        chunk_rows.begin[i] = c.parts[i].begin;
        chunk_rows.rows[i] = c.parts[i].rows();
      }
      launch_target_rows_hilo(p.x, ld_h, H, chunk_rows, p.target, target_coef, hi, lo, H, stream_);
    } else {
      gemms_->accumulate_grad_weight(rows, V, ld_h, dz_rows, ld_dz, x_chunk, grad_weight_f32,
                                     /*overwrite=*/first_weight_gemm);
    }
    first_weight_gemm = false;
    if (side_by_side) SIMPO_CUDA_CHECK(cudaStreamWaitEvent(stream_, join_, 0));
    offset = 0;
    for (int i = 0; i < c.part_count; ++i) {
      const RowRange& part = c.parts[i];
      launch_grad_x_finish(gx_rows + offset * ld_h, part.rows(), part.begin, H, ld_h, p.weight, p.target,
                           target_coef, g->grad_x, stream_);
      if (!hi || g->grad_bias)
        launch_target_scatter(p.x, part.rows(), part.begin, H, ld_h, p.target, target_coef, hi ? nullptr : grad_weight_f32,
                              g->grad_bias, stream_);
      offset += part.rows();
    }
    if (g->grad_bias) launch_bias_column_sums(dz_rows, ld_dz, rows, V, g->grad_bias, stream_);
  };
  // x_chunk: the chunk's rows gathered, or nullptr (gathered here when the gradient GEMMs take the whole chunk).
  auto backward_of = [&](const Chunk& c, const __nv_bfloat16* x_chunk) {
    if (tuning.gradient_gemms_per_chunk || c.part_count == 1)
      return backward_rows(c, 0, x_chunk != nullptr ? x_chunk : gather_x(c));
    std::int64_t at = 0;
    for (int i = 0; i < c.part_count; ++i) {  // Tuning::gradient_gemms_per_chunk = false: a part at a time
      Chunk one;
      one.parts[0] = c.parts[i];
      backward_rows(one, at, gather_x(one));
      at += c.parts[i].rows();
    }
  };
  auto pair_math = [&](std::int64_t pair_begin, std::int64_t pair_end) {
    launch_pair_math(pair_params, pair_begin, pair_end, p.target, lse, z_target, completion_tokens, avg_grad,
                     stream_);
  };

  // No host synchronization from here to the copy of the row statistics at the end.
  const Schedule& schedule = report_.schedule;
  switch (schedule.mode) {
    case Mode::three_pass:
      for (const Chunk& c : schedule.chunks) {
        const __nv_bfloat16* x_chunk =
            tuning.logits_gemm_per_chunk && tuning.gradient_gemms_per_chunk ? gather_x(c) : nullptr;
        logits_of(c, /*with_stats=*/true, /*store=*/true, x_chunk);
        pair_math(c.pair_begin, c.pair_end);
        backward_of(c, x_chunk);
      }
      break;
    case Mode::two_pass:
      for (const Chunk& c : schedule.chunks) logits_of(c, true, /*store=*/!epilogue_stats);
      pair_math(0, P);
      for (const Chunk& c : schedule.chunks) {
        logits_of(c, /*with_stats=*/false, true);  // recomputed: the budget could not keep a whole pair's logits
        backward_of(c, nullptr);
      }
      break;
    case Mode::forward_only:
      for (const Chunk& c : schedule.chunks) logits_of(c, true, /*store=*/false);
      break;
  }
  // The hi/lo pair's hi is the rounded output already; an fp32 accumulator is rounded into it.
  if (g && g->grad_weight_bf16 && !hi) launch_round_to_bf16(grad_weight_f32, ld_h, V, H, g->grad_weight_bf16, stream_);
  if (g && g->grad_bias && g->grad_bias_bf16) launch_round_to_bf16(g->grad_bias, V, 1, V, g->grad_bias_bf16, stream_);

  return download_row_stats(N, lse, z_target, rowsum);
}

// The low-memory schedule (Tuning::low_memory; README "The low-memory schedule"). Three steps, no host
// synchronization until the statistics are copied back:
//   1. statistics: per chunk of token rows, the promoted logits GEMM with the row statistics in its epilogue and
//      no output (promoted_stats.h), its tile partials merged into the row statistics;
//   2. the pair math for every pair;
//   3. backward, per slice [v0, v1) of the vocabulary and, within it, per block [r0, r1) of token rows
//      (sliced_layout's tile): the tile's logits again (promoted GEMM), its dz from that GEMM's epilogue
//      (promoted_dz.h; V % 8 == 0; k and target_coef of every row first) or by dz_kernel in place over them,
//      grad_x[r0, r1) += dz W[v0, v1) into an fp32 [N, ld_h] accumulator, grad_W[v0, v1) (+)= dz^T x[r0, r1)
//      (the fp32 output's rows, or the workspace's slice buffer); after the slice's last block its grad_W rows
//      get their target term and are rounded into a bf16 output, and after the last slice grad_x is finished as
//      in the other schedules (target term, one rounding).
// Memory: the workspace (the budget) plus that grad_x accumulator, N * ld_h * 4 bytes; no grad_W accumulator.
RowStats FusedRunner::run_low_memory(const DeviceProblem& p, const DeviceGradients& g, const Options& options,
                                     const Tuning& tuning) {
  const Shape& s = p.shape;
  const Hyperparameters& hp = p.hp;
  const std::int64_t N = s.N(), B = s.B, P = s.P(), T = s.T, V = s.V, H = s.H, ld_h = p.ld_h;
  const std::int64_t budget = options.workspace_bytes, tiles = promoted_stats_tiles(V);
  const bool own_slice = g.grad_weight == nullptr;  // no fp32 output to write the slice's rows into
  const SlicedLayout l = sliced_layout(s, budget, tiles, own_slice);
  const std::int64_t C = l.slice_columns, R = l.block_rows, gemm_bytes = gemm_workspace_bytes(budget);

  Options stats_options = options;
  stats_options.gradients = false;
  report_.schedule = plan_rows(s, l.stat_rows, stats_options);
  report_.schedule.bytes_per_row = tiles * 16;
  report_.workspace_bytes = l.total;
  report_.vocab_slice_columns = C;
  report_.vocab_slices = (V + C - 1) / C;
  report_.block_rows = R;
  report_.row_blocks = (N + R - 1) / R;
  report_.grad_weight = RunReport::GradWeight::sliced;
  report_.accumulator_bytes = N * ld_h * 4;
  allocate_accumulator(static_cast<std::size_t>(report_.accumulator_bytes),
                       "the fp32 grad_x accumulator of the low-memory schedule");
  auto* grad_x_sum = accumulator_.as<float>();

  char* base = allocate_workspace(l.total, l.fixed.gemm, gemm_bytes);
  float* row_max = reinterpret_cast<float*>(base + l.fixed.row_max);
  float* lse = reinterpret_cast<float*>(base + l.fixed.lse);
  float* z_target = reinterpret_cast<float*>(base + l.fixed.z_target);
  float* z_target_raw = reinterpret_cast<float*>(base + l.fixed.z_target_raw);
  float* target_coef = reinterpret_cast<float*>(base + l.fixed.target_coef);
  double* rowsum = reinterpret_cast<double*>(base + l.fixed.rowsum);
  double* avg_grad = reinterpret_cast<double*>(base + l.fixed.avg_grad);
  auto* completion_tokens = reinterpret_cast<std::int64_t*>(base + l.fixed.completion_tokens);
  float* tile_max = reinterpret_cast<float*>(base + l.tile_max);
  float* tile_sum_exp = reinterpret_cast<float*>(base + l.tile_sum_exp);
  double* tile_sum = reinterpret_cast<double*>(base + l.tile_sum);
  // The tile: dz from the GEMM's epilogue ([R, C] bf16), or fp32 logits [R, C] with dz in place over them.
  const bool epilogue_dz = dz_in_epilogue(s);
  float* logits = reinterpret_cast<float*>(base + l.tile);
  auto* dz = reinterpret_cast<__nv_bfloat16*>(base + l.tile);
  const std::int64_t ld_dz = epilogue_dz ? C : 2 * C;
  float* row_k = reinterpret_cast<float*>(base + l.row_k);
  float* grad_w_slice = own_slice ? reinterpret_cast<float*>(base + l.grad_w_slice) : nullptr;
  void* gemm_scratch = base + l.fixed.gemm;

  SIMPO_CUDA_CHECK(cudaMemcpyAsync(completion_tokens, p.targets.n.data(), B * 8, cudaMemcpyHostToDevice, stream_));
  if (g.grad_bias) SIMPO_CUDA_CHECK(cudaMemsetAsync(g.grad_bias, 0, V * 4, stream_));

  // 1. statistics
  for (const Chunk& c : report_.schedule.chunks)
    for (int i = 0; i < c.part_count; ++i) {
      const RowRange& part = c.parts[i];
      LogitTileStats out;
      out.bias = p.bias;
      out.target = p.target + part.begin;
      out.ignore_index = hp.ignore_index;
      out.ld = l.stat_rows;
      out.tile_max = tile_max;
      out.tile_sum_exp = tile_sum_exp;
      out.tile_sum = tile_sum;
      out.z_target = z_target_raw + part.begin;
      promoted_logits_stats(part.rows(), V, ld_h, p.x + part.begin * ld_h, p.weight, nullptr, V, tuning.promotion_k,
                            out, stream_, gemm_scratch, static_cast<std::size_t>(gemm_bytes));
      const TileStatsRows partials{tile_max, tile_sum_exp, tile_sum, l.stat_rows, tiles, part.rows(), part.begin,
                                   z_target_raw, p.target, hp.ignore_index};
      launch_merge_tile_stats(partials, row_max, lse, z_target, rowsum, stream_);
    }
  // 2. pair math
  launch_pair_math(PairParams{T, P, hp.ignore_index, hp.beta, hp.gamma, hp.label_smoothing}, 0, P, p.target, lse,
                   z_target, completion_tokens, avg_grad, stream_);
  const double nll_weight =
      hp.compute_nll_loss && p.targets.n_chosen > 0 ? hp.alpha / static_cast<double>(p.targets.n_chosen) : 0.0;
  const CoefficientParams coefficients{T, P, hp.grad_scale, nll_weight, avg_grad, completion_tokens};
  if (epilogue_dz)
    launch_row_coefficients(N, p.target, hp.ignore_index, coefficients, lse, z_target, row_k, target_coef, stream_);

  // 3. backward, a tile of the vocabulary slice by row block at a time
  for (std::int64_t v0 = 0; v0 < V; v0 += C) {
    const std::int64_t columns = std::min(C, V - v0);  // a multiple of 4: V % 4 == 0, C % 192 == 0
    const __nv_bfloat16* w_slice = p.weight + v0 * ld_h;
    float* gw = own_slice ? grad_w_slice : g.grad_weight + v0 * ld_h;  // row 0 = vocabulary row v0
    for (std::int64_t r0 = 0; r0 < N; r0 += R) {
      const std::int64_t rows = std::min(R, N - r0);
      const __nv_bfloat16* x_block = p.x + r0 * ld_h;
      const __nv_bfloat16* bias_slice = p.bias ? p.bias + v0 : nullptr;
      if (epilogue_dz) {
        const DzTile tile{bias_slice, p.target, r0, v0, row_max, lse, row_k};
        promoted_logits_dz(rows, columns, ld_h, x_block, w_slice, dz, ld_dz, tuning.promotion_k, tile, stream_,
                           gemm_scratch, static_cast<std::size_t>(gemm_bytes));
      } else {
        promoted_logits(rows, columns, ld_h, x_block, w_slice, logits, C, tuning.promotion_k, stream_, gemm_scratch,
                        static_cast<std::size_t>(gemm_bytes), tuning.promoted);
        LogitRows tile{logits, C, rows, r0, columns, bias_slice, p.target, hp.ignore_index};
        tile.column_begin = v0;
        launch_dz(tile, coefficients, row_max, lse, z_target, dz, ld_dz, target_coef, stream_);
      }
      gemms_->grad_x(rows, columns, ld_h, dz, ld_dz, w_slice, grad_x_sum + r0 * ld_h, /*accumulate=*/v0 > 0);
      gemms_->accumulate_grad_weight(rows, columns, ld_h, dz, ld_dz, x_block, gw, /*overwrite=*/r0 == 0);
      if (g.grad_bias) launch_bias_column_sums(dz, ld_dz, rows, columns, g.grad_bias + v0, stream_);
    }
    // target_coef holds every row's coefficient now (row_coefficients_kernel, or each block's dz_kernel)
    launch_target_scatter(p.x, N, 0, H, ld_h, p.target, target_coef, gw, nullptr, stream_, v0, v0 + columns);
    if (g.grad_weight_bf16) launch_round_to_bf16(gw, ld_h, columns, H, g.grad_weight_bf16 + v0 * H, stream_);
  }
  launch_grad_x_finish(grad_x_sum, N, 0, H, ld_h, p.weight, p.target, target_coef, g.grad_x, stream_);
  if (g.grad_bias) {
    launch_target_scatter(p.x, N, 0, H, ld_h, p.target, target_coef, nullptr, g.grad_bias, stream_);
    if (g.grad_bias_bf16) launch_round_to_bf16(g.grad_bias, V, 1, V, g.grad_bias_bf16, stream_);
  }
  return download_row_stats(N, lse, z_target, rowsum);
}

}  // namespace simpo::fused::cuda
