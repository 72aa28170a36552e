// The fused algorithm (fused/schedule.h for the chunk plan, fused/simpo_math.h for the math) on the CPU.
//
// Per chunk of R token rows:
//   1. Z[R, V] = X_chunk W^T: Eigen fp32 GEMM on the input values widened to float (exact for bf16, f16 and
//      f32), bias added per row.
//   2. row stats in fp32 with the max shift: lse, z_target (both relative to the row max); rowsum in double.
//   3. k per row: three_pass right away for the chunk's pairs; two_pass after pass 1 has seen every row.
//   4. D[r, v] = bf16(-k softmax_v), overwriting Z in place, with D[r, target] = 0; the target column's exact
//      c[r] = k (1 - p_target) stays in fp32 and is applied outside the GEMMs (gather / scatter-add). bf16
//      inputs only: the cuda kernel's GEMMs take dz in bf16, and this backend computes the same numbers. With
//      f16 or f32 inputs D stays fp32 (an f32 candidate is held to f32 arithmetic; for f16 fp32 is simply
//      better than the f16 operands a tensor core would take).
//   5. grad_x rows = D W + c W[target] in fp32, rounded to the inputs' dtype once; grad_W_f32 += D^T X_chunk
//      + c x (fp32 over all chunks); grad_bias_f32 += column sums of D + c. grad_weight/grad_bias rounded once.
// The GEMMs use Eigen's OpenMP threads; the row loops use OpenMP directly. The whole weight is held once as
// float (V*H*4 bytes): Eigen has no bf16 GEMM, and that copy is this backend's cost, outside the workspace.
//
// Mutants (fused.h) are marked "MUTANT" where they deviate; each is a branch outside the inner loops or a
// different inner loop chosen once per row, so Mutant::none runs the plain code.
#include "fused/cpu/cpu_backend.h"

#include "fused/forward_outputs.h"
#include "fused/mutant.h"
#include "fused/schedule.h"
#include "fused/simpo_math.h"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>

namespace simpo::fused::cpu {

namespace {

using MatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using VectorF = Eigen::Matrix<float, Eigen::Dynamic, 1>;

float round_bf16(float v) { return static_cast<float>(bf16(v)); }

// f(T()) with T the C++ type of an input dtype.
template <class F> decltype(auto) with_input_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F16: return f(f16());
    case DType::F32: return f(0.0f);
    default: return f(bf16());
  }
}

// MUTANT pairs_interleaved and pairs_split_across_chunks change which rows a row's k depends on (pairs
// (2i, 2i+1), or a partner outside the chunk), so their k is computed once all rows' stats are known.
bool needs_all_pairs_at_once(Mutant m) {
  return m == Mutant::pairs_interleaved || m == Mutant::pairs_split_across_chunks;
}

// sum_v exp(z_v - max) in fp32, reduced the way a GPU block reduces a row: 256 lanes each sum a strided
// share in order, then a pairwise tree over the lanes. One running fp32 sum over V terms drifts by ~sqrt(V)
// roundings (5e-6 relative at V = 8000: enough to cost logps their 5e-7 bar); this is ~sqrt(V/256) + 8.
float sum_of_exp(const float* z, Eigen::Index V, float max) {
  constexpr Eigen::Index lanes = 256;
  float lane[lanes] = {};
  for (Eigen::Index base = 0; base < V; base += lanes) {
    const Eigen::Index width = std::min(lanes, V - base);
    for (Eigen::Index j = 0; j < width; ++j) lane[j] += std::exp(z[base + j] - max);
  }
  for (Eigen::Index half = lanes / 2; half > 0; half /= 2)
    for (Eigen::Index j = 0; j < half; ++j) lane[j] += lane[j + half];
  return lane[0];
}

class Run {
 public:
  Run(const Problem& problem, const Options& options, Mutant mutant)
      : problem_(problem),
        options_(options),
        shape_(problem.shape),
        mutant_(mutant),
        schedule_(plan(problem.shape, options, !needs_all_pairs_at_once(mutant))),
        targets_(read_targets(problem, mutant)),
        dtype_(problem.input_dtype()),
        bf16_operands_(dtype_ == DType::BF16),
        stats_(problem.shape.N()),
        row_max_(static_cast<std::size_t>(problem.shape.N()), 0.f),
        k_(static_cast<std::size_t>(problem.shape.N()), 0.f),
        c_(static_cast<std::size_t>(problem.shape.N()), 0.f) {
    const auto H = shape_.H, V = shape_.V;
    weight_.resize(V, H);
    problem.weight.visit([&](const auto& w) {
#pragma omp parallel for schedule(static)
      for (Eigen::Index v = 0; v < V; ++v)
        for (Eigen::Index h = 0; h < H; ++h) weight_(v, h) = static_cast<float>(w[v * H + h]);
    });
    if (problem.has_bias()) {
      bias_.resize(V);
      for (Eigen::Index v = 0; v < V; ++v) bias_[v] = static_cast<float>(problem.bias->value(static_cast<std::size_t>(v)));
    }
    const Eigen::Index rows = schedule_.max_rows();
    x_chunk_.resize(rows, H);
    logits_.resize(rows, V);
    if (options.gradients) {
      if (options.grad_x) {
        grad_x_chunk_.resize(rows, H);
        grad_x_ = Tensor(dtype_, output_shape(shape_, output_name::grad_x));
      }
      if (options.grad_weight) {
        grad_weight_ = MatrixF::Zero(V, H);
        grad_bias_ = VectorF::Zero(V);
      }
    }
  }

  TensorMap compute() {
    // Each chunk's stages run times_to_process(chunk) times (the tail mutants); the pair math is idempotent.
    auto repeated = [this](void (Run::*stage)(const Chunk&)) {
      return [this, stage](const Chunk& c) {
        for (int repeat = 0; repeat < times_to_process(c); ++repeat) (this->*stage)(c);
      };
    };
    const auto forward = repeated(&Run::forward_chunk);
    walk(schedule_, shape_,
         Stages{.forward = [&](const Chunk& c, bool) { forward(c); },
                .pair_math = [this](std::int64_t b, std::int64_t e) { pair_math(b, e); },
                .logits = repeated(&Run::logits),  // recomputed: the stats of pass 1 are kept, the logits are not
                .backward = repeated(&Run::gradient_chunk)});
    TensorMap out = forward_outputs(problem_, targets_, stats_, mutant_);
    if (options_.gradients) add_gradient_outputs(out);
    return out;
  }

 private:
  // How many times a chunk is processed: once. MUTANT chunk_drops_tail: a last chunk shorter than the first is
  // skipped; MUTANT chunk_double_counts_tail: it is processed twice (its accumulations land twice).
  int times_to_process(const Chunk& chunk) const {
    const auto& chunks = schedule_.chunks;
    const bool partial_tail = chunks.size() > 1 && &chunk == &chunks.back() && chunk.rows() < chunks[0].rows();
    if (!partial_tail) return 1;
    if (mutant_ == Mutant::chunk_drops_tail) return 0;
    if (mutant_ == Mutant::chunk_double_counts_tail) return 2;
    return 1;
  }

  // The chunk's token rows in buffer order (chosen part, then rejected part for a three_pass chunk).
  void gather_rows(const Chunk& chunk) {
    rows_.clear();
    for (int p = 0; p < chunk.part_count; ++p)
      for (std::int64_t r = chunk.parts[p].begin; r < chunk.parts[p].end; ++r) rows_.push_back(r);
  }

  // Step 1: Z = X_chunk W^T (fp32 accumulation of the exact bf16 products), plus the bias.
  void logits(const Chunk& chunk) {
    gather_rows(chunk);
    const Eigen::Index R = static_cast<Eigen::Index>(rows_.size()), H = shape_.H, V = shape_.V;
    problem_.x.visit([&](const auto& x) {
#pragma omp parallel for schedule(static)
      for (Eigen::Index i = 0; i < R; ++i)
        for (Eigen::Index h = 0; h < H; ++h) x_chunk_(i, h) = static_cast<float>(x[rows_[i] * H + h]);
    });
    logits_.topRows(R).noalias() = x_chunk_.topRows(R) * weight_.transpose();
    if (problem_.has_bias()) {
#pragma omp parallel for schedule(static)
      for (Eigen::Index i = 0; i < R; ++i)
        for (Eigen::Index v = 0; v < V; ++v) logits_(i, v) += bias_[v];
    }
  }

  // Steps 1-2: logits, then each row's lse, z_target and rowsum into stats_.
  void forward_chunk(const Chunk& chunk) {
    logits(chunk);
    const Eigen::Index R = static_cast<Eigen::Index>(rows_.size()), V = shape_.V;
#pragma omp parallel for schedule(static)
    for (Eigen::Index i = 0; i < R; ++i) {
      const float* z = &logits_(i, 0);
      const auto r = static_cast<std::size_t>(rows_[i]);
      float max = z[0];
      for (Eigen::Index v = 1; v < V; ++v) max = std::max(max, z[v]);
      // MUTANT lse_without_max_shift: exp(z) straight, which overflows fp32 once a logit passes ~88.
      if (mutant_ == Mutant::lse_without_max_shift) max = 0.f;
      float sum_exp = 0.f;
      if (mutant_ == Mutant::narrow_row_accumulator) {
        // MUTANT narrow_row_accumulator: the sum of exponentials kept in bf16.
        bf16 narrow(0.f);
        for (Eigen::Index v = 0; v < V; ++v) narrow = bf16(static_cast<float>(narrow) + std::exp(z[v] - max));
        sum_exp = static_cast<float>(narrow);
      } else {
        sum_exp = sum_of_exp(z, V, max);
      }
      double rowsum = 0;
      for (Eigen::Index v = 0; v < V; ++v) rowsum += z[v];
      // lse and z_target both relative to the row max (forward_outputs.h allows any common per-row offset):
      // l = (z_target - max) - log(sum) then keeps fp32's relative precision when the target is the max logit
      // and l is near 0, where max + log(sum) rounded at the logits' magnitude would not.
      row_max_[r] = max;
      stats_.lse[r] = std::log(sum_exp);
      const std::int64_t column = gathered_column(problem_, targets_, static_cast<std::int64_t>(r));
      stats_.z_target[r] = column >= 0 ? z[column] - max : 0.f;
      stats_.rowsum[r] += rowsum;  // += so that a chunk processed twice (a mutant) shows in the means
    }
  }

  // Step 3: k of the rows of pairs [pair_begin, pair_end) from their stats.
  void pair_math(std::int64_t pair_begin, std::int64_t pair_end) {
    if (mutant_ != Mutant::pairs_split_across_chunks) {
      row_coefficients(problem_, targets_, stats_, pair_begin, pair_end, mutant_, k_);
      return;
    }
    const std::int64_t P = shape_.P();
    // MUTANT pairs_split_across_chunks: chunks cut by rows, the chosen half in one, the rejected half in the
    // next; each half's k is computed with its partners' rows absent from the chunk (their stats read as 0).
    const std::int64_t half = P * shape_.T;
    for (int side = 0; side < 2; ++side) {
      RowStats visible = stats_;
      const std::int64_t begin = side == 0 ? half : 0, end = side == 0 ? 2 * half : half;  // the absent half
      for (std::int64_t r = begin; r < end; ++r) visible.lse[r] = visible.z_target[r] = 0.f;
      std::vector<float> k(k_.size(), 0.f);
      row_coefficients(problem_, targets_, visible, 0, P, mutant_, k);
      const std::int64_t own_begin = side == 0 ? 0 : half;
      std::copy(k.begin() + own_begin, k.begin() + own_begin + half, k_.begin() + own_begin);
    }
  }

  // Steps 4-5 on the chunk whose logits (and rows_) logits() or forward_chunk() just produced.
  void gradient_chunk(const Chunk&) {
    const Eigen::Index R = static_cast<Eigen::Index>(rows_.size()), H = shape_.H, V = shape_.V;

    // Step 4: D = -k softmax (bf16-rounded for bf16 inputs) in place of the logits, 0 in the target column; c in
    // fp32 on the side.
    const bool round = bf16_operands_;
#pragma omp parallel for schedule(static)
    for (Eigen::Index i = 0; i < R; ++i) {
      float* z = &logits_(i, 0);
      const auto r = static_cast<std::size_t>(rows_[i]);
      const float k = k_[r], max = row_max_[r], log_sum = stats_.lse[r];
      const std::int64_t column = gathered_column(problem_, targets_, static_cast<std::int64_t>(r));
      if (k == 0.f) {  // ignored rows and empty sequences: no gradient at all
        std::fill(z, z + V, 0.f);
        c_[r] = 0.f;
        continue;
      }
      if (distances_) {
        // Options::logit_distances: z read back from its distance below its tile's max, as the cuda GEMM stores it.
        for (Eigen::Index v0 = 0; v0 < V; v0 += math::logit_distance_tile) {
          const Eigen::Index v1 = std::min<Eigen::Index>(V, v0 + math::logit_distance_tile);
          const float tile_max = *std::max_element(z + v0, z + v1), above = tile_max - max;
          for (Eigen::Index v = v0; v < v1; ++v)
            z[v] = round_bf16(math::softmax_gradient(
                k, math::logit_from_distance(above, math::logit_distance(tile_max, z[v])), log_sum));  // bf16 only
        }
      } else if (round) {
        for (Eigen::Index v = 0; v < V; ++v) z[v] = round_bf16(math::softmax_gradient(k, z[v] - max, log_sum));
      } else {
        for (Eigen::Index v = 0; v < V; ++v) z[v] = math::softmax_gradient(k, z[v] - max, log_sum);
      }
      z[column] = 0.f;
      if (mutant_ == Mutant::softmax_rounded_before_onehot) {
        // MUTANT softmax_rounded_before_onehot: 1 - bf16(p_target), which erases a small 1 - p.
        c_[r] = k * (1.f - round_bf16(std::exp(stats_.z_target[r] - log_sum)));
      } else {
        c_[r] = math::target_coefficient(k, stats_.z_target[r], log_sum);
      }
    }
    const auto D = logits_.topRows(R);
    const auto X = x_chunk_.topRows(R);

    // Step 5a: grad_x rows = D W + c W[target], rounded to the inputs' dtype once (Options::grad_x: not for a
    // frozen x).
    if (!options_.grad_x) {
    } else if (mutant_ == Mutant::grad_x_in_input_buffer) {
      grad_x_parked_in_bf16(D);
    } else {
      grad_x_chunk_.topRows(R).noalias() = D * weight_;
      with_input_type(dtype_, [&]<class T>(T) {
        T* grad_x = grad_x_.as<T>().data();
#pragma omp parallel for schedule(static)
        for (Eigen::Index i = 0; i < R; ++i) {
          const auto r = static_cast<std::size_t>(rows_[i]);
          const std::int64_t column = gathered_column(problem_, targets_, static_cast<std::int64_t>(r));
          T* out = grad_x + r * static_cast<std::size_t>(H);
          const float c = c_[r];
          for (Eigen::Index h = 0; h < H; ++h)
            out[h] = T(c != 0.f ? grad_x_chunk_(i, h) + c * weight_(column, h) : grad_x_chunk_(i, h));
        }
      });
    }

    // Step 5b: grad_W_f32 += D^T X + c x (scatter-add, serial: targets may repeat), grad_bias likewise
    // (Options::grad_weight: not for a frozen LM head).
    if (!options_.grad_weight) return;
    grad_weight_.noalias() += D.transpose() * X;
    const bool bias_gradient = problem_.has_bias() && mutant_ != Mutant::grad_bias_missing;  // MUTANT grad_bias_missing
    if (bias_gradient) grad_bias_.noalias() += D.colwise().sum().transpose();
    for (Eigen::Index i = 0; i < R; ++i) {
      const auto r = static_cast<std::size_t>(rows_[i]);
      const float c = c_[r];
      if (c == 0.f) continue;
      const std::int64_t column = gathered_column(problem_, targets_, static_cast<std::int64_t>(r));
      grad_weight_.row(column) += c * X.row(i);
      if (bias_gradient) grad_bias_[column] += c;
    }
    if (mutant_ == Mutant::weight_grad_bf16_accumulation) {
      // MUTANT weight_grad_bf16_accumulation: the running grad_weight is stored in bf16 between chunks.
      float* g = grad_weight_.data();
      const Eigen::Index size = grad_weight_.size();
#pragma omp parallel for schedule(static)
      for (Eigen::Index j = 0; j < size; ++j) g[j] = round_bf16(g[j]);
    }
  }

  // MUTANT grad_x_in_input_buffer: D W computed over vocabulary tiles of 16 columns (as a kernel tiling V
  // would) with the running grad_x parked in a bf16 buffer (the input's dtype) between tiles, the gather added
  // last: one bf16 rounding of the running sum per tile, V/16 of them.
  template <class DBlock> void grad_x_parked_in_bf16(const DBlock& D) {
    const Eigen::Index R = D.rows(), H = shape_.H, V = shape_.V;
    const Eigen::Index block = 16;
    MatrixF parked = MatrixF::Zero(R, H);
    for (Eigen::Index v0 = 0; v0 < V; v0 += block) {
      const Eigen::Index width = std::min(block, V - v0);
      parked.noalias() += D.middleCols(v0, width) * weight_.middleRows(v0, width);
      parked = parked.unaryExpr([](float v) { return round_bf16(v); });
    }
    with_input_type(dtype_, [&]<class T>(T) {
      T* grad_x = grad_x_.as<T>().data();
      for (Eigen::Index i = 0; i < R; ++i) {
        const auto r = static_cast<std::size_t>(rows_[i]);
        const std::int64_t column = gathered_column(problem_, targets_, static_cast<std::int64_t>(r));
        for (Eigen::Index h = 0; h < H; ++h)
          grad_x[r * static_cast<std::size_t>(H) + h] =
              T(c_[r] != 0.f ? parked(i, h) + c_[r] * weight_(column, h) : parked(i, h));
      }
    });
  }

  void add_gradient_outputs(TensorMap& out) {
    const auto H = shape_.H, V = shape_.V;
    if (options_.grad_x) out[output_name::grad_x] = std::move(grad_x_);
    if (!options_.grad_weight) return;
    const std::span<const float> gw(grad_weight_.data(), static_cast<std::size_t>(grad_weight_.size()));
    const std::span<const float> gb(grad_bias_.data(), static_cast<std::size_t>(grad_bias_.size()));
    if (options_.grad_weight_f32) {
      out[output_name::grad_weight] = Tensor::from<float>({V, H}, gw);
      if (problem_.has_bias()) out[output_name::grad_bias] = Tensor::from<float>({V}, gb);
      return;
    }
    out[output_name::grad_weight] = rounded({V, H}, gw);
    if (problem_.has_bias()) out[output_name::grad_bias] = rounded({V}, gb);
  }

  // values rounded once to the inputs' dtype.
  Tensor rounded(std::vector<std::int64_t> shape, std::span<const float> values) const {
    Tensor t = Tensor::uninitialized(dtype_, std::move(shape));
    with_input_type(dtype_, [&]<class T>(T) {
      auto dst = t.as<T>();
      const auto size = static_cast<std::int64_t>(values.size());
#pragma omp parallel for schedule(static)
      for (std::int64_t j = 0; j < size; ++j) dst[j] = T(values[j]);
    });
    return t;
  }

  const Problem& problem_;
  const Options& options_;
  // Options::logit_distances applies to bf16 inputs: f16 and f32 gradients keep dz from the fp32 logits.
  const bool distances_ = options_.logit_distances && problem_.input_dtype() == DType::BF16;
  const Shape shape_;
  const Mutant mutant_;
  const Schedule schedule_;
  const Targets targets_;
  const DType dtype_;          // of the inputs, grad_x, and grad_weight/grad_bias unless F32 is asked for
  const bool bf16_operands_;   // D rounded to bf16, as the cuda kernel's GEMMs take it
  RowStats stats_;         // lse and z_target relative to row_max_
  std::vector<float> row_max_;  // [N] the max shift of each row
  std::vector<float> k_;  // [N] per-row coefficient
  std::vector<float> c_;  // [N] exact target-column value of dz
  MatrixF weight_;        // [V, H] the weight widened to float
  VectorF bias_;          // [V]
  std::vector<std::int64_t> rows_;  // the current chunk's token rows
  MatrixF x_chunk_;       // [rows, H]
  MatrixF logits_;        // [rows, V] logits, then D in place
  MatrixF grad_x_chunk_;  // [rows, H]
  MatrixF grad_weight_;   // [V, H] fp32 accumulator over all chunks
  VectorF grad_bias_;     // [V]
  Tensor grad_x_;         // [B, T, H] the output, in the inputs' dtype
};

}  // namespace

TensorMap compute(const Problem& problem, const Options& options) { return compute_mutant(problem, options, Mutant::none); }

}  // namespace simpo::fused::cpu

namespace simpo::fused {

TensorMap compute_mutant(const Problem& problem, const Options& options, Mutant mutant) {
  validate(problem, {.scan_values = options.validate});
  return cpu::Run(problem, options, mutant).compute();
}

}  // namespace simpo::fused
