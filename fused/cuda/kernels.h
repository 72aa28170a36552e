// The row kernels of the fused algorithm (everything but the GEMMs). Each works on one chunk part: `rows`
// consecutive token rows starting at global row `row_begin`, whose fp32 logits sit in a [rows, ld_logits]
// buffer. Per-row results go to [N] arrays indexed by global row, per-sequence ones to [B] arrays, so the
// three_pass and two_pass schedules share every kernel. All launches are asynchronous on `stream`.
//
// T, where a kernel takes one, is the inputs' element type (__nv_bfloat16, __half or float): the bias, x and W it
// reads and the dz and outputs it writes are in it (dz in the inputs' dtype: what the GEMMs take). The kernels that
// only the sm_90 bf16 path runs (logit distances, the hi/lo pair, the low-memory schedule) take bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

namespace simpo::fused::cuda {

// Where a chunk part's logits are and how to read its rows.
template <class T>
struct LogitRowsOf {
  const float* logits;        // [rows, ld_logits], ld_logits a multiple of 8 (16-byte aligned rows)
  std::int64_t ld_logits;
  std::int64_t rows;
  std::int64_t row_begin;     // global row of logits row 0
  std::int64_t V;
  const T* bias;              // [V] or nullptr; added to every logit as it is read
  const std::int64_t* target; // [N] (global rows)
  std::int64_t ignore_index;
  // Vocabulary column of the buffer's column 0 (dz_kernel over a slice of the vocabulary, the low-memory
  // schedule: `V` is then the slice's width and `bias` points at the slice's first column). The statistics
  // kernels read whole rows: 0.
  std::int64_t column_begin = 0;
};
using LogitRows = LogitRowsOf<__nv_bfloat16>;

// Pass 1, for the part's rows: row_max[r]; lse[r] and z_target[r] relative to it (lse = log sum exp(z - max),
// z_target = z_t - max, 0 on ignored rows; fused/forward_outputs.h's RowStats convention); rowsum[r] = sum_v z
// in double.
template <class T>
void launch_row_stats(const LogitRowsOf<T>&, float* row_max, float* lse, float* z_target, double* rowsum, cudaStream_t);

// Pass 1 with the statistics from the logits GEMM's epilogue (promoted_stats.h): for the part's rows, folds the
// per-tile partials tile_max / tile_sum_exp / tile_sum ([tiles, ld], the part's row i at column i) and the raw
// target logit z_target_raw[r] (global rows; bias included) into the same four arrays launch_row_stats fills.
struct TileStatsRows {
  const float* tile_max;
  const float* tile_sum_exp;
  const double* tile_sum;
  std::int64_t ld, tiles;
  std::int64_t rows, row_begin;
  const float* z_target_raw;  // [N]
  const std::int64_t* target; // [N]
  std::int64_t ignore_index;
};
void launch_merge_tile_stats(const TileStatsRows&, float* row_max, float* lse, float* z_target, double* rowsum,
                             cudaStream_t);

// Pair math for pairs [pair_begin, pair_end): dL/davg[b] (avg_grad) for both sequences of each pair, in double
// from the fp32 row stats, exactly the formulas of fused/forward_outputs.cpp. (The averages themselves, and the
// loss, are the host's: fused/forward_outputs.cpp from the copied row stats.)
struct PairParams {
  std::int64_t T, P;
  std::int64_t ignore_index;
  double beta, gamma, label_smoothing;
};
void launch_pair_math(const PairParams&, std::int64_t pair_begin, std::int64_t pair_end, const std::int64_t* target,
                      const float* lse, const float* z_target, const std::int64_t* completion_tokens,
                      double* avg_grad, cudaStream_t);

// Pass 2: dz rows. D[r, v] = T(-k softmax_v) off the target column, 0 at it and in the padding columns
// [V, min(ld_dz, V rounded up to 8)); target_coef[r] = k (1 - p_target) in fp32, applied outside the GEMMs. k from
// row_coefficient. dz may be the logits buffer itself (in place: dz == (T*) logits, ld_dz = ld_logits * 4 /
// sizeof(T), each row's dz over the start of its fp32 logits bytes); any other overlap is not allowed.
struct CoefficientParams {
  std::int64_t T, P;
  double grad_scale;
  double nll_weight;  // alpha / N_c on chosen rows (0 when the NLL term is off)
  const double* avg_grad;                 // [B]
  const std::int64_t* completion_tokens;  // [B]
  // forward_on_device calls (device_forward.h): N_c on the device, and nll_weight = alpha / N_c computed there (0 for
  // N_c = 0; alpha 0 with the NLL term off) instead of the field above. nullptr: nll_weight.
  const std::int64_t* n_chosen = nullptr;
  double alpha = 0;
  // dz is written times this power of two (target_coef is not); the GEMMs and the bias sums take it out again
  // (alpha = 1 / dz_scale, exact). 1 but for f16 inputs, whose 5-bit exponent would flush a small k's dz to zero:
  // there it lifts the largest possible |k| to near the top of f16's range (dz_scale_for, fused_runner.cu).
  float dz_scale = 1.0f;
};
template <class T>
void launch_dz(const LogitRowsOf<T>&, const CoefficientParams&, const float* row_max, const float* lse,
               const float* z_target, T* dz, std::int64_t ld_dz, float* target_coef, cudaStream_t);
// Pass 2 from the logit distances (promoted_stats.h: promoted_logits_distances) instead of fp32 logits: the same
// dz and target_coef as launch_dz, with each logit read back as its tile's max minus q 2^-11. V a multiple of 8
// (so no padding columns). dz may be the distances buffer itself with ld_dz = ld (in place: each thread reads its
// 16 bytes, then writes 16 bytes of dz over them); any other overlap is not allowed.
struct LogitDistanceRows {
  const std::uint16_t* distances;  // [rows, ld]
  std::int64_t ld;
  std::int64_t rows;
  std::int64_t row_begin;          // global row of row 0
  std::int64_t V;
  const float* tile_max;           // [tiles, tile_ld]: the part's row i at column i (the epilogue's partials)
  std::int64_t tile_ld;
  std::int64_t tile_columns;       // the statistics GEMM's tile width (statistics_tile_columns)
  const std::int64_t* target;      // [N] (global rows)
  std::int64_t ignore_index;
};
void launch_dz_from_distances(const LogitDistanceRows&, const CoefficientParams&, const float* row_max,
                              const float* lse, const float* z_target, __nv_bfloat16* dz, std::int64_t ld_dz,
                              float* target_coef, cudaStream_t);
// Where dz comes from the logits GEMM's epilogue (promoted_dz.h): k[r] (row_coefficient, as dz_kernel takes it)
// and target_coef[r] for all N rows.
void launch_row_coefficients(std::int64_t N, const std::int64_t* target, std::int64_t ignore_index,
                             const CoefficientParams&, const float* lse, const float* z_target, float* k,
                             float* target_coef, cudaStream_t);

// grad_x rows = T(GEMM result + target_coef[r] * W[target[r]]): the exact target term added in fp32, then
// one rounding. grad_x_part is [rows, ld_h] fp32; grad_x_out the [N, H] output; grad_x_lo (or null) its rounding
// residue T(v - T(v)) (fused.h: DeviceCall::grad_x_lo).
template <class T>
void launch_grad_x_finish(const float* grad_x_part, std::int64_t rows, std::int64_t row_begin, std::int64_t H,
                          std::int64_t ld_h, const T* weight, const std::int64_t* target, const float* target_coef,
                          T* grad_x_out, cudaStream_t, T* grad_x_lo = nullptr);

// The target term of the weight and bias gradients: grad_weight[target[r]] += c[r] x[r], grad_bias[target[r]]
// += c[r] (grad_weight and grad_bias may each be null), fp32 atomics (rows sharing a target add into one row, in
// no fixed order: the vocabulary-parallel ranks, which declare no determinism).
void launch_target_scatter(const __nv_bfloat16* x, std::int64_t rows, std::int64_t row_begin, std::int64_t H,
                           std::int64_t ld_h, const std::int64_t* target, const float* target_coef, float* grad_weight,
                           float* grad_bias, cudaStream_t);

// A chunk's rows as global row ranges: part 0 then part 1 (a three_pass chunk's chosen rows, then its rejected
// rows); rows[1] = 0 for a chunk of one range.
struct ChunkRows {
  std::int64_t begin[2] = {0, 0};
  std::int64_t rows[2] = {0, 0};
};
// grad_bias[v] += sum over the chunk's rows of D[r, v] + target_coef[r] where target[r] = column_begin + v (fp32
// sums of the dz values the GEMMs also use, and the target terms), each column's rows in chunk order: the same
// bits on every run. dz is [rows, ld_dz] in chunk order; its V columns are vocabulary columns from column_begin.
// target null: the column sums alone (the caller adds the target terms).
template <class T>
void launch_bias_column_sums(const T* dz, std::int64_t ld_dz, const ChunkRows& rows, std::int64_t V,
                             std::int64_t column_begin, const std::int64_t* target, const float* target_coef,
                             float* grad_bias, cudaStream_t, float dz_scale = 1.0f);

// A scale factor: `value`, or where `device` is set the float there, read by the kernels when they run (a loss scale
// that stays on the device, autograd's grad_output, so that backward need not synchronize to learn it).
struct Scale {
  float value = 1.0f;
  const float* device = nullptr;
};

// Where the target term goes: the bf16 hi/lo pair (hilo_gemm.h; hi, lo [V, ld_w]) or an fp32 accumulator [V, ld_w].
// Each target's sum is added times `scale` (1 but for a deferred finish's loss scale: fused.h,
// finish_weight_gradient_on_device). Only targets in [v_begin, v_end) add, and the sink's row 0 is vocabulary row
// v_begin (the low-memory schedule's slice of the vocabulary; the whole of it by default).
struct TargetRowsSink {
  __nv_bfloat16* hi = nullptr;
  __nv_bfloat16* lo = nullptr;
  float* f32 = nullptr;
  std::int64_t ld_w = 0;
  Scale scale;
  std::int64_t v_begin = 0, v_end = INT64_MAX;
};
// The target term grad_W[target[r]] += c[r] x[r] over the chunk's rows, summed per target in fp32 in chunk order
// and added into the sink once per target (deterministic, no atomics). The bias's target term is
// launch_bias_column_sums'.
// The hi/lo sink is for bf16 inputs only.
template <class T>
void launch_target_rows(const T* x, std::int64_t ld_x, std::int64_t H, const ChunkRows&,
                        const std::int64_t* target, const float* target_coef, const TargetRowsSink&, cudaStream_t);

// hi/lo rows [v_begin, v_end) = scale (hi + lo + dz[rows, v]^T x[rows, H]) in fp32 (overwrite: hi + lo not read):
// the last V % 8 rows of the weight gradient, which the hi/lo GEMM leaves (a handful of rows; a plain loop over the
// chunk's rows), scaled as the GEMM's epilogue scales (hilo_gemm.h).
void launch_hilo_tail(std::int64_t rows, std::int64_t v_begin, std::int64_t v_end, std::int64_t H,
                      const __nv_bfloat16* dz, std::int64_t ld_dz, const __nv_bfloat16* x, std::int64_t ld_x,
                      __nv_bfloat16* hi, __nv_bfloat16* lo, std::int64_t ld_w, bool overwrite, Scale scale,
                      cudaStream_t);

// out[r, c] = T(in[r, c]) for a [rows, ld_in] fp32 matrix into a dense [rows, cols] one (T = float: a copy), and
// where lo is not null the residue lo[r, c] = T(in - T(in)).
template <class T>
void launch_round_to(const float* in, std::int64_t ld_in, std::int64_t rows, std::int64_t cols, T* out, cudaStream_t,
                     T* lo = nullptr);

// out[i] = T(scale (hi[i] + lo[i])) (lo null: T(scale hi[i])), i < n; out may be hi (fused.h: scale_gradient_on_device).
template <class T>
void launch_scale(const T* hi, const T* lo, std::int64_t n, double scale, T* out, cudaStream_t);
// The same with the scale a float on the device; where it is 1, out = hi (nothing written when out is hi): the
// step's own rounding, which T(hi + lo) can differ from on a tie.
template <class T>
void launch_scale(const T* hi, const T* lo, std::int64_t n, const float* scale, T* out, cudaStream_t);

}  // namespace simpo::fused::cuda
