// The fused step's own kernels, in the order a chunk meets them (GEMMs: gemm.cu, promoted_gemm.cu):
//
//   kernel                    pass            what it does
//   row_stats_kernel          1 (forward)     per token row of fp32 logits (+ bias): max, log-sum-exp, the target
//                                             logit, the row sum (for the logits means)
//   merge_tile_stats_kernel   1 (forward)     the same four from the logits GEMM epilogue's per-tile partials
//                                             (promoted_stats.h), which replace row_stats_kernel's read of the logits
//   pair_math_kernel          between 1 and 2 per pair: the two sequences' averages of log p and dL/davg of each
//   dz_kernel                 2 (backward)    per row: dz = -k softmax in the inputs' dtype (0 at the target), k (1 - p_t);
//                                             in place over the row's fp32 logits (a barrier per 2048 columns)
//   dz_from_distances_kernel  2 (backward)    the same from the 16-bit logit distances (promoted_stats.h), in place
//                                             over them (Options::logit_distances)
//   row_coefficients_kernel   2               per row: k and k (1 - p_t) alone, where dz comes from the logits
//                                             GEMM's epilogue (promoted_dz.h; the low-memory schedule)
//   grad_x_finish_kernel      2               per row: grad_x = T(GEMM part + k (1 - p_t) W[target])
//   target_scatter_kernel     2               per row: grad_W[target] += k (1 - p_t) x, fp32 atomics (the
//                                             vocabulary-parallel ranks' shards)
//   bias_column_sums_kernel   2               grad_bias += column sums of dz and the target terms, rows in order
//   target_rows_kernel        2               grad_W[target] += k (1 - p_t) x into the hi/lo pair (hilo_gemm.h) or an
//                                             fp32 accumulator, or their rows of one vocabulary slice (the low-memory
//                                             schedule): per target, one block sums its rows and adds once
//   hilo_tail_kernel          2               the last V % 8 rows of dz^T x into the hi/lo pair (the GEMM's TMA
//                                             takes whole groups of 8)
//   round_to_kernel           end             the fp32 grad_weight / grad_bias accumulators into the outputs
#include "fused/cuda/kernels.h"

#include <algorithm>

#include "fused/cuda/cuda_check.h"
#include "fused/cuda/row_reduce.cuh"
#include "fused/simpo_math.h"

namespace simpo::fused::cuda {
namespace {

namespace m = ::simpo::fused::math;

// kRowThreads, the 16-byte loads and stores, the warp and block reductions, reduce_row: row_reduce.cuh.
using namespace ::simpo::fused::cuda::rows;

// ---- pass 1: row statistics ----
// One block per row, one read of the row (reduce_row).
template <bool kBias, class T>
__global__ void __launch_bounds__(kRowThreads) row_stats_kernel(LogitRowsOf<T> a, float* row_max, float* lse,
                                                               float* z_target, double* rowsum) {
  const std::int64_t local = blockIdx.x, r = a.row_begin + local;
  const float* row = a.logits + local * a.ld_logits;
  const RowReduction reduced = reduce_row<kBias>(row, a.bias, a.V);
  if (threadIdx.x == 0) {
    const m::LogSumExp<float> total = reduced.lse;
    // Relative to the row max (see RowStats in fused/forward_outputs.h): l = z_target - lse is then exact to
    // fp32 even when the target is the max logit and l ~ 0, where unshifted values would lose ulp(lse).
    const std::int64_t t = a.target[r];
    row_max[r] = total.max;
    lse[r] = m::lse_value(m::LogSumExp<float>{0.0f, total.sum});
    z_target[r] = t != a.ignore_index ? load1<kBias>(row, a.bias, t) - total.max : 0.0f;
    rowsum[r] = reduced.sum;
  }
}

// 32 rows per block, 32 warps striding over the tiles: each warp reads 32 consecutive rows of one tile
// (coalesced in the [tiles, ld] layout), then warp 0 merges the 32 partial states per row. The time is the loads'
// latency, not their bytes (16 per row and tile): a few hundred tiles per row at V = 128k and few rows per launch
// (a 4096-row chunk is 128 blocks, about one per SM), so each block holds a full SM's warps and each warp keeps
// kMergeChains independent states, one load of each in flight.
constexpr int kMergeRows = 32, kMergeThreads = 1024, kMergeWarps = kMergeThreads / 32, kMergeChains = 4;
__global__ void __launch_bounds__(kMergeThreads) merge_tile_stats_kernel(TileStatsRows a, float* row_max, float* lse,
                                                                      float* z_target, double* rowsum) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t local = std::int64_t(blockIdx.x) * kMergeRows + lane;
  m::LogSumExp<float> chains[kMergeChains];
  double sums[kMergeChains] = {};
  for (auto& chain : chains) chain = m::lse_empty<float>();
  if (local < a.rows) {
    std::int64_t t = warp;
    for (; t + (kMergeChains - 1) * kMergeWarps < a.tiles; t += kMergeChains * kMergeWarps)
#pragma unroll
      for (int c = 0; c < kMergeChains; ++c) {
        const std::int64_t at = (t + c * kMergeWarps) * a.ld + local;
        chains[c] = m::lse_merge(chains[c], m::LogSumExp<float>{a.tile_max[at], a.tile_sum_exp[at]});
        sums[c] += a.tile_sum[at];
      }
#pragma unroll
    for (int c = 0; c < kMergeChains; ++c) {  // the last tiles, fewer than a round (constant indices: registers)
      const std::int64_t tile = t + c * kMergeWarps, at = tile * a.ld + local;
      if (tile < a.tiles) {
        chains[c] = m::lse_merge(chains[c], m::LogSumExp<float>{a.tile_max[at], a.tile_sum_exp[at]});
        sums[c] += a.tile_sum[at];
      }
    }
  }
  m::LogSumExp<float> state = chains[0];
  double sum = sums[0];
  for (int c = 1; c < kMergeChains; ++c) {
    state = m::lse_merge(state, chains[c]);
    sum += sums[c];
  }
  __shared__ float shared_max[kMergeWarps][kMergeRows], shared_sum[kMergeWarps][kMergeRows];
  __shared__ double shared_total[kMergeWarps][kMergeRows];
  shared_max[warp][lane] = state.max;
  shared_sum[warp][lane] = state.sum;
  shared_total[warp][lane] = sum;
  __syncthreads();
  if (warp != 0 || local >= a.rows) return;
  m::LogSumExp<float> total = m::lse_empty<float>();
  double total_sum = 0;
  for (int w = 0; w < kMergeWarps; ++w) {
    total = m::lse_merge(total, m::LogSumExp<float>{shared_max[w][lane], shared_sum[w][lane]});
    total_sum += shared_total[w][lane];
  }
  const std::int64_t r = a.row_begin + local, t = a.target[r];
  row_max[r] = total.max;
  lse[r] = m::lse_value(m::LogSumExp<float>{0.0f, total.sum});  // relative to the max, as row_stats_kernel
  z_target[r] = t != a.ignore_index ? a.z_target_raw[r] - total.max : 0.0f;
  rowsum[r] = total_sum;
}

// A Scale's factor, read where the kernel runs.
__device__ inline float value_of(const Scale& s) { return s.device != nullptr ? *s.device : s.value; }

// ---- per pair ----
// One block per pair: the two sequences' sums of m l (double), then thread 0 does the pair's scalar math.
__global__ void __launch_bounds__(kRowThreads) pair_math_kernel(PairParams p, std::int64_t pair_begin,
                                                               const std::int64_t* target, const float* lse,
                                                               const float* z_target, const std::int64_t* n,
                                                               double* avg_grad) {
  const std::int64_t i = pair_begin + blockIdx.x, chosen = i, rejected = p.P + i;
  double chosen_sum = 0, rejected_sum = 0;
  for (std::int64_t t = threadIdx.x; t < p.T; t += kRowThreads) {
    const std::int64_t rc = chosen * p.T + t, rr = rejected * p.T + t;
    if (target[rc] != p.ignore_index) chosen_sum += double(z_target[rc]) - double(lse[rc]);
    if (target[rr] != p.ignore_index) rejected_sum += double(z_target[rr]) - double(lse[rr]);
  }
  __shared__ double shared_c[kWarps], shared_r[kWarps];
  chosen_sum = block_sum(chosen_sum, shared_c);
  rejected_sum = block_sum(rejected_sum, shared_r);
  if (threadIdx.x == 0) {
    const double c = m::sequence_average(chosen_sum, static_cast<long long>(n[chosen]));
    const double r = m::sequence_average(rejected_sum, static_cast<long long>(n[rejected]));
    const m::PairTerm<double> term = m::pair_term(c, r, p.beta, p.gamma, p.label_smoothing);
    avg_grad[chosen] = m::avg_gradient(term.dterm, p.beta, static_cast<long long>(p.P), true);
    avg_grad[rejected] = m::avg_gradient(term.dterm, p.beta, static_cast<long long>(p.P), false);
  }
}

// ---- pass 2: dz ----
// One block per row, one read of the logits row and one write of the bf16 dz row (16 bytes per access).
// The target column is written as 0: its value, k (1 - p_target), would lose its small part in bf16 next to
// the large softmax terms, so it travels separately in fp32 (target_coef).
//
// dz may overwrite the logits it comes from (the fused runner's in-place dz: row r's bf16 dz at the start of its
// fp32 logits bytes, ld_dz = 2 ld_logits). Columns [v, v + 8) of dz land on fp32 columns [v/2, v/2 + 4), which
// another thread of the same 2048-column step reads; so each step reads its tile, the block meets at a barrier,
// and only then writes. A step's writes reach fp32 columns < (its start + 2048) / 2, all read by then, and never
// a later step's. Separate buffers take the same path (one barrier per 2048 columns).
// k of row r in double from the pair math, stored as float: the same steps as fused/forward_outputs.cpp.
__device__ inline double nll_weight_of(const CoefficientParams& c) {
  if (c.n_chosen == nullptr) return c.nll_weight;
  const std::int64_t n_chosen = *c.n_chosen;
  return n_chosen > 0 ? c.alpha / static_cast<double>(n_chosen) : 0.0;
}
__device__ inline float row_k(const CoefficientParams& c, std::int64_t r, bool completion) {
  const std::int64_t b = r / c.T;
  return static_cast<float>(m::row_coefficient(c.grad_scale, completion, c.avg_grad[b],
                                               static_cast<long long>(c.completion_tokens[b]),
                                               b < c.P ? nll_weight_of(c) : 0.0));
}

template <bool kBias, class T>
__global__ void __launch_bounds__(kRowThreads) dz_kernel(LogitRowsOf<T> a, CoefficientParams c, const float* row_max,
                                                        const float* lse, const float* z_target, T* dz,
                                                        std::int64_t ld_dz, float* target_coef) {
  const std::int64_t local = blockIdx.x, r = a.row_begin + local;
  const float* row = a.logits + local * a.ld_logits;
  T* out = dz + local * ld_dz;
  const std::int64_t target = a.target[r];
  const bool completion = target != a.ignore_index;
  const std::int64_t t = target - a.column_begin;  // the target's column in this buffer (maybe outside it)
  const float k = row_k(c, r, completion), k_dz = k * c.dz_scale;
  const float shift = row_max[r], row_lse = lse[r];  // softmax_v = exp((z_v - max) - lse_relative)
  const float z_t = z_target[r];  // read before any write (z_target is never the logits buffer, but cheap)
  const std::int64_t V8 = a.V / 8 * 8;
  constexpr std::int64_t kStep = kRowThreads * 8;

  for (std::int64_t base = 0; base < V8; base += kStep) {  // same trip count in every thread: barriers inside
    const std::int64_t v = base + std::int64_t(threadIdx.x) * 8;
    float z[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (v < V8 && k != 0.0f) {  // k == 0 (ignored rows, empty sequences): a zero row, no exponentials
      load8<kBias>(row, a.bias, v, z);
#pragma unroll
      for (int i = 0; i < 8; ++i) z[i] = (v + i == t) ? 0.0f : m::softmax_gradient(k_dz, z[i] - shift, row_lse);
    }
    __syncthreads();
    if (v < V8) store8(out + v, z);
  }
  // The last V % 8 columns and the zero padding up to a multiple of 8 (never past ld_dz): < 8 columns, read by
  // threads 0..7, written after the barrier.
  const std::int64_t padded_v = (a.V + 7) / 8 * 8, end = ld_dz < padded_v ? ld_dz : padded_v;
  const std::int64_t v = V8 + threadIdx.x;
  float value = 0.0f;
  if (v < a.V && v != t && k != 0.0f)
    value = m::softmax_gradient(k_dz, load1<kBias>(row, a.bias, v) - shift, row_lse);
  __syncthreads();
  if (v < end) out[v] = from_float<T>(value);
  if (threadIdx.x == 0) target_coef[r] = completion ? m::target_coefficient(k, z_t, row_lse) : 0.0f;
}

// The same from the logit distances (fused/simpo_math.h): z - max = (tile max - max) - q 2^-11. Each 8-column step
// lies in one tile (tiles are multiples of 8 wide); its tile max is one load, shared by the warp's threads of that
// tile. dz over the distances in place is safe without barriers: a thread reads its own 16 bytes before writing
// 16 bytes of dz to the same place. The pass moves 4 bytes a logit and little else, so its time is the loads in
// flight: each thread loads kDistanceSteps 8-column steps before it stores any (the compiler cannot hoist a load
// above the store before it, in place).
constexpr int kDistanceSteps = 2;
__global__ void __launch_bounds__(kRowThreads) dz_from_distances_kernel(LogitDistanceRows a, CoefficientParams c,
                                                                       const float* row_max, const float* lse,
                                                                       const float* z_target, __nv_bfloat16* dz,
                                                                       std::int64_t ld_dz, float* target_coef) {
  const std::int64_t local = blockIdx.x, r = a.row_begin + local;
  const std::uint16_t* row = a.distances + local * a.ld;
  __nv_bfloat16* out = dz + local * ld_dz;
  const std::int64_t target = a.target[r];
  const bool completion = target != a.ignore_index;
  const float k = row_k(c, r, completion);
  const float shift = row_max[r], row_lse = lse[r];
  const float* maxima = a.tile_max + local;
  constexpr std::int64_t kStride = kRowThreads * 8;
  for (std::int64_t v0 = std::int64_t(threadIdx.x) * 8; v0 < a.V; v0 += kStride * kDistanceSteps) {
    uint4 raw[kDistanceSteps];
    float above[kDistanceSteps];  // each step's tile max relative to the row's
    // k == 0 (ignored rows, empty sequences): a zero row, no loads and no exponentials
#pragma unroll
    for (int s = 0; s < kDistanceSteps; ++s) {
      const std::int64_t v = v0 + s * kStride;
      if (k != 0.0f && v < a.V) {
        raw[s] = *reinterpret_cast<const uint4*>(row + v);
        above[s] = maxima[(v / a.tile_columns) * a.tile_ld] - shift;
      }
    }
#pragma unroll
    for (int s = 0; s < kDistanceSteps; ++s) {
      const std::int64_t v = v0 + s * kStride;
      if (v >= a.V) break;
      float g[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (k != 0.0f) {
        const auto* q = reinterpret_cast<const std::uint16_t*>(&raw[s]);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          g[i] = (v + i == target)
                     ? 0.0f
                     : m::softmax_gradient(k, m::logit_from_distance(above[s], static_cast<float>(q[i])), row_lse);
      }
      store8(out + v, g);
    }
  }
  if (threadIdx.x == 0) target_coef[r] = completion ? m::target_coefficient(k, z_target[r], row_lse) : 0.0f;
}

// Pass 2 without a dz pass (promoted_dz.h computes dz in the logits GEMM's epilogue): per row, k and
// target_coef, the two values dz_kernel derives besides dz itself. One thread per row.
__global__ void __launch_bounds__(kRowThreads) row_coefficients_kernel(std::int64_t N, const std::int64_t* target,
                                                                      std::int64_t ignore_index, CoefficientParams c,
                                                                      const float* lse, const float* z_target,
                                                                      float* k_out, float* target_coef) {
  for (std::int64_t r = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; r < N;
       r += std::int64_t(gridDim.x) * blockDim.x) {
    const bool completion = target[r] != ignore_index;
    const float k = row_k(c, r, completion);
    k_out[r] = k;
    target_coef[r] = completion ? m::target_coefficient(k, z_target[r], lse[r]) : 0.0f;
  }
}

// ---- after the gradient GEMMs ----

// One block per row: grad_x = T(gemm + c W[target]); 16-byte accesses when H is a multiple of 8.
template <bool kVector, class T>
__global__ void __launch_bounds__(kRowThreads) grad_x_finish_kernel(const float* part, std::int64_t row_begin,
                                                                   std::int64_t H, std::int64_t ld_h, const T* weight,
                                                                   const std::int64_t* target, const float* coef,
                                                                   T* out, T* out_lo) {
  const std::int64_t local = blockIdx.x, r = row_begin + local;
  const float c = coef[r];
  const float* in = part + local * ld_h;
  T* dst = out + r * H;
  T* dst_lo = out_lo != nullptr ? out_lo + r * H : nullptr;
  // c is 0 on ignored rows (whose target is not a valid row of W) and wherever k is 0.
  const T* w = c != 0.0f ? weight + target[r] * ld_h : nullptr;
  if constexpr (kVector) {
    for (std::int64_t h = std::int64_t(threadIdx.x) * 8; h < H; h += kRowThreads * 8) {
      float v[8];
      load8(in + h, v);
      if (w) {
        float wv[8];
        load8(w + h, wv);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] += c * wv[i];
      }
      store8_hilo(dst + h, dst_lo != nullptr ? dst_lo + h : nullptr, v);
    }
  } else {
    for (std::int64_t h = threadIdx.x; h < H; h += kRowThreads) {
      float v = in[h];
      if (w) v += c * to_float(w[h]);
      dst[h] = from_float<T>(v);
      if (dst_lo) dst_lo[h] = from_float<T>(v - to_float(dst[h]));
    }
  }
}

// One block per row with a nonzero target coefficient: its H fp32 atomics into grad_weight[target].
__global__ void __launch_bounds__(kRowThreads) target_scatter_kernel(const __nv_bfloat16* x, std::int64_t row_begin,
                                                                    std::int64_t H, std::int64_t ld_h,
                                                                    const std::int64_t* target, const float* coef,
                                                                    float* grad_weight, float* grad_bias) {
  const std::int64_t r = row_begin + blockIdx.x;
  const float c = coef[r];
  if (c == 0.0f) return;
  const std::int64_t t = target[r];
  const __nv_bfloat16* xr = x + r * ld_h;
  if (grad_weight != nullptr) {  // null: the bias's term alone (the hi/lo pair takes the weight's: target_rows_kernel)
    float* gw = grad_weight + t * ld_h;
    for (std::int64_t h = threadIdx.x; h < H; h += kRowThreads) atomicAdd(gw + h, c * __bfloat162float(xr[h]));
  }
  if (grad_bias != nullptr && threadIdx.x == 0) atomicAdd(grad_bias + t, c);
}

__device__ inline std::int64_t chunk_row(const ChunkRows& c, std::int64_t j) {
  return j < c.rows[0] ? c.begin[0] + j : c.begin[1] + (j - c.rows[0]);
}

// Column sums of a chunk's [rows, ld] bf16 dz plus the target terms (dz is 0 at a row's target column; its value is
// the row's coefficient): thread = column, the rows in chunk order, one write per column, so the sum does not
// depend on timing (no atomics). Coalesced: a warp reads 32 consecutive columns of one row; the row's target and
// coefficient are one broadcast load each.
template <class T>
__global__ void __launch_bounds__(kRowThreads) bias_column_sums_kernel(const T* dz, std::int64_t ld,
                                                                      ChunkRows c, std::int64_t V,
                                                                      std::int64_t column_begin,
                                                                      const std::int64_t* target, const float* coef,
                                                                      float* grad_bias, float dz_unscale) {
  const std::int64_t v = std::int64_t(blockIdx.x) * kRowThreads + threadIdx.x;
  if (v >= V) return;
  const std::int64_t rows = c.rows[0] + c.rows[1];
  float sum = 0;
  for (std::int64_t j = 0; j < rows; ++j) {
    const std::int64_t r = chunk_row(c, j);
    sum += to_float(dz[j * ld + v]) * dz_unscale;  // a power of two: exact
    if (target != nullptr && target[r] == column_begin + v) sum += coef[r];
  }
  grad_bias[v] += sum;
}

// ---- grad_W as a bf16 hi/lo pair (hilo_gemm.h) ----

// The pair's value hi + lo in fp32, and its store of a new sum s: hi = bf16(s), lo = bf16(s - hi), the same step as
// the hi/lo GEMM's epilogue.
__device__ inline float hilo_value(const __nv_bfloat16* hi, const __nv_bfloat16* lo) {
  return __bfloat162float(*hi) + __bfloat162float(*lo);
}
__device__ inline void hilo_store(__nv_bfloat16* hi, __nv_bfloat16* lo, float s) {
  const __nv_bfloat16 h = __float2bfloat16_rn(s);
  *hi = h;
  *lo = __float2bfloat16_rn(s - __bfloat162float(h));
}

// One block per chunk row r with a nonzero target coefficient and a target in [v_begin, v_end). The block of the first
// such row of each target t (its leader; the others return) sums c[r'] x[r'] over every row r' of the chunk with target
// t, in chunk order (rows found 256 at a time by ballots: a deterministic order), in fp32, then adds the sum times
// `scale` into row t once: of the hi/lo pair, or of an fp32 accumulator (`f32` not null). Leaders of different targets
// write different rows: no atomics, and the result does not depend on timing.
constexpr int kTargetColumns = 16;  // columns per thread and pass: H <= 4096 in one scan of the chunk's rows
template <class T>
__global__ void __launch_bounds__(kRowThreads) target_rows_kernel(const T* x, std::int64_t ld_x,
                                                                      std::int64_t H, ChunkRows c,
                                                                      const std::int64_t* target, const float* coef,
                                                                      __nv_bfloat16* hi, __nv_bfloat16* lo, float* f32,
                                                                      std::int64_t ld_w, Scale scale_of,
                                                                      std::int64_t v_begin, std::int64_t v_end) {
  const std::int64_t n = c.rows[0] + c.rows[1], j = blockIdx.x, r = chunk_row(c, j);
  const std::int64_t t = target[r];
  if (coef[r] == 0.0f || t < v_begin || t >= v_end) return;  // block-uniform
  const float scale = value_of(scale_of);
  bool earlier = false;
  for (std::int64_t i = threadIdx.x; i < j; i += kRowThreads) {
    const std::int64_t ri = chunk_row(c, i);
    earlier |= target[ri] == t && coef[ri] != 0.0f;
  }
  if (__syncthreads_or(earlier)) return;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ std::int64_t list[kRowThreads];
  __shared__ int warp_count[kWarps];
  for (std::int64_t h0 = 0; h0 < H; h0 += kRowThreads * kTargetColumns) {
    float sum[kTargetColumns];
#pragma unroll
    for (int q = 0; q < kTargetColumns; ++q) sum[q] = 0.0f;
    for (std::int64_t i0 = j; i0 < n; i0 += kRowThreads) {
      const std::int64_t i = i0 + threadIdx.x;
      std::int64_t ri = 0;
      bool match = false;
      if (i < n) {
        ri = chunk_row(c, i);
        match = target[ri] == t && coef[ri] != 0.0f;
      }
      const unsigned mask = __ballot_sync(0xffffffffu, match);
      if (lane == 0) warp_count[warp] = __popc(mask);
      __syncthreads();
      int offset = 0, count = 0;
      for (int w = 0; w < kWarps; ++w) {
        offset += w < warp ? warp_count[w] : 0;
        count += warp_count[w];
      }
      if (match) list[offset + __popc(mask & ((1u << lane) - 1u))] = ri;
      __syncthreads();
      for (int k = 0; k < count; ++k) {
        const std::int64_t rk = list[k];
        const float ck = coef[rk];
        const T* xr = x + rk * ld_x;
#pragma unroll
        for (int q = 0; q < kTargetColumns; ++q) {
          const std::int64_t h = h0 + q * kRowThreads + threadIdx.x;
          if (h < H) sum[q] += ck * to_float(xr[h]);
        }
      }
      __syncthreads();  // list and warp_count are refilled by the next batch
    }
#pragma unroll
    for (int q = 0; q < kTargetColumns; ++q) {
      const std::int64_t h = h0 + q * kRowThreads + threadIdx.x;
      if (h >= H) continue;
      const float add = sum[q] * scale;  // exact at scale 1
      const std::int64_t at = (t - v_begin) * ld_w + h;
      if (f32 != nullptr) f32[at] += add;
      else hilo_store(hi + at, lo + at, hilo_value(hi + at, lo + at) + add);
    }
  }
}

// Rows [v_begin, v_begin + gridDim.x) of dz^T x, which the hi/lo GEMM cannot take (the last V % 8: its TMA wants
// whole 16-byte groups along V), summed in fp32 over the chunk's rows and added into the pair, the total times
// `scale` as the GEMM's epilogue does; block (v, 256 columns).
__global__ void __launch_bounds__(kRowThreads) hilo_tail_kernel(std::int64_t rows, std::int64_t v_begin, std::int64_t H,
                                                               const __nv_bfloat16* dz, std::int64_t ld_dz,
                                                               const __nv_bfloat16* x, std::int64_t ld_x,
                                                               __nv_bfloat16* hi, __nv_bfloat16* lo, std::int64_t ld_w,
                                                               bool overwrite, Scale scale_of) {
  const std::int64_t v = v_begin + blockIdx.x, h = std::int64_t(blockIdx.y) * kRowThreads + threadIdx.x;
  if (h >= H) return;
  const float scale = value_of(scale_of);
  float sum = 0.0f;
  for (std::int64_t r = 0; r < rows; ++r) sum += __bfloat162float(dz[r * ld_dz + v]) * __bfloat162float(x[r * ld_x + h]);
  __nv_bfloat16 *hv = hi + v * ld_w + h, *lv = lo + v * ld_w + h;
  hilo_store(hv, lv, scale * (overwrite ? sum : hilo_value(hv, lv) + sum));  // exact at scale 1
}

template <bool kVector, class T>
__global__ void __launch_bounds__(kRowThreads) round_to_kernel(const float* in, std::int64_t ld_in, std::int64_t cols,
                                                              T* out, T* out_lo) {
  const std::int64_t r = blockIdx.x;
  const float* src = in + r * ld_in;
  T* dst = out + r * cols;
  T* dst_lo = out_lo != nullptr ? out_lo + r * cols : nullptr;
  if constexpr (kVector) {
    for (std::int64_t c = std::int64_t(threadIdx.x) * 8; c < cols; c += kRowThreads * 8) {
      float v[8];
      load8(src + c, v);
      store8_hilo(dst + c, dst_lo != nullptr ? dst_lo + c : nullptr, v);
    }
  } else {
    for (std::int64_t c = threadIdx.x; c < cols; c += kRowThreads) {
      dst[c] = from_float<T>(src[c]);
      if (dst_lo) dst_lo[c] = from_float<T>(src[c] - to_float(dst[c]));
    }
  }
}

// hi + lo is exact in fp32 (lo is hi's residue, at most half its ulp), and the product is taken in double, so the one
// rounding that matters is the last (an f32 output, which has no residue, is rounded twice: ~1 u32 more).
// kVector: 8 elements per thread and step in 16-byte accesses (n % 8 == 0, every pointer 16-byte aligned), so the
// pass runs at memory bandwidth.
// scale_device (or null: `scale`): a scale on the device; at 1 there, out = hi.
template <bool kVector, class T>
__global__ void scale_kernel(const T* hi, const T* lo, std::int64_t n, double scale, const float* scale_device,
                             T* out) {
  if (scale_device != nullptr) {
    const float s = *scale_device;
    if (s == 1.0f) {
      if (out != hi)
        for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
             i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
          out[i] = hi[i];
      return;
    }
    scale = s;
  }
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if constexpr (kVector) {
    for (; i < n / 8; i += stride) {
      float v[8], r[8];
      load8(hi + 8 * i, v);
      if (lo != nullptr) {
        load8(lo + 8 * i, r);
#pragma unroll
        for (int q = 0; q < 8; ++q) v[q] += r[q];
      }
#pragma unroll
      for (int q = 0; q < 8; ++q) v[q] = static_cast<float>(scale * static_cast<double>(v[q]));
      store8(out + 8 * i, v);
    }
  } else {
    for (; i < n; i += stride) {
      const float v = lo != nullptr ? to_float(hi[i]) + to_float(lo[i]) : to_float(hi[i]);
      out[i] = from_float<T>(static_cast<float>(scale * static_cast<double>(v)));
    }
  }
}

// Grids are one block per row; CUDA allows 2^31 - 1 blocks in x.
unsigned grid_rows(std::int64_t rows) {
  if (rows > 2147483647) throw CudaError("cuda backend: chunk of " + std::to_string(rows) + " rows exceeds the grid");
  return static_cast<unsigned>(rows);
}

}  // namespace

template <class T>
void launch_row_stats(const LogitRowsOf<T>& a, float* row_max, float* lse, float* z_target, double* rowsum,
                      cudaStream_t stream) {
  if (a.rows == 0) return;
  if (a.bias)
    row_stats_kernel<true><<<grid_rows(a.rows), kRowThreads, 0, stream>>>(a, row_max, lse, z_target, rowsum);
  else
    row_stats_kernel<false><<<grid_rows(a.rows), kRowThreads, 0, stream>>>(a, row_max, lse, z_target, rowsum);
  SIMPO_CUDA_CHECK_LAUNCH();
}

void launch_merge_tile_stats(const TileStatsRows& a, float* row_max, float* lse, float* z_target, double* rowsum,
                             cudaStream_t stream) {
  if (a.rows == 0) return;
  merge_tile_stats_kernel<<<grid_rows((a.rows + kMergeRows - 1) / kMergeRows), kMergeThreads, 0, stream>>>(
      a, row_max, lse, z_target, rowsum);
  SIMPO_CUDA_CHECK_LAUNCH();
}

void launch_pair_math(const PairParams& p, std::int64_t pair_begin, std::int64_t pair_end,
                      const std::int64_t* target, const float* lse, const float* z_target,
                      const std::int64_t* completion_tokens, double* avg_grad, cudaStream_t stream) {
  if (pair_end <= pair_begin) return;
  pair_math_kernel<<<grid_rows(pair_end - pair_begin), kRowThreads, 0, stream>>>(
      p, pair_begin, target, lse, z_target, completion_tokens, avg_grad);
  SIMPO_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_dz(const LogitRowsOf<T>& a, const CoefficientParams& c, const float* row_max, const float* lse,
               const float* z_target, T* dz, std::int64_t ld_dz, float* target_coef, cudaStream_t stream) {
  if (a.rows == 0) return;
  if (a.bias)
    dz_kernel<true><<<grid_rows(a.rows), kRowThreads, 0, stream>>>(a, c, row_max, lse, z_target, dz, ld_dz,
                                                                    target_coef);
  else
    dz_kernel<false><<<grid_rows(a.rows), kRowThreads, 0, stream>>>(a, c, row_max, lse, z_target, dz, ld_dz,
                                                                     target_coef);
  SIMPO_CUDA_CHECK_LAUNCH();
}

void launch_dz_from_distances(const LogitDistanceRows& a, const CoefficientParams& c, const float* row_max,
                              const float* lse, const float* z_target, __nv_bfloat16* dz, std::int64_t ld_dz,
                              float* target_coef, cudaStream_t stream) {
  if (a.rows == 0) return;
  if (a.V % 8 != 0 || a.ld % 8 != 0 || ld_dz % 8 != 0 || a.tile_columns % 8 != 0)
    throw CudaError("dz from logit distances: V = " + std::to_string(a.V) + ", ld " + std::to_string(a.ld) +
                    ", ld_dz " + std::to_string(ld_dz) + " and the tile width " + std::to_string(a.tile_columns) +
                    " must be multiples of 8");
  dz_from_distances_kernel<<<grid_rows(a.rows), kRowThreads, 0, stream>>>(a, c, row_max, lse, z_target, dz, ld_dz,
                                                                          target_coef);
  SIMPO_CUDA_CHECK_LAUNCH();
}

void launch_row_coefficients(std::int64_t N, const std::int64_t* target, std::int64_t ignore_index,
                             const CoefficientParams& c, const float* lse, const float* z_target, float* k,
                             float* target_coef, cudaStream_t stream) {
  if (N == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((N + kRowThreads - 1) / kRowThreads, 4096));
  row_coefficients_kernel<<<blocks, kRowThreads, 0, stream>>>(N, target, ignore_index, c, lse, z_target, k,
                                                             target_coef);
  SIMPO_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_grad_x_finish(const float* part, std::int64_t rows, std::int64_t row_begin, std::int64_t H,
                          std::int64_t ld_h, const T* weight, const std::int64_t* target, const float* target_coef,
                          T* out, cudaStream_t stream, T* out_lo) {
  if (rows == 0) return;
  if (H % 8 == 0)  // then every output row starts 16-byte aligned
    grad_x_finish_kernel<true><<<grid_rows(rows), kRowThreads, 0, stream>>>(part, row_begin, H, ld_h, weight,
                                                                             target, target_coef, out, out_lo);
  else
    grad_x_finish_kernel<false><<<grid_rows(rows), kRowThreads, 0, stream>>>(part, row_begin, H, ld_h, weight,
                                                                              target, target_coef, out, out_lo);
  SIMPO_CUDA_CHECK_LAUNCH();
}

void launch_target_scatter(const __nv_bfloat16* x, std::int64_t rows, std::int64_t row_begin, std::int64_t H,
                           std::int64_t ld_h, const std::int64_t* target, const float* target_coef,
                           float* grad_weight, float* grad_bias, cudaStream_t stream) {
  if (rows == 0) return;
  target_scatter_kernel<<<grid_rows(rows), kRowThreads, 0, stream>>>(x, row_begin, H, ld_h, target, target_coef,
                                                                     grad_weight, grad_bias);
  SIMPO_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_bias_column_sums(const T* dz, std::int64_t ld_dz, const ChunkRows& rows, std::int64_t V,
                             std::int64_t column_begin, const std::int64_t* target, const float* target_coef,
                             float* grad_bias, cudaStream_t stream, float dz_scale) {
  if (rows.rows[0] + rows.rows[1] == 0 || V == 0) return;
  bias_column_sums_kernel<<<static_cast<unsigned>((V + kRowThreads - 1) / kRowThreads), kRowThreads, 0, stream>>>(
      dz, ld_dz, rows, V, column_begin, target, target_coef, grad_bias, 1.0f / dz_scale);
  SIMPO_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_round_to(const float* in, std::int64_t ld_in, std::int64_t rows, std::int64_t cols, T* out,
                     cudaStream_t stream, T* lo) {
  if (rows == 0 || cols == 0) return;
  if (cols % 8 == 0)
    round_to_kernel<true><<<grid_rows(rows), kRowThreads, 0, stream>>>(in, ld_in, cols, out, lo);
  else
    round_to_kernel<false><<<grid_rows(rows), kRowThreads, 0, stream>>>(in, ld_in, cols, out, lo);
  SIMPO_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_scale_kernel(const T* hi, const T* lo, std::int64_t n, double scale, const float* scale_device, T* out,
                         cudaStream_t stream) {
  if (n == 0) return;
  auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  const bool vector = n % 8 == 0 && aligned(hi) && aligned(lo) && aligned(out);
  const std::int64_t work = vector ? n / 8 : n;
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((work + 255) / 256, 132 * 16));
  if (vector) scale_kernel<true><<<blocks, 256, 0, stream>>>(hi, lo, n, scale, scale_device, out);
  else scale_kernel<false><<<blocks, 256, 0, stream>>>(hi, lo, n, scale, scale_device, out);
  SIMPO_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_scale(const T* hi, const T* lo, std::int64_t n, double scale, T* out, cudaStream_t stream) {
  launch_scale_kernel(hi, lo, n, scale, nullptr, out, stream);
}

template <class T>
void launch_scale(const T* hi, const T* lo, std::int64_t n, const float* scale, T* out, cudaStream_t stream) {
  launch_scale_kernel(hi, lo, n, 1.0, scale, out, stream);
}

template <class T>
void launch_target_rows(const T* x, std::int64_t ld_x, std::int64_t H, const ChunkRows& rows,
                        const std::int64_t* target, const float* target_coef, const TargetRowsSink& sink,
                        cudaStream_t stream) {
  const std::int64_t n = rows.rows[0] + rows.rows[1];
  if (n == 0 || H == 0) return;
  target_rows_kernel<<<grid_rows(n), kRowThreads, 0, stream>>>(x, ld_x, H, rows, target, target_coef, sink.hi, sink.lo,
                                                               sink.f32, sink.ld_w, sink.scale, sink.v_begin,
                                                               sink.v_end);
  SIMPO_CUDA_CHECK_LAUNCH();
}

void launch_hilo_tail(std::int64_t rows, std::int64_t v_begin, std::int64_t v_end, std::int64_t H,
                      const __nv_bfloat16* dz, std::int64_t ld_dz, const __nv_bfloat16* x, std::int64_t ld_x,
                      __nv_bfloat16* hi, __nv_bfloat16* lo, std::int64_t ld_w, bool overwrite, Scale scale,
                      cudaStream_t stream) {
  if (rows == 0 || v_end <= v_begin || H == 0) return;
  const dim3 grid(static_cast<unsigned>(v_end - v_begin), static_cast<unsigned>((H + kRowThreads - 1) / kRowThreads));
  hilo_tail_kernel<<<grid, kRowThreads, 0, stream>>>(rows, v_begin, H, dz, ld_dz, x, ld_x, hi, lo, ld_w, overwrite,
                                                     scale);
  SIMPO_CUDA_CHECK_LAUNCH();
}

#define SIMPO_ROW_KERNELS_FOR(T)                                                                                   \
  template void launch_row_stats<T>(const LogitRowsOf<T>&, float*, float*, float*, double*, cudaStream_t);           \
  template void launch_dz<T>(const LogitRowsOf<T>&, const CoefficientParams&, const float*, const float*,            \
                             const float*, T*, std::int64_t, float*, cudaStream_t);                                  \
  template void launch_grad_x_finish<T>(const float*, std::int64_t, std::int64_t, std::int64_t, std::int64_t,        \
                                        const T*, const std::int64_t*, const float*, T*, cudaStream_t, T*);          \
  template void launch_bias_column_sums<T>(const T*, std::int64_t, const ChunkRows&, std::int64_t, std::int64_t,     \
                                           const std::int64_t*, const float*, float*, cudaStream_t, float);          \
  template void launch_target_rows<T>(const T*, std::int64_t, std::int64_t, const ChunkRows&, const std::int64_t*,   \
                                      const float*, const TargetRowsSink&, cudaStream_t);                            \
  template void launch_round_to<T>(const float*, std::int64_t, std::int64_t, std::int64_t, T*, cudaStream_t, T*);    \
  template void launch_scale<T>(const T*, const T*, std::int64_t, double, T*, cudaStream_t);                       \
  template void launch_scale<T>(const T*, const T*, std::int64_t, const float*, T*, cudaStream_t);
SIMPO_ROW_KERNELS_FOR(__nv_bfloat16)
SIMPO_ROW_KERNELS_FOR(__half)
SIMPO_ROW_KERNELS_FOR(float)
#undef SIMPO_ROW_KERNELS_FOR

}  // namespace simpo::fused::cuda
