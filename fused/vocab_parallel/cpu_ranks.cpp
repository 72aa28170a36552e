// The vocab-parallel step (vocab_parallel.h) with G ranks simulated in one process on the CPU. Per chunk of
// token rows (fused/schedule.h, the plan every backend follows):
//   each rank g:  Z_g = X_chunk W_g^T + b_g; per row its (max, sum exp(z - max)) over its columns (256-lane
//                 sums, as the cpu backend), its sum of logits, and the target logit if it owns the target
//   collective 1: merge the ranks' (max, sum) in rank order -> the row's max M and S = sum exp(z - M);
//                 add the ranks' row sums and target logits (non-owners contribute 0) in rank order
//   every rank:   the same row stats -> the same k per row (forward_outputs.h, shared with both backends)
//   each rank g:  D_g = bf16(-k softmax) on its columns, 0 in the target column; the owner keeps the exact
//                 target coefficient c in fp32 and applies it outside the GEMMs (as the cpu backend does)
//                 partial grad_x_g = D_g W_g (+ c W[target] on the owner), in fp32
//   collective 3: sum the partials in rank order, round to bf16 once: every rank's grad_x
//   each rank g:  grad_W_g += D_g^T X_chunk (+ c x on the owner), grad_b_g likewise: local, never reduced
#include "fused/vocab_parallel/vocab_parallel.h"

#include "fused/forward_outputs.h"
#include "fused/schedule.h"
#include "fused/simpo_math.h"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

namespace simpo::fused::vocab_parallel {

namespace {

using MatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using VectorF = Eigen::Matrix<float, Eigen::Dynamic, 1>;

// One row's (max, sum of exp(z - max)) over a rank's columns: 256 strided lane sums, then a pairwise tree,
// as the cpu backend and a GPU block reduce a row (one running fp32 sum over V terms drifts by ~sqrt(V) ulps).
math::LogSumExp<float> row_lse(const float* z, Eigen::Index columns) {
  if (columns == 0) return math::lse_empty<float>();
  const float max = *std::max_element(z, z + columns);
  constexpr Eigen::Index lanes = 256;
  float lane[lanes] = {};
  for (Eigen::Index base = 0; base < columns; base += lanes)
    for (Eigen::Index j = 0; j < std::min(lanes, columns - base); ++j) lane[j] += std::exp(z[base + j] - max);
  for (Eigen::Index half = lanes / 2; half > 0; half /= 2)
    for (Eigen::Index j = 0; j < half; ++j) lane[j] += lane[j + half];
  return {max, lane[0]};
}

// What one rank holds: its weight and bias rows (bf16 values widened to float, exact), its logits/dz buffer
// for a chunk, and its local gradient accumulators.
struct Rank {
  VocabShard shard;
  MatrixF weight;       // [shard rows, H]
  VectorF bias;         // [shard rows] (empty without a bias)
  MatrixF logits;       // [chunk rows, shard rows]: logits, then D in place
  MatrixF grad_x_part;  // [chunk rows, H]: this rank's D_g W_g
  MatrixF grad_weight;  // [shard rows, H] fp32 over all chunks
  VectorF grad_bias;    // [shard rows]
  std::vector<math::LogSumExp<float>> lse;  // [chunk rows] this rank's row statistics
  std::vector<double> rowsum;
  std::vector<float> z_target;  // the target logit where this rank owns it, else 0
  bool owns(std::int64_t column) const { return column >= shard.begin && column < shard.end; }
};

class Run {
 public:
  Run(const Problem& problem, const Options& options, int shards)
      : problem_(problem),
        options_(options),
        shape_(problem.shape),
        schedule_(plan(problem.shape, options)),
        targets_(read_targets(problem)),
        stats_(problem.shape.N()),
        row_max_(static_cast<std::size_t>(problem.shape.N()), 0.f),
        k_(static_cast<std::size_t>(problem.shape.N()), 0.f),
        c_(static_cast<std::size_t>(problem.shape.N()), 0.f) {
    const Eigen::Index H = shape_.H, rows = schedule_.max_rows();
    for (const VocabShard& shard : split_vocabulary(shape_.V, shards)) {
      Rank rank;
      rank.shard = shard;
      rank.weight.resize(shard.size(), H);
      const bf16* w = problem.weight.as<bf16>().data() + shard.begin * H;
      for (Eigen::Index v = 0; v < shard.size(); ++v)
        for (Eigen::Index h = 0; h < H; ++h) rank.weight(v, h) = static_cast<float>(w[v * H + h]);
      if (problem.has_bias()) {
        rank.bias.resize(shard.size());
        for (Eigen::Index v = 0; v < shard.size(); ++v)
          rank.bias[v] = static_cast<float>(problem.bias->as<bf16>()[static_cast<std::size_t>(shard.begin + v)]);
      }
      rank.logits.resize(rows, shard.size());
      if (options.gradients) {
        rank.grad_x_part.resize(rows, H);
        rank.grad_weight = MatrixF::Zero(shard.size(), H);
        rank.grad_bias = VectorF::Zero(shard.size());
      }
      ranks_.push_back(std::move(rank));
    }
    x_chunk_.resize(rows, H);
    if (options.gradients) grad_x_.assign(static_cast<std::size_t>(shape_.N() * H), bf16(0.f));
  }

  std::vector<RankOutputs> compute() {
    walk(schedule_, shape_,
         Stages{.forward = [this](const Chunk& c, bool) { forward_chunk(c); },
                .pair_math =
                    [this](std::int64_t pair_begin, std::int64_t pair_end) {
                      row_coefficients(problem_, targets_, stats_, pair_begin, pair_end, Mutant::none, k_);
                    },
                .logits = [this](const Chunk& c) { logits(c); },  // recomputed: pass 1 kept the stats, not the logits
                .backward = [this](const Chunk&) { gradient_chunk(); }});
    // Every rank derives the forward outputs from the same reduced stats; each keeps its own copy.
    const TensorMap forward = forward_outputs(problem_, targets_, stats_);
    std::vector<RankOutputs> out;
    for (const Rank& rank : ranks_) {
      RankOutputs r{rank.shard, forward};
      if (options_.gradients) add_gradient_outputs(rank, r.outputs);
      out.push_back(std::move(r));
    }
    return out;
  }

 private:
  // Every rank's logits of the chunk's rows (each rank reads the same x rows).
  void logits(const Chunk& chunk) {
    rows_.clear();
    for (int p = 0; p < chunk.part_count; ++p)
      for (std::int64_t r = chunk.parts[p].begin; r < chunk.parts[p].end; ++r) rows_.push_back(r);
    const Eigen::Index R = static_cast<Eigen::Index>(rows_.size()), H = shape_.H;
    const bf16* x = problem_.x.as<bf16>().data();
    for (Eigen::Index i = 0; i < R; ++i)
      for (Eigen::Index h = 0; h < H; ++h) x_chunk_(i, h) = static_cast<float>(x[rows_[i] * H + h]);
    for (Rank& rank : ranks_) {
      rank.logits.topRows(R).noalias() = x_chunk_.topRows(R) * rank.weight.transpose();
      if (problem_.has_bias()) rank.logits.topRows(R).rowwise() += rank.bias.transpose();
    }
  }

  void forward_chunk(const Chunk& chunk) {
    logits(chunk);
    const Eigen::Index R = static_cast<Eigen::Index>(rows_.size());
    // Each rank's local statistics.
    for (Rank& rank : ranks_) {
      rank.lse.assign(R, math::lse_empty<float>());
      rank.rowsum.assign(R, 0.0);
      rank.z_target.assign(R, 0.f);
      const Eigen::Index columns = rank.shard.size();
      for (Eigen::Index i = 0; i < R; ++i) {
        const float* z = &rank.logits(i, 0);
        rank.lse[i] = row_lse(z, columns);
        double sum = 0;
        for (Eigen::Index v = 0; v < columns; ++v) sum += z[v];
        rank.rowsum[i] = sum;
        const std::int64_t column = target_column(rows_[i]);
        if (rank.owns(column)) rank.z_target[i] = z[column - rank.shard.begin];
      }
    }
    // Collective 1 and 2, in rank order: the row's max and sum of exp, its sum of logits, its target logit.
    for (Eigen::Index i = 0; i < R; ++i) {
      math::LogSumExp<float> merged = math::lse_empty<float>();
      double rowsum = 0;
      float z_target = 0.f;
      for (const Rank& rank : ranks_) {
        merged = math::lse_merge(merged, rank.lse[i]);
        rowsum += rank.rowsum[i];
        z_target += rank.z_target[i];  // one owner; the others add an exact 0
      }
      // Stored relative to the row max, as the cpu backend stores them (forward_outputs.h reads only the
      // difference).
      const auto r = static_cast<std::size_t>(rows_[i]);
      row_max_[r] = merged.max;
      stats_.lse[r] = std::log(merged.sum);
      stats_.z_target[r] = target_column(rows_[i]) >= 0 ? z_target - merged.max : 0.f;
      stats_.rowsum[r] = rowsum;
    }
  }

  void gradient_chunk() {
    const Eigen::Index R = static_cast<Eigen::Index>(rows_.size()), H = shape_.H;
    for (Eigen::Index i = 0; i < R; ++i) {
      const auto r = static_cast<std::size_t>(rows_[i]);
      c_[r] = k_[r] == 0.f ? 0.f : math::target_coefficient(k_[r], stats_.z_target[r], stats_.lse[r]);
    }
    for (Rank& rank : ranks_) {
      const Eigen::Index columns = rank.shard.size();
      for (Eigen::Index i = 0; i < R; ++i) {
        float* z = &rank.logits(i, 0);
        const auto r = static_cast<std::size_t>(rows_[i]);
        const float k = k_[r], max = row_max_[r], log_sum = stats_.lse[r];
        if (k == 0.f) {
          std::fill(z, z + columns, 0.f);
          continue;
        }
        for (Eigen::Index v = 0; v < columns; ++v) z[v] = static_cast<float>(bf16(math::softmax_gradient(k, z[v] - max, log_sum)));
        const std::int64_t column = target_column(rows_[i]);
        if (rank.owns(column)) z[column - rank.shard.begin] = 0.f;
      }
      const auto D = rank.logits.topRows(R);
      const auto X = x_chunk_.topRows(R);
      rank.grad_x_part.topRows(R).noalias() = D * rank.weight;
      rank.grad_weight.noalias() += D.transpose() * X;
      if (problem_.has_bias()) rank.grad_bias.noalias() += D.colwise().sum().transpose();
      // The target column's exact coefficient, on the rank that owns it.
      for (Eigen::Index i = 0; i < R; ++i) {
        const auto r = static_cast<std::size_t>(rows_[i]);
        const std::int64_t column = target_column(rows_[i]);
        if (c_[r] == 0.f || !rank.owns(column)) continue;
        const Eigen::Index local = column - rank.shard.begin;
        rank.grad_x_part.row(i) += c_[r] * rank.weight.row(local);
        rank.grad_weight.row(local) += c_[r] * X.row(i);
        if (problem_.has_bias()) rank.grad_bias[local] += c_[r];
      }
    }
    // Collective 3, in rank order: grad_x = sum of the ranks' partials, rounded to bf16 once.
    for (Eigen::Index i = 0; i < R; ++i) {
      bf16* out = &grad_x_[static_cast<std::size_t>(rows_[i] * H)];
      for (Eigen::Index h = 0; h < H; ++h) {
        float sum = 0.f;
        for (const Rank& rank : ranks_) sum += rank.grad_x_part(i, h);
        out[h] = bf16(sum);
      }
    }
  }

  std::int64_t target_column(std::int64_t row) const {
    const std::int64_t t = problem_.target[static_cast<std::size_t>(row)];
    return t == problem_.hp.ignore_index ? -1 : t;
  }

  void add_gradient_outputs(const Rank& rank, TensorMap& out) const {
    const auto B = shape_.B, T = shape_.T, H = shape_.H, rows = rank.shard.size();
    out[output_name::grad_x] = Tensor::from<bf16>({B, T, H}, grad_x_);
    const std::span<const float> gw(rank.grad_weight.data(), static_cast<std::size_t>(rank.grad_weight.size()));
    const std::span<const float> gb(rank.grad_bias.data(), static_cast<std::size_t>(rank.grad_bias.size()));
    const auto put = [&](const std::string& name, std::vector<std::int64_t> shape, std::span<const float> values) {
      if (options_.grad_weight_f32) {
        out[name] = Tensor::from<float>(std::move(shape), values);
        return;
      }
      std::vector<bf16> rounded(values.begin(), values.end());
      out[name] = Tensor::from<bf16>(std::move(shape), rounded);
    };
    put(output_name::grad_weight, {rows, H}, gw);
    if (problem_.has_bias()) put(output_name::grad_bias, {rows}, gb);
  }

  const Problem& problem_;
  const Options& options_;
  const Shape shape_;
  const Schedule schedule_;
  const Targets targets_;
  RowStats stats_;              // the reduced stats, relative to row_max_ (identical on every rank)
  std::vector<float> row_max_;  // [N]
  std::vector<float> k_;        // [N]
  std::vector<float> c_;        // [N]
  std::vector<Rank> ranks_;
  std::vector<std::int64_t> rows_;
  MatrixF x_chunk_;
  std::vector<bf16> grad_x_;    // [N, H]
};

}  // namespace

std::vector<VocabShard> split_vocabulary(std::int64_t V, int shards) {
  if (shards < 1 || shards > V)
    throw InputError("--vocab-shards " + std::to_string(shards) + ": needs 1 <= shards <= V (V = " + std::to_string(V) + ")");
  std::vector<VocabShard> out;
  const std::int64_t base = V / shards, extra = V % shards;
  std::int64_t begin = 0;
  for (int g = 0; g < shards; ++g) {
    const std::int64_t size = base + (g < extra ? 1 : 0);
    out.push_back({begin, begin + size});
    begin += size;
  }
  return out;
}

std::vector<RankOutputs> compute_ranks(const Problem& problem, const Options& options, int shards) {
  validate(problem, {.scan_values = options.validate});
  if (problem.input_dtype() != DType::BF16)
    throw InputError("the vocab-parallel step takes bf16 inputs; these are " + input_dtype_name(problem.input_dtype()));
  split_vocabulary(problem.shape.V, shards);  // the shard count's error before any allocation
  return Run(problem, options, shards).compute();
}

TensorMap gather(const std::vector<RankOutputs>& ranks) {
  if (ranks.empty()) throw InputError("gather: no ranks");
  TensorMap out = ranks[0].outputs;
  const auto local = [](const std::string& name) { return name == output_name::grad_weight || name == output_name::grad_bias; };
  for (std::size_t g = 1; g < ranks.size(); ++g)
    for (const auto& [name, t] : ranks[g].outputs) {
      if (local(name)) continue;
      const auto it = out.find(name);
      if (it == out.end() || it->second.shape != t.shape || it->second.bytes != t.bytes)
        throw InputError("rank " + std::to_string(g) + "'s " + name + " differs from rank 0's: a collective did not reach every rank");
    }
  for (const char* name : {output_name::grad_weight, output_name::grad_bias}) {
    if (!ranks[0].outputs.count(name)) continue;
    const Tensor& first = ranks[0].outputs.at(name);
    std::vector<std::int64_t> shape = first.shape;
    shape[0] = 0;
    std::vector<std::byte> bytes;
    for (const RankOutputs& r : ranks) {
      const Tensor& t = r.outputs.at(name);
      shape[0] += t.shape[0];
      bytes.insert(bytes.end(), t.bytes.begin(), t.bytes.end());
    }
    Tensor whole(first.dtype, shape);
    std::memcpy(whole.bytes.data(), bytes.data(), bytes.size());
    out[name] = std::move(whole);
  }
  return out;
}

TensorMap compute(const Problem& problem, const Options& options, int shards) {
  return gather(compute_ranks(problem, options, shards));
}

}  // namespace simpo::fused::vocab_parallel
