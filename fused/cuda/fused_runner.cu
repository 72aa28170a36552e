// The executor: a StepPlan (plan.h) run on one stream. The plan has chosen every form and placed every byte; here
// each stage of fused/schedule.h's walk is a member function of ChunkedStep, with the buffers it reads and writes
// named in one place, and the low-memory schedule is run_low_memory. No host synchronization from the first launch
// to the copy of the row statistics at the end.
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_fused.h"
#include "fused/cuda/hilo_gemm.h"
#include "fused/cuda/kernels.h"
#include "fused/cuda/promoted_dz.h"
#include "fused/cuda/promoted_gemm.h"
#include "fused/cuda/promoted_stats.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>

namespace simpo::fused::cuda {

// Every sm_90a kernel (promoted GEMM and its epilogues, hi/lo GEMM) is built and runs together. A Hopper device in a
// build without them runs the sliced cuBLAS path, about twice as slow: said once per process, on stderr.
DeviceFeatures device_features() {
  static const bool warned = [] {
    int device = 0, major = 0;
    if (!promoted_kernels_built() && cudaGetDevice(&device) == cudaSuccess &&
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major == 9)
      std::fprintf(stderr, "simpo-verify: this build has no CUTLASS sm_90a kernels (run fused/cuda/fetch_cutlass.sh, then "
                           "rebuild): the cuda backend takes its sliced cuBLAS path on this sm_90 device, about 2x slower\n");
    cudaGetLastError();
    return true;
  }();
  (void)warned;
  return DeviceFeatures{.sm90_kernels = promoted_logits_available()};
}

namespace {
// hi, lo [V, H] (+)= dz^T x: the GEMM over whole groups of 8 rows of W (TMA along V), hilo_tail_kernel over the
// last V % 8 (which writes both halves: a handful of rows).
void accumulate_hilo(const HiLoChunk& c, Scale scale, cudaStream_t stream) {
  const std::int64_t V8 = c.V / 8 * 8;
  const PairOutput output = c.finish && !c.lo_is_output ? PairOutput::hi : PairOutput::hi_and_lo;
  hilo_accumulate_grad_weight(c.rows, V8, c.H, c.dz, c.ld_dz, c.x, c.ld_x, c.hi, c.lo, c.H, c.overwrite, scale, stream,
                              c.gemm_scratch, c.gemm_scratch_bytes, output);
  launch_hilo_tail(c.rows, V8, c.V, c.H, c.dz, c.ld_dz, c.x, c.ld_x, c.hi, c.lo, c.H, c.overwrite, scale, stream);
}
}  // namespace

void add_hilo_target_terms(const HiLoChunk& c, Scale scale, cudaStream_t stream) {
  launch_target_rows(c.target_x, c.ld_x, c.H, c.target_rows, c.target, c.target_coef,
                     TargetRowsSink{.hi = c.hi, .lo = c.lo, .ld_w = c.H, .scale = scale}, stream);
}

// The GEMM and its tail, then the target term, per target once, after both (each reads and writes the pair); a
// finish's terms are in the pair already.
void accumulate_hilo_chunk(const HiLoChunk& c, Scale scale, cudaStream_t stream) {
  accumulate_hilo(c, scale, stream);
  if (!c.finish) add_hilo_target_terms(c, scale, stream);
}

namespace {

template <class T>
T* at(char* base, std::int64_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

// Rows [0, rows) in launches of at most `most` rows (0: one launch): launch(first row, rows of this launch).
template <class Launch>
void launches(std::int64_t rows, std::int64_t most, Launch&& launch) {
  const std::int64_t step = most > 0 ? most : rows;
  for (std::int64_t o = 0; o < rows; o += step) launch(o, std::min(step, rows - o));
}

// The row statistics and per-sequence arrays every schedule keeps for the whole run (the plan's fixed layout), made
// once per run by FusedRunner::run. completion_tokens: where the step reads n[b] (FusedRunner::completion_tokens).
struct RowArrays {
  float *row_max, *lse, *z_target, *z_target_raw, *target_coef;
  double *rowsum, *avg_grad;
  const std::int64_t* completion_tokens;
  RowArrays(char* base, const Layout& l, const std::int64_t* completion_tokens)
      : row_max(at<float>(base, l.row_max)),
        lse(at<float>(base, l.lse)),
        z_target(at<float>(base, l.z_target)),
        z_target_raw(at<float>(base, l.z_target_raw)),
        target_coef(at<float>(base, l.target_coef)),
        rowsum(at<double>(base, l.rowsum)),
        avg_grad(at<double>(base, l.avg_grad)),
        completion_tokens(completion_tokens) {}
};

template <class T>
PairParams pair_params(const DeviceProblemOf<T>& p) {
  return PairParams{p.shape.T, p.shape.P(), p.hp.ignore_index, p.hp.beta, p.hp.gamma, p.hp.label_smoothing};
}

// f16 dz (CoefficientParams::dz_scale): |dterm| <= 1, so |dL/davg[b]| <= |beta| / P and every row's
// |k| <= |grad_scale| (|beta| / (P n[b]) + nll_weight), known on the host before the step. The power of two that puts
// that bound at 2^14 keeps every dz below f16's largest finite (65504) and the large ones far above its smallest
// normal (2^-14), where a k of 1e-5 would otherwise leave most of a row's softmax terms subnormal or zero.
double dz_scale_for_f16(const Targets& targets, const Hyperparameters& hp, std::int64_t P, double nll_weight) {
  double bound = 0;
  for (std::size_t b = 0; b < targets.n.size(); ++b)
    if (targets.n[b] > 0)
      bound = std::max(bound, std::abs(hp.beta) / (static_cast<double>(P) * static_cast<double>(targets.n[b])) +
                                  (static_cast<std::int64_t>(b) < P ? nll_weight : 0.0));
  bound *= std::abs(hp.grad_scale);
  if (!(bound > 0) || !std::isfinite(bound)) return 1.0;
  return std::ldexp(1.0, std::clamp(static_cast<int>(std::floor(std::log2(0x1.0p14 / bound))), -120, 120));
}

template <class T>
CoefficientParams coefficient_params(const DeviceProblemOf<T>& p, const RowArrays& rows) {
  const double nll_weight =
      p.hp.compute_nll_loss && p.targets.n_chosen > 0 ? p.hp.alpha / static_cast<double>(p.targets.n_chosen) : 0.0;
  CoefficientParams c{p.shape.T, p.shape.P(), p.hp.grad_scale, nll_weight, rows.avg_grad, rows.completion_tokens};
  if (p.on_device.n_chosen) {
    if constexpr (std::is_same_v<T, __half>) throw CudaError("f16 calls plan their dz scale from n[b] on the host");
    c.n_chosen = p.on_device.n_chosen;
    c.alpha = p.hp.compute_nll_loss ? p.hp.alpha : 0.0;
  }
  if constexpr (std::is_same_v<T, __half>)
    c.dz_scale = static_cast<float>(dz_scale_for_f16(p.targets, p.hp, p.shape.P(), nll_weight));
  return c;
}

// The chunked step (three_pass, two_pass, forward_only): the stages walk() calls. A chunk's parts are stacked in
// its buffers: part i starts at buffer row `offset`. T is the inputs' element type; the sm_90a kernels (promoted
// logits and their epilogues, the hi/lo pair) are bf16's, and the plan chooses them for bf16 alone.
// `deferred` (the hi/lo pair only): the last chunk's weight gradient is described there instead of run.
template <class T>
class ChunkedStep {
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;

 public:
  ChunkedStep(const DeviceProblemOf<T>& p, const DeviceGradientsOf<T>* g, const StepPlan& plan, char* base,
              const RowArrays& rows, Gemms& gemms, void* accumulator, cudaStream_t stream, HiLoChunk* deferred)
      : p_(p),
        g_(g),
        plan_(plan),
        l_(plan.layout),
        rows_(rows),
        gemm_scratch_(base + plan.layout.gemm),
        gemms_(gemms),
        stream_(stream),
        ld_v_(padded(p.shape.V)),
        logits_(at<float>(base, l_.logits)),
        distances_(at<std::uint16_t>(base, l_.logits)),
        // dz in place: row i of the chunk's dz starts where its fp32 logits row starts (dz_kernel reads each
        // 2048-column step before writing over it), or over its distances, element for element.
        dz_(at<T>(base, l_.logits)),
        ld_dz_(plan.logit_distances() ? ld_v_ : ld_v_ * 4 / static_cast<std::int64_t>(sizeof(T))),
        grad_x_part_(at<float>(base, l_.grad_x)),
        x_rows_(at<T>(base, l_.x_rows)),
        tile_max_(at<float>(base, l_.tile_max)),
        tile_sum_exp_(at<float>(base, l_.tile_sum_exp)),
        tile_sum_(at<double>(base, l_.tile_sum)),
        deferred_targets_(at<std::int64_t>(base, l_.deferred_targets)),
        deferred_(deferred) {
    if (g) {
      switch (plan.grad_weight) {
        case StepPlan::GradWeight::f32_output:
        case StepPlan::GradWeight::f32_caller: grad_weight_f32_ = g->grad_weight; break;
        case StepPlan::GradWeight::f32_own: grad_weight_f32_ = static_cast<float*>(accumulator); break;
        case StepPlan::GradWeight::hilo:
          if constexpr (kBf16) {
            hi_ = g->grad_weight_16bit;
            lo_ = g->grad_weight_lo != nullptr ? g->grad_weight_lo : static_cast<__nv_bfloat16*>(accumulator);
          }
          break;
        default: break;
      }
    }
  }

  // statistics_known: walk()'s optional stage, once every row's statistics exist (the forward outputs, where the
  // call writes them on the device).
  Stages stages(std::function<void()> statistics_known) {
    return Stages{.forward = [this](const Chunk& c, bool keep) { forward(c, keep); },
                  .pair_math = [this](std::int64_t b, std::int64_t e) { pair_math(b, e); },
                  .logits = [this](const Chunk& c) { logits(c); },
                  .backward = [this](const Chunk& c) { backward(c); },
                  .statistics_known = std::move(statistics_known)};
  }

  void prologue() {
    // grad_weight needs no clearing: the first weight GEMM writes it with beta = 0 (every chunk has rows), the hi/lo
    // pair likewise (hilo_gemm.h).
    if (g_ && g_->grad_bias) SIMPO_CUDA_CHECK(cudaMemsetAsync(g_->grad_bias, 0, p_.shape.V * 4, stream_));
  }

  // The hi/lo pair's hi is the rounded output already; an fp32 accumulator is rounded into a bf16 output.
  void epilogue() {
    const std::int64_t V = p_.shape.V, H = p_.shape.H;
    if (g_ && g_->grad_weight_16bit && !hi_)
      launch_round_to(grad_weight_f32_, p_.ld_h, V, H, g_->grad_weight_16bit, stream_, g_->grad_weight_lo);
    if (g_ && g_->grad_bias && g_->grad_bias_16bit)
      launch_round_to(g_->grad_bias, V, 1, V, g_->grad_bias_16bit, stream_, g_->grad_bias_lo);
  }

 private:
  // keep (three_pass): the chunk's x rows are gathered once for its logits GEMM and its weight GEMM, and its logits
  // (or distances) stored for its backward. Otherwise only the statistics are wanted: the epilogue's when the plan
  // has them (nothing stored), else row_stats_kernel over stored fp32 logits.
  void forward(const Chunk& c, bool keep) {
    if (keep) {
      x_chunk_ = gather_x(c);
      logits_of(c, /*with_stats=*/true, /*store=*/true, x_chunk_);
    } else {
      logits_of(c, /*with_stats=*/true, /*store=*/!plan_.epilogue_statistics, nullptr);
    }
  }

  void pair_math(std::int64_t pair_begin, std::int64_t pair_end) {
    launch_pair_math(pair_params(p_), pair_begin, pair_end, p_.target, rows_.lse, rows_.z_target,
                     rows_.completion_tokens, rows_.avg_grad, stream_);
  }

  void logits(const Chunk& c) {
    x_chunk_ = nullptr;
    logits_of(c, /*with_stats=*/false, /*store=*/true, nullptr);
  }

  // dz per part, then each gradient GEMM once over all the chunk's rows: a three_pass chunk's two parts (chosen
  // rows, rejected rows) would otherwise read and write the whole grad_W accumulator twice.
  void backward(const Chunk& c) {
    const std::int64_t V = p_.shape.V, H = p_.shape.H, ld_h = p_.ld_h, rows = c.rows();
    const bool weight_gradient = plan_.grad_weight != StepPlan::GradWeight::none;
    const bool last = ++backward_chunks_ == plan_.schedule.chunks.size();
    const T* x_chunk = x_chunk_ != nullptr ? x_chunk_ : weight_gradient ? gather_x(c) : nullptr;
    x_chunk_ = nullptr;
    const CoefficientParams coefficients = coefficient_params(p_, rows_);
    std::int64_t offset = 0;
    for (int i = 0; i < c.part_count; ++i) {
      const RowRange& part = c.parts[i];
      bool from_distances = false;
      if constexpr (kBf16) {
        from_distances = plan_.logit_distances();
        if (from_distances)
          launch_dz_from_distances(
              LogitDistanceRows{distances_ + offset * ld_v_, ld_v_, part.rows(), part.begin, V, tile_max_ + offset,
                                l_.tile_ld, statistics_tile_columns, p_.target, p_.hp.ignore_index},
              coefficients, rows_.row_max, rows_.lse, rows_.z_target, dz_ + offset * ld_dz_, ld_dz_,
              rows_.target_coef, stream_);
      }
      if (!from_distances)
        launch_dz(part_logits(part, offset), coefficients, rows_.row_max, rows_.lse, rows_.z_target,
                  dz_ + offset * ld_dz_, ld_dz_, rows_.target_coef, stream_);
      offset += part.rows();
    }
    const float alpha = 1.0f / coefficients.dz_scale;  // exact: a power of two
    if (g_->grad_x) {
      gemms_.grad_x(rows, V, ld_h, dz_, ld_dz_, p_.weight, grad_x_part_, /*accumulate=*/false, alpha);
      offset = 0;
      for (int i = 0; i < c.part_count; ++i) {
        const RowRange& part = c.parts[i];
        launch_grad_x_finish(grad_x_part_ + offset * ld_h, part.rows(), part.begin, H, ld_h, p_.weight, p_.target,
                             rows_.target_coef, g_->grad_x, stream_, g_->grad_x_lo);
        offset += part.rows();
      }
    }
    if (!weight_gradient) return;
    ChunkRows chunk_rows;
    for (int i = 0; i < c.part_count; ++i) {
      chunk_rows.begin[i] = c.parts[i].begin;
      chunk_rows.rows[i] = c.parts[i].rows();
    }
    if constexpr (kBf16) {
      if (hi_) {
        HiLoChunk chunk{.rows = rows, .V = V, .H = H, .dz = dz_, .ld_dz = ld_dz_, .x = x_chunk, .ld_x = ld_h,
                        .target_x = p_.x, .target_rows = chunk_rows, .target = p_.target,
                        .target_coef = rows_.target_coef, .hi = hi_, .lo = lo_, .overwrite = first_weight_gemm_,
                        .finish = last && !first_weight_gemm_, .lo_is_output = g_->grad_weight_lo != nullptr,
                        .gemm_scratch = gemm_scratch_, .gemm_scratch_bytes = static_cast<std::size_t>(l_.gemm_bytes)};
        if (chunk.finish) add_hilo_target_terms(chunk, Scale{}, stream_);
        if (last && deferred_) defer(c, chunk, *deferred_);
        else accumulate_hilo_chunk(chunk, Scale{}, stream_);
      }
    }
    if (!hi_) {
      gemms_.accumulate_grad_weight(rows, V, ld_h, dz_, ld_dz_, x_chunk, grad_weight_f32_,
                                    /*overwrite=*/first_weight_gemm_, alpha);
      // The one-hot term, per target once, after the GEMM (each reads and writes the accumulator's row).
      launch_target_rows(p_.x, ld_h, H, chunk_rows, p_.target, rows_.target_coef,
                         TargetRowsSink{.f32 = grad_weight_f32_, .ld_w = ld_h, .scale = {}}, stream_);
    }
    first_weight_gemm_ = false;
    if (g_->grad_bias)
      launch_bias_column_sums(dz_, ld_dz_, chunk_rows, V, 0, p_.target, rows_.target_coef, g_->grad_bias, stream_,
                              coefficients.dz_scale);
  }

  // The last chunk's weight gradient left for a finish (fused.h: DeviceCall::defer_weight_finish), with operands
  // that no later call reads from the inputs: its dz stays where it is (the kept logits' bytes), its x rows are
  // the gathered ones (a chunk of one part is copied there), and, where its target terms are not in the pair
  // already (a step of one chunk: nothing to add them to before its GEMM), its targets and coefficients, in chunk
  // order, go to Layout::deferred_targets (grad_x's bytes, free once this chunk's grad_x is finished: ordered on the
  // stream after grad_x_finish_kernel read them). Indexed 0..rows-1 in chunk order, the target term sums the same
  // products in the same order as with the inputs' rows, so its bits do not change.
  void defer(const Chunk& c, HiLoChunk chunk, HiLoChunk& out) {
    const std::int64_t rows = c.rows(), ld_h = p_.ld_h;
    if (chunk.x != x_rows_) {
      SIMPO_CUDA_CHECK(cudaMemcpyAsync(x_rows_, chunk.x, rows * ld_h * sizeof(T), cudaMemcpyDeviceToDevice, stream_));
      chunk.x = x_rows_;
    }
    if (chunk.finish) {
      out = chunk;
      return;
    }
    auto* coef = reinterpret_cast<float*>(deferred_targets_ + rows);
    std::int64_t offset = 0;
    for (int i = 0; i < c.part_count; ++i) {
      const RowRange& part = c.parts[i];
      SIMPO_CUDA_CHECK(cudaMemcpyAsync(deferred_targets_ + offset, p_.target + part.begin, part.rows() * 8,
                                       cudaMemcpyDeviceToDevice, stream_));
      SIMPO_CUDA_CHECK(cudaMemcpyAsync(coef + offset, rows_.target_coef + part.begin, part.rows() * 4,
                                       cudaMemcpyDeviceToDevice, stream_));
      offset += part.rows();
    }
    chunk.target_x = x_rows_;
    chunk.target_rows = ChunkRows{.begin = {0, 0}, .rows = {rows, 0}};
    chunk.target = deferred_targets_;
    chunk.target_coef = coef;
    out = chunk;
  }

  LogitRowsOf<T> part_logits(const RowRange& part, std::int64_t offset) const {
    return LogitRowsOf<T>{logits_ + offset * ld_v_, ld_v_, part.rows(), part.begin, p_.shape.V, p_.bias, p_.target,
                     p_.hp.ignore_index};
  }

  // A three_pass chunk's x rows (two parts) copied together into x_rows, where both the logits GEMM and the
  // weight GEMM take them: one GEMM of the chunk's rows instead of one per part (W read once per chunk, not twice).
  const T* gather_x(const Chunk& c) {
    const std::int64_t ld_h = p_.ld_h;
    if (c.part_count == 1) return p_.x + c.parts[0].begin * ld_h;
    std::int64_t offset = 0;
    for (int i = 0; i < c.part_count; ++i) {
      SIMPO_CUDA_CHECK(cudaMemcpyAsync(x_rows_ + offset * ld_h, p_.x + c.parts[i].begin * ld_h,
                                       c.parts[i].rows() * ld_h * sizeof(T), cudaMemcpyDeviceToDevice, stream_));
      offset += c.parts[i].rows();
    }
    return x_rows_;
  }

  // The fp32 logits of `rows` rows of x into the chunk's buffer from row `offset`: the promoted GEMM over whole
  // groups of 4 columns, the last V % 4 through cuBLAS cut along k as often, so they carry the same small bias.
  void logits_rows(std::int64_t rows, const T* x, std::int64_t offset) {
    const std::int64_t V = p_.shape.V, ld_h = p_.ld_h;
    float* out = logits_ + offset * ld_v_;
    const std::int64_t V4 = kBf16 && plan_.logits.promoted ? V / 4 * 4 : 0;
    if constexpr (kBf16)
      if (V4 > 0)
        promoted_logits(rows, V4, ld_h, x, p_.weight, out, ld_v_, plan_.logits.promotion_k, stream_, gemm_scratch_,
                        static_cast<std::size_t>(l_.gemm_bytes));
    if (V4 < V) gemms_.logits(rows, V - V4, ld_h, x, p_.weight + V4 * ld_h, out + V4, ld_v_, plan_.logits.k_splits);
  }

  // with_stats: the pass that produces the row statistics; store: the chunk's backward will read its logits (only
  // the epilogue statistics can skip storing them: row_stats_kernel reads them); x_chunk: the chunk's rows
  // gathered, for one GEMM over them all. With distances every stored chunk is distances, from the statistics GEMM
  // (the two_pass schedule's second pass writes the same partials again, unmerged).
  void logits_of(const Chunk& c, bool with_stats, bool store, const T* x_chunk) {
    const bool distances = plan_.logit_distances();
    const bool from_epilogue = (with_stats && plan_.epilogue_statistics) || (store && distances);
    if (!from_epilogue) {
      std::int64_t offset = 0;
      if (x_chunk != nullptr) logits_rows(c.rows(), x_chunk, 0);
      for (int i = 0; i < c.part_count; ++i) {
        const RowRange& part = c.parts[i];
        if (x_chunk == nullptr) logits_rows(part.rows(), p_.x + part.begin * p_.ld_h, offset);
        if (with_stats)
          launch_row_stats(part_logits(part, offset), rows_.row_max, rows_.lse, rows_.z_target, rows_.rowsum, stream_);
        offset += part.rows();
      }
      return;
    }
    if constexpr (kBf16) logits_from_epilogue(c, with_stats, store && distances, x_chunk);
  }

  // The promoted GEMM with the statistics (and, with `distances`, the stored distances) in its epilogue: one GEMM
  // over the chunk's rows where they are contiguous or gathered (x_chunk; LogitTileStats::split maps its second
  // part's rows), else one per part; with statistics only, in launches of at most statistics_launch_rows rows.
  // Then each part's tile partials are merged into its rows' statistics.
  void logits_from_epilogue(const Chunk& c, bool with_stats, bool distances, const T* x_chunk) {
    const std::int64_t V = p_.shape.V, ld_h = p_.ld_h;
    auto launch = [&](const __nv_bfloat16* x, std::int64_t rows, std::int64_t offset, std::int64_t begin,
                      std::int64_t split, std::int64_t second) {
      LogitTileStats out;
      out.bias = p_.bias;
      out.target = p_.target + begin;
      out.ignore_index = p_.hp.ignore_index;
      out.ld = l_.tile_ld;
      out.tile_max = tile_max_ + offset;
      out.tile_sum_exp = tile_sum_exp_ + offset;
      out.tile_sum = tile_sum_ + offset;
      out.z_target = rows_.z_target_raw + begin;
      out.split = split;
      out.second = second;
      if (distances)
        promoted_logits_distances(rows, V, ld_h, x, p_.weight, distances_ + offset * ld_v_, ld_v_,
                                  plan_.logits.promotion_k, out, stream_, gemm_scratch_,
                                  static_cast<std::size_t>(l_.gemm_bytes));
      else
        promoted_logits_stats(rows, V, ld_h, x, p_.weight, plan_.logits.promotion_k, out, stream_, gemm_scratch_,
                              static_cast<std::size_t>(l_.gemm_bytes));
    };
    auto gemm = [&](const __nv_bfloat16* x, std::int64_t rows, std::int64_t offset, std::int64_t begin,
                    std::int64_t split, std::int64_t second) {
      // A launch from row o on maps its rows past split - o (negative once o passes split) to the second part.
      launches(rows, distances ? 0 : plan_.logits.statistics_launch_rows, [&](std::int64_t o, std::int64_t n) {
        launch(x + o * ld_h, n, offset + o, begin + o, split - o, second);
      });
    };
    const RowRange& first = c.parts[0];
    if (c.part_count == 1) {
      gemm(p_.x + first.begin * ld_h, first.rows(), 0, first.begin, INT64_MAX, 0);
    } else if (x_chunk != nullptr) {
      gemm(x_chunk, c.rows(), 0, first.begin, first.rows(), c.parts[1].begin - first.begin - first.rows());
    } else {
      std::int64_t offset = 0;
      for (int i = 0; i < c.part_count; ++i) {
        gemm(p_.x + c.parts[i].begin * ld_h, c.parts[i].rows(), offset, c.parts[i].begin, INT64_MAX, 0);
        offset += c.parts[i].rows();
      }
    }
    if (!with_stats) return;
    std::int64_t offset = 0;
    for (int i = 0; i < c.part_count; ++i) {
      const RowRange& part = c.parts[i];
      const TileStatsRows tiles{tile_max_ + offset, tile_sum_exp_ + offset, tile_sum_ + offset, l_.tile_ld,
                                statistics_tiles(V), part.rows(), part.begin, rows_.z_target_raw, p_.target,
                                p_.hp.ignore_index};
      launch_merge_tile_stats(tiles, rows_.row_max, rows_.lse, rows_.z_target, rows_.rowsum, stream_);
      offset += part.rows();
    }
  }

  const DeviceProblemOf<T>& p_;
  const DeviceGradientsOf<T>* g_;
  const StepPlan& plan_;
  const Layout& l_;
  RowArrays rows_;
  void* gemm_scratch_;
  Gemms& gemms_;
  cudaStream_t stream_;
  std::int64_t ld_v_;
  float* logits_;
  std::uint16_t* distances_;  // the same bytes as logits_, [rows, ld_v]
  T* dz_;                     // the same bytes as logits_, [rows, ld_dz]
  std::int64_t ld_dz_;
  float* grad_x_part_;
  T* x_rows_;
  float *tile_max_, *tile_sum_exp_;
  double* tile_sum_;
  float* grad_weight_f32_ = nullptr;
  std::int64_t* deferred_targets_;  // [rows] int64, then [rows] fp32 (Layout::deferred_targets)
  HiLoChunk* deferred_;
  __nv_bfloat16 *hi_ = nullptr, *lo_ = nullptr;
  const T* x_chunk_ = nullptr;  // the kept chunk's gathered x rows, from forward to backward
  bool first_weight_gemm_ = true;
  std::size_t backward_chunks_ = 0;
};

// The low-memory schedule (README "The low-memory schedule"). Three steps:
//   1. statistics: per chunk of token rows, the promoted logits GEMM with the row statistics in its epilogue and
//      no output, its tile partials merged into the row statistics;
//   2. the pair math for every pair;
//   3. backward, per slice [v0, v1) of the vocabulary and, within it, per block [r0, r1) of token rows: the
//      tile's logits again, its dz from that GEMM's epilogue (V % 8 == 0; k and target_coef of every row first)
//      or by dz_kernel in place over them, grad_x[r0, r1) += dz W[v0, v1) into an fp32 [N, ld_h] accumulator,
//      grad_W[v0, v1) (+)= dz^T x[r0, r1) into the hi/lo pair (hi the bf16 output's rows, lo the workspace's
//      slice or the caller's lo) or fp32 rows (the fp32 output's, or the workspace's slice); the slice's grad_W
//      rows get their target terms (target_rows_kernel: per target once, rows in order, so the step stays
//      deterministic) and fp32 rows are rounded into a bf16 output; after the last slice grad_x is finished as in
//      the other schedules (target term, one rounding).
void run_low_memory(const DeviceProblem& p, const DeviceGradients& g, const StepPlan& plan, char* base,
                    const RowArrays& rows, Gemms& gemms, float* grad_x_sum, cudaStream_t stream,
                    const std::function<void()>& statistics_known) {
  const Shape& s = p.shape;
  const Hyperparameters& hp = p.hp;
  const std::int64_t N = s.N(), P = s.P(), V = s.V, H = s.H, ld_h = p.ld_h, tiles = statistics_tiles(V);
  const SlicedLayout& l = plan.sliced;
  const std::int64_t C = l.slice_columns, R = l.block_rows;
  void* gemm_scratch = base + plan.layout.gemm;
  const auto gemm_bytes = static_cast<std::size_t>(plan.layout.gemm_bytes);
  const std::int64_t promotion_k = plan.logits.promotion_k;
  float* tile_max = at<float>(base, l.tile_max);
  float* tile_sum_exp = at<float>(base, l.tile_sum_exp);
  double* tile_sum = at<double>(base, l.tile_sum);
  // The tile: dz from the GEMM's epilogue ([R, C] bf16), or fp32 logits [R, C] with dz in place over them.
  float* logits = at<float>(base, l.tile);
  auto* dz = at<__nv_bfloat16>(base, l.tile);
  const std::int64_t ld_dz = plan.dz_in_epilogue ? C : 2 * C;
  float* row_k = at<float>(base, l.row_k);
  const bool hilo = plan.grad_weight == StepPlan::GradWeight::sliced_hilo;
  const bool own_slice = g.grad_weight == nullptr;  // no fp32 output to write the slice's rows into

  if (g.grad_bias) SIMPO_CUDA_CHECK(cudaMemsetAsync(g.grad_bias, 0, V * 4, stream));

  // 1. statistics
  for (const Chunk& c : plan.schedule.chunks)
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
      launches(part.rows(), plan.logits.statistics_launch_rows, [&](std::int64_t o, std::int64_t n) {
        LogitTileStats piece = out;
        piece.target += o;
        piece.tile_max += o;
        piece.tile_sum_exp += o;
        piece.tile_sum += o;
        piece.z_target = rows.z_target_raw + part.begin + o;
        promoted_logits_stats(n, V, ld_h, p.x + (part.begin + o) * ld_h, p.weight, promotion_k, piece, stream,
                              gemm_scratch, gemm_bytes);
      });
      const TileStatsRows partials{tile_max, tile_sum_exp, tile_sum, l.stat_rows, tiles, part.rows(), part.begin,
                                   rows.z_target_raw, p.target, hp.ignore_index};
      launch_merge_tile_stats(partials, rows.row_max, rows.lse, rows.z_target, rows.rowsum, stream);
    }
  if (statistics_known) statistics_known();
  // 2. pair math
  launch_pair_math(pair_params(p), 0, P, p.target, rows.lse, rows.z_target, rows.completion_tokens, rows.avg_grad,
                   stream);
  const CoefficientParams coefficients = coefficient_params(p, rows);
  if (plan.dz_in_epilogue)
    launch_row_coefficients(N, p.target, hp.ignore_index, coefficients, rows.lse, rows.z_target, row_k,
                            rows.target_coef, stream);

  // 3. backward, a tile of the vocabulary slice by row block at a time. Where every row's coefficient is known
  // before the first tile (dz from the epilogue: row_coefficients_kernel), a pair's target terms go in after the
  // slice's first block and its last block writes hi alone (HiLoChunk::finish); else they follow the last block.
  const bool terms_after_first_block = hilo && plan.dz_in_epilogue;
  for (std::int64_t v0 = 0; v0 < V; v0 += C) {
    const std::int64_t columns = std::min(C, V - v0);  // a multiple of 4: V % 4 == 0, C % 192 == 0
    const __nv_bfloat16* w_slice = p.weight + v0 * ld_h;
    // The slice's grad_W rows, row 0 = vocabulary row v0: the pair, or fp32 rows.
    __nv_bfloat16* hi = hilo ? g.grad_weight_16bit + v0 * H : nullptr;
    __nv_bfloat16* lo = !hilo                ? nullptr
                        : g.grad_weight_lo ? g.grad_weight_lo + v0 * H
                                           : at<__nv_bfloat16>(base, l.grad_w_slice);
    float* gw = hilo ? nullptr : own_slice ? at<float>(base, l.grad_w_slice) : g.grad_weight + v0 * ld_h;
    const TargetRowsSink sink{.hi = hi, .lo = lo, .f32 = gw, .ld_w = hilo ? H : ld_h, .v_begin = v0,
                              .v_end = v0 + columns};
    auto add_target_terms = [&] {
      launch_target_rows(p.x, ld_h, H, ChunkRows{.begin = {0, 0}, .rows = {N, 0}}, p.target, rows.target_coef, sink,
                         stream);
    };
    for (std::int64_t r0 = 0; r0 < N; r0 += R) {
      const std::int64_t block = std::min(R, N - r0);
      const __nv_bfloat16* x_block = p.x + r0 * ld_h;
      const __nv_bfloat16* bias_slice = p.bias ? p.bias + v0 : nullptr;
      if (plan.dz_in_epilogue) {
        const DzTile tile{bias_slice, p.target, r0, v0, rows.row_max, rows.lse, row_k};
        promoted_logits_dz(block, columns, ld_h, x_block, w_slice, dz, ld_dz, promotion_k, tile, stream, gemm_scratch,
                           gemm_bytes);
      } else {
        promoted_logits(block, columns, ld_h, x_block, w_slice, logits, C, promotion_k, stream, gemm_scratch,
                        gemm_bytes);
        LogitRows tile{logits, C, block, r0, columns, bias_slice, p.target, hp.ignore_index};
        tile.column_begin = v0;
        launch_dz(tile, coefficients, rows.row_max, rows.lse, rows.z_target, dz, ld_dz, rows.target_coef, stream);
      }
      gemms.grad_x(block, columns, ld_h, dz, ld_dz, w_slice, grad_x_sum + r0 * ld_h, /*accumulate=*/v0 > 0);
      if (hilo) {
        accumulate_hilo(HiLoChunk{.rows = block, .V = columns, .H = H, .dz = dz, .ld_dz = ld_dz, .x = x_block,
                                  .ld_x = ld_h, .hi = hi, .lo = lo, .overwrite = r0 == 0,
                                  .finish = terms_after_first_block && r0 > 0 && r0 + block == N,
                                  .lo_is_output = g.grad_weight_lo != nullptr, .gemm_scratch = gemm_scratch,
                                  .gemm_scratch_bytes = gemm_bytes},
                        Scale{}, stream);
        if (terms_after_first_block && r0 == 0) add_target_terms();
      } else {
        gemms.accumulate_grad_weight(block, columns, ld_h, dz, ld_dz, x_block, gw, /*overwrite=*/r0 == 0);
      }
      // After this block's dz: target_coef holds its rows' coefficients (row_coefficients_kernel, or dz_kernel).
      if (g.grad_bias)
        launch_bias_column_sums(dz, ld_dz, ChunkRows{.begin = {r0, 0}, .rows = {block, 0}}, columns, v0, p.target,
                                rows.target_coef, g.grad_bias + v0, stream);
    }
    // target_coef holds every row's coefficient now (row_coefficients_kernel, or each block's dz_kernel)
    if (!terms_after_first_block) add_target_terms();
    if (!hilo && g.grad_weight_16bit)
      launch_round_to(gw, ld_h, columns, H, g.grad_weight_16bit + v0 * H, stream,
                      g.grad_weight_lo != nullptr ? g.grad_weight_lo + v0 * H : nullptr);
  }
  launch_grad_x_finish(grad_x_sum, N, 0, H, ld_h, p.weight, p.target, rows.target_coef, g.grad_x, stream, g.grad_x_lo);
  if (g.grad_bias && g.grad_bias_16bit) launch_round_to(g.grad_bias, V, 1, V, g.grad_bias_16bit, stream, g.grad_bias_lo);
}

const char* accumulator_purpose(StepPlan::GradWeight form) {
  switch (form) {
    case StepPlan::GradWeight::hilo: return "the bf16 lo half of the grad_weight hi/lo pair";
    case StepPlan::GradWeight::f32_own: return "the fp32 grad_weight accumulator";
    case StepPlan::GradWeight::sliced:
    case StepPlan::GradWeight::sliced_hilo: return "the fp32 grad_x accumulator of the low-memory schedule";
    default: return "an accumulator";
  }
}

}  // namespace

FusedRunner::FusedRunner() {
  SIMPO_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  SIMPO_CUDA_CHECK(cudaEventCreateWithFlags(&tokens_copied_, cudaEventDisableTiming));
  SIMPO_CUDA_CHECK(cudaEventCreateWithFlags(&verdict_ready_, cudaEventDisableTiming));
  SIMPO_CUDA_CHECK(cudaEventCreateWithFlags(&caller_ready_, cudaEventDisableTiming));
  SIMPO_CUDA_CHECK(cudaEventCreateWithFlags(&run_done_, cudaEventDisableTiming));
}

FusedRunner::~FusedRunner() {
  gemms_.reset();
  workspace_ = DeviceBuffer();  // its free is ordered on stream_, so before the stream goes
  accumulator_ = DeviceBuffer();
  targets_ = DeviceBuffer();
  if (stream_) cudaStreamSynchronize(stream_);  // no copy still reads staging_ when it goes
  if (tokens_copied_) cudaEventDestroy(tokens_copied_);
  if (verdict_ready_) cudaEventDestroy(verdict_ready_);
  if (caller_ready_) cudaEventDestroy(caller_ready_);
  if (run_done_) cudaEventDestroy(run_done_);
  if (stream_) cudaStreamDestroy(stream_);
}

// The host's completion-token counts into the workspace, before any stage reads them (the pair math), through
// staging_. The staged bytes are rewritten only once the last run's copy of them has happened. Counts already on
// the device (the targets kernel's) are read where they are: no copy.
template <class T>
const std::int64_t* FusedRunner::completion_tokens(const DeviceProblemOf<T>& p, std::int64_t* to) {
  if (p.on_device.completion_tokens != nullptr) return p.on_device.completion_tokens;
  const std::size_t bytes = static_cast<std::size_t>(p.shape.B) * 8;
  SIMPO_CUDA_CHECK(cudaEventSynchronize(tokens_copied_));
  // Room for download_row_stats too, so that it never reallocates under this copy.
  char* staged = staging_.reserve(std::max(bytes, static_cast<std::size_t>(p.shape.N()) * 16));
  std::memcpy(staged, p.targets.n.data(), bytes);
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(to, staged, bytes, cudaMemcpyHostToDevice, stream_));
  SIMPO_CUDA_CHECK(cudaEventRecord(tokens_copied_, stream_));
  return to;
}

void FusedRunner::release_workspace() {
  workspace_ = DeviceBuffer();
  accumulator_ = DeviceBuffer();
  targets_ = DeviceBuffer();
}

void FusedRunner::follow(cudaStream_t caller) {
  SIMPO_CUDA_CHECK(cudaEventRecord(caller_ready_, caller));
  SIMPO_CUDA_CHECK(cudaStreamWaitEvent(stream_, caller_ready_, 0));
}

void FusedRunner::precede(cudaStream_t caller) {
  SIMPO_CUDA_CHECK(cudaEventRecord(run_done_, stream_));
  SIMPO_CUDA_CHECK(cudaStreamWaitEvent(caller, run_done_, 0));
}

DeviceTargets FusedRunner::device_targets(std::int64_t N, std::int64_t B) {
  const auto bytes = static_cast<std::size_t>(device_targets_bytes(N, B));
  if (targets_.bytes() < bytes) {
    targets_ = DeviceBuffer();
    targets_ = DeviceBuffer(bytes, "the checked targets", stream_);
  }
  return device_targets_at(targets_.get(), N, B);
}

// One allocation for all scratch, reused across runs of the same size; the cuBLAS handles are made once.
char* FusedRunner::allocate_workspace(const Layout& layout, std::int64_t total) {
  if (!gemms_ || workspace_.bytes() != static_cast<std::size_t>(total) || layout.gemm_bytes != gemm_bytes_) {
    workspace_ = DeviceBuffer();  // free the old one first: peak memory is one workspace, never two
    workspace_ = DeviceBuffer(static_cast<std::size_t>(total), "the fused workspace", stream_);
    bind_gemm_scratch(workspace_.as<char>() + layout.gemm, layout.gemm_bytes);
  }
  return workspace_.as<char>();
}

// cuBLASLt's scratch for the next GEMMs: in the runner's workspace or a caller's (the handles are made once).
void FusedRunner::bind_gemm_scratch(void* scratch, std::int64_t bytes) {
  if (gemms_) gemms_->set_workspace(scratch, static_cast<std::size_t>(bytes));
  else gemms_ = std::make_unique<Gemms>(stream_, scratch, static_cast<std::size_t>(bytes));
  gemm_bytes_ = bytes;
}

// The runner's own buffer for an accumulator, kept across runs of the same size.
void* FusedRunner::allocate_accumulator(std::size_t bytes, const char* purpose) {
  if (accumulator_.bytes() != bytes) {
    accumulator_ = DeviceBuffer();
    accumulator_ = DeviceBuffer(bytes, purpose, stream_);
  }
  return accumulator_.get();
}

// The three copies queue behind the step into pinned staging and the host waits once; into the vectors' pageable
// memory each copy would wait for the last, leaving the device idle between them.
RowStats FusedRunner::download_row_stats(std::int64_t N, const float* lse, const float* z_target,
                                         const double* rowsum) {
  RowStats stats(N);
  char* staged = staging_.reserve(static_cast<std::size_t>(N) * 16);  // rowsum first: 8-byte aligned
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(staged, rowsum, N * 8, cudaMemcpyDeviceToHost, stream_));
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(staged + N * 8, lse, N * 4, cudaMemcpyDeviceToHost, stream_));
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(staged + N * 12, z_target, N * 4, cudaMemcpyDeviceToHost, stream_));
  SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::memcpy(stats.rowsum.data(), staged, N * 8);
  std::memcpy(stats.lse.data(), staged + N * 8, N * 4);
  std::memcpy(stats.z_target.data(), staged + N * 12, N * 4);
  report_.gemm_fallbacks = gemms_->fallback_calls();
  return stats;
}

template <class T>
RowStats FusedRunner::run(const DeviceProblemOf<T>& p, const std::type_identity_t<DeviceGradientsOf<T>>* g,
                          const Options& options, const Tuning& tuning, const CallerMemory* memory,
                          HiLoChunk* deferred, float* const* forward_out) {
  if (p.ld_h != padded(p.shape.H)) throw CudaError("DeviceProblem::ld_h must be padded(H)");
  if (g && !g->grad_x && !g->grad_weight_16bit && !g->grad_weight)
    throw CudaError("DeviceGradients: no gradient output is set (forward only: pass no DeviceGradients)");
  const GradientOutputs outputs{.grad_x = g && g->grad_x,
                                .grad_weight_f32 = g && g->grad_weight,
                                .grad_weight_16bit = g && g->grad_weight_16bit,
                                .grad_weight_lo = g && g->grad_weight_lo};
  report_ = RunReport{plan_step(p.shape, dtype_of<T>(), options, device_features(), g ? &outputs : nullptr, tuning)};
  const StepPlan& plan = report_;

  if (deferred && !memory)
    throw CudaError("FusedRunner::run: a deferred weight gradient needs caller memory (its operands outlive the run)");
  void* accumulator = nullptr;
  char* base = nullptr;
  if (memory) {
    if (memory->bytes < plan.caller_workspace_bytes())
      throw InputError("cuda backend: the caller's workspace of " + std::to_string(memory->bytes) + " bytes is too "
                       "small for " + plan.to_string() + ": it needs " + std::to_string(plan.caller_workspace_bytes()) +
                       " (fused.h: device_workspace)");
    workspace_ = DeviceBuffer();  // the runner's own goes back to the pool: never two workspaces at once
    accumulator_ = DeviceBuffer();
    base = memory->base;
    if (plan.accumulator_bytes > 0) accumulator = base + plan.accumulator_offset();
    bind_gemm_scratch(base + plan.layout.gemm, plan.layout.gemm_bytes);
  } else {
    accumulator = plan.accumulator_bytes > 0 ? allocate_accumulator(static_cast<std::size_t>(plan.accumulator_bytes),
                                                                    accumulator_purpose(plan.grad_weight))
                                             : nullptr;
    base = allocate_workspace(plan.layout, plan.workspace_bytes);
  }
  const RowArrays rows(base, plan.layout, completion_tokens(p, at<std::int64_t>(base, plan.layout.completion_tokens)));
  report_.deferred_weight = deferred != nullptr && plan.defers_weight_finish();
  // With forward_out: the forward outputs and, for a validated call, the verdict (the device's checks, copied into
  // pinned memory), as soon as every row's statistics exist, so that verdict() returns while the gradient work may
  // still run.
  std::function<void()> forward_outputs;
  if (forward_out) forward_outputs = [&] {
    ForwardOutputsParams f{.B = p.shape.B, .T = p.shape.T, .V = p.shape.V, .ignore_index = p.hp.ignore_index,
                           .beta = p.hp.beta, .gamma = p.hp.gamma, .label_smoothing = p.hp.label_smoothing,
                           .alpha = p.hp.alpha, .compute_nll_loss = p.hp.compute_nll_loss, .target = p.target,
                           .lse = rows.lse, .z_target = rows.z_target, .rowsum = rows.rowsum, .targets = p.on_device,
                           .out = {}};
    for (int i = 0; i < 8; ++i) f.out[i] = forward_out[i];
    launch_forward_outputs(f, stream_);
    if (!options.validate) return;
    // invalid and nonfinite are adjacent (device_forward.h)
    SIMPO_CUDA_CHECK(cudaMemcpyAsync(verdict_.reserve(2 * sizeof(int)), p.on_device.invalid, 2 * sizeof(int),
                                     cudaMemcpyDeviceToHost, stream_));
    SIMPO_CUDA_CHECK(cudaEventRecord(verdict_ready_, stream_));
  };
  if (plan.low_memory) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)  // the plan picks it only where the promoted GEMM runs
      run_low_memory(p, *g, plan, base, rows, *gemms_, static_cast<float*>(accumulator), stream_, forward_outputs);
  } else {
    ChunkedStep<T> step(p, g, plan, base, rows, *gemms_, accumulator, stream_,
                        report_.deferred_weight ? deferred : nullptr);
    step.prologue();
    walk(plan.schedule, p.shape, step.stages(forward_outputs));
    step.epilogue();
  }
  if (forward_out == nullptr) return download_row_stats(p.shape.N(), rows.lse, rows.z_target, rows.rowsum);
  report_.gemm_fallbacks = gemms_->fallback_calls();
  return RowStats{};
}

FusedRunner::Verdict FusedRunner::verdict() {
  SIMPO_CUDA_CHECK(cudaEventSynchronize(verdict_ready_));
  const int* v = reinterpret_cast<const int*>(verdict_.reserve(2 * sizeof(int)));
  return Verdict{.invalid_targets = v[0] != 0, .nonfinite_statistics = v[1] != 0};
}

template RowStats FusedRunner::run<__nv_bfloat16>(const DeviceProblemOf<__nv_bfloat16>&,
                                                  const DeviceGradientsOf<__nv_bfloat16>*, const Options&,
                                                  const Tuning&, const CallerMemory*, HiLoChunk*, float* const*);
template RowStats FusedRunner::run<__half>(const DeviceProblemOf<__half>&, const DeviceGradientsOf<__half>*,
                                           const Options&, const Tuning&, const CallerMemory*, HiLoChunk*, float* const*);
template RowStats FusedRunner::run<float>(const DeviceProblemOf<float>&, const DeviceGradientsOf<float>*,
                                          const Options&, const Tuning&, const CallerMemory*, HiLoChunk*, float* const*);

}  // namespace simpo::fused::cuda
