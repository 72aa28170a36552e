// The vocab-parallel step on CUDA devices (vocab_parallel.h): rank g holds weight rows [shard.begin, shard.end)
// (and their bias) on its device, plus all of x and target. Per chunk of token rows (fused/schedule.h's plan, the
// same on every rank), on each rank with the one-GPU cuda backend's GEMMs and kernels unless named otherwise:
//   logits     Z_g = X W_g^T (promoted GEMM on sm_90, its cuBLAS tail, or sliced cuBLAS: cuda::logits_gemm, as one GPU)
//   stats      per row: its max, sum exp(z - max), double row sum, raw target logit on the owner (shard_kernels)
//   collective all-reduce max of the row max; each rank rescales its sum to that max; all-reduce sum of
//              (sum, target logit) and of the row sums; every rank then holds the one-GPU backend's row stats
//   pair math  every rank, on the same stats: the same dL/davg and so the same k per row
//   dz         launch_dz on the rank's columns (shard-local targets: its 0 only in the owner's target column)
//   gradients  grad_x part = D_g W_g (+ the owner's exact target term c W[t], fp32); grad_W_g (+)= D_g^T X and
//              the owner's c x scatter; grad_b_g from D_g's column sums: local, never reduced
//   collective all-reduce sum of the fp32 grad_x parts, then one rounding to bf16 on every rank
// Each rank's row statistics come back to the host and go through fused/forward_outputs.h like every backend's.
#include "fused/cuda/cuda_backend.h"
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_fused.h"
#include "fused/cuda/kernels.h"
#include "fused/cuda/promoted_gemm.h"
#include "fused/forward_outputs.h"
#include "fused/schedule.h"
#include "fused/vocab_parallel/collectives.h"
#include "fused/vocab_parallel/cuda_ranks.h"
#include "fused/vocab_parallel/shard_kernels.h"
#include "fused/vocab_parallel/vocab_parallel.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>

namespace simpo::fused::vocab_parallel {
namespace {

using cuda::DeviceBuffer;
using cuda::padded;
using Buffer = Collectives::Buffer;

// cuBLASLt's (and the promoted GEMM's) scratch, as the one-GPU runner sizes it.
std::int64_t gemm_scratch_bytes(std::int64_t budget) {
  return std::min<std::int64_t>(std::int64_t{32} << 20, budget / 8 / 256 * 256);
}

// A [rows, cols] block of a row-major host bf16 matrix (row stride `cols_total`) into a device [rows, ld] one
// whose extra columns are zero.
DeviceBuffer upload_rows(const bf16* host, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                         const std::string& name, cudaStream_t stream) {
  DeviceBuffer device(static_cast<std::size_t>(rows * ld * 2), name);
  if (ld != cols) SIMPO_CUDA_CHECK(cudaMemsetAsync(device.get(), 0, rows * ld * 2, stream));
  SIMPO_CUDA_CHECK(cudaMemcpy2DAsync(device.get(), ld * 2, host, cols * 2, cols * 2, rows, cudaMemcpyHostToDevice,
                                     stream));
  return device;
}

template <class T> DeviceBuffer upload(const std::vector<T>& host, const std::string& name, cudaStream_t stream) {
  DeviceBuffer device(host.size() * sizeof(T), name);
  if (!host.empty())
    SIMPO_CUDA_CHECK(cudaMemcpyAsync(device.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  return device;
}

Tensor download(const void* device, DType dtype, std::vector<std::int64_t> shape, cudaStream_t stream) {
  Tensor t(dtype, std::move(shape));
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(t.bytes.data(), device, t.bytes.size(), cudaMemcpyDeviceToHost, stream));
  return t;
}

struct Rank {
  int index = 0, device = 0;
  VocabShard shard;
  std::int64_t ld_v = 0;  // padded(shard rows): the rank's logits and dz row length
  cudaStream_t stream = nullptr;
  DeviceBuffer gemm_scratch;
  std::unique_ptr<cuda::Gemms> gemms;
  // Inputs: x and target whole, the weight and bias rows of the shard, the shard-local targets.
  DeviceBuffer x, weight, bias, target, local_target, completion_tokens, avg_grad;
  // [N] row statistics (after the collectives: identical on every rank), target coefficients.
  DeviceBuffer row_max, lse, z_target, rowsum, target_coef, own_coef;
  // Chunk buffers.
  DeviceBuffer logits, dz, grad_x_part, x_rows, local_max, max, sum_and_target, chunk_rowsum;
  // Outputs: grad_x replicated, the shard's gradients.
  DeviceBuffer grad_x, grad_weight, grad_bias, grad_weight_bf16, grad_bias_bf16;

  Rank() = default;
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;
  ~Rank() {
    gemms.reset();
    if (stream) {
      cudaSetDevice(device);
      cudaStreamDestroy(stream);
    }
  }
  void use() const { SIMPO_CUDA_CHECK(cudaSetDevice(device)); }
  ChunkStats chunk_stats(std::int64_t rows) const {
    return {local_max.as<float>(), max.as<float>(), sum_and_target.as<float>(), chunk_rowsum.as<double>(), rows};
  }
};

class Step {
 public:
  Step(const Problem& problem, const Options& options, int shards, Collectives& collectives)
      : problem_(problem),
        options_(options),
        shape_(problem.shape),
        targets_(read_targets(problem)),
        logits_gemm_(cuda::logits_gemm(problem.shape.H, DType::BF16, options, cuda::device_features())),
        collectives_(collectives),
        ld_h_(padded(problem.shape.H)),
        gradients_(options.gradients) {
    const std::vector<VocabShard> split = split_vocabulary(shape_.V, shards);
    if (collectives.ranks() != shards)
      throw InputError("vocab-parallel: " + std::to_string(collectives.ranks()) + " communicating ranks for " +
                       std::to_string(shards) + " shards");
    const std::int64_t N = shape_.N(), B = shape_.B, H = shape_.H, ld_v_max = padded(split[0].size());
    // The plan, the same on every rank: sized for the largest shard (rank 0's) in options.workspace_bytes, which
    // is each rank's budget on its own device.
    const std::int64_t budget = std::max<std::int64_t>(options.workspace_bytes, 0);
    gemm_bytes_ = gemm_scratch_bytes(budget);
    const std::int64_t fixed = gemm_bytes_ + N * (6 * 4 + 8 + 2 * 8) + B * 16 + 32 * 256;
    const std::int64_t per_row = ld_v_max * 4 + (gradients_ ? ld_v_max * 2 + ld_h_ * 4 + ld_h_ * 2 : 0) + 4 * 4 + 8;
    const std::int64_t rows_that_fit = budget > fixed ? (budget - fixed) / per_row : 0;
    if (rows_that_fit < 1)
      throw InputError("vocab-parallel cuda: workspace of " + std::to_string(budget) + " bytes cannot hold one token row of " +
                       shape_.to_string() + " over " + std::to_string(shards) + " shards: a rank needs " +
                       std::to_string(fixed + per_row) + " bytes (" + std::to_string(fixed) + " fixed, plus " +
                       std::to_string(per_row) + " per row)");
    schedule_ = plan_rows(shape_, rows_that_fit, options);
    schedule_.bytes_per_row = per_row;  // a rank's, for its largest shard (not the one-GPU formula's full V)
    const std::int64_t rows = schedule_.max_rows();

    for (int g = 0; g < shards; ++g) {
      auto rank = std::make_unique<Rank>();
      Rank& r = *rank;
      ranks_.push_back(std::move(rank));
      r.index = g;
      r.device = collectives.device(g);
      r.shard = split[static_cast<std::size_t>(g)];
      r.ld_v = padded(r.shard.size());
      r.use();
      SIMPO_CUDA_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
      const std::string who = "rank " + std::to_string(g) + "'s ";
      r.gemm_scratch = DeviceBuffer(static_cast<std::size_t>(gemm_bytes_), who + "GEMM scratch");
      r.gemms = std::make_unique<cuda::Gemms>(r.stream, r.gemm_scratch.get(), static_cast<std::size_t>(gemm_bytes_));

      r.x = upload_rows(problem.x.as<bf16>().data(), N, H, ld_h_, who + "x", r.stream);
      r.weight = upload_rows(problem.weight.as<bf16>().data() + r.shard.begin * H, r.shard.size(), H, ld_h_, who + "weight shard",
                             r.stream);
      if (problem.has_bias())
        r.bias = upload_rows(problem.bias->as<bf16>().data() + r.shard.begin, 1, r.shard.size(), r.shard.size(), who + "bias shard",
                             r.stream);
      r.target = upload(problem.target, who + "target", r.stream);
      std::vector<std::int64_t> local(problem.target.size());
      for (std::size_t i = 0; i < local.size(); ++i) {
        const std::int64_t t = problem.target[i];
        local[i] = t == problem.hp.ignore_index ? kIgnored
                   : t >= r.shard.begin && t < r.shard.end ? t - r.shard.begin
                                                          : kElsewhere;
      }
      r.local_target = upload(local, who + "shard-local targets", r.stream);
      r.completion_tokens = upload(targets_.n, who + "completion tokens", r.stream);
      r.avg_grad = DeviceBuffer(static_cast<std::size_t>(B * 8), who + "avg_grad");

      const auto n4 = static_cast<std::size_t>(N * 4);
      r.row_max = DeviceBuffer(n4, who + "row max");
      r.lse = DeviceBuffer(n4, who + "lse");
      r.z_target = DeviceBuffer(n4, who + "z_target");
      r.rowsum = DeviceBuffer(n4 * 2, who + "rowsum");
      r.target_coef = DeviceBuffer(n4, who + "target coefficients");
      r.own_coef = DeviceBuffer(n4, who + "owned target coefficients");

      r.logits = DeviceBuffer(static_cast<std::size_t>(rows * r.ld_v * 4), who + "chunk logits");
      r.local_max = DeviceBuffer(static_cast<std::size_t>(rows * 4), who + "chunk row max");
      r.max = DeviceBuffer(static_cast<std::size_t>(rows * 4), who + "chunk reduced row max");
      r.sum_and_target = DeviceBuffer(static_cast<std::size_t>(rows * 8), who + "chunk sums and target logits");
      r.chunk_rowsum = DeviceBuffer(static_cast<std::size_t>(rows * 8), who + "chunk row sums");
      if (gradients_) {
        r.dz = DeviceBuffer(static_cast<std::size_t>(rows * r.ld_v * 2), who + "chunk dz");
        r.grad_x_part = DeviceBuffer(static_cast<std::size_t>(rows * ld_h_ * 4), who + "chunk grad_x part");
        r.x_rows = DeviceBuffer(static_cast<std::size_t>(rows * ld_h_ * 2), who + "chunk x rows");
        r.grad_x = DeviceBuffer(static_cast<std::size_t>(N * H * 2), who + "grad_x");
        r.grad_weight = DeviceBuffer(static_cast<std::size_t>(r.shard.size() * ld_h_ * 4), who + "fp32 grad_weight shard");
        if (problem.has_bias()) r.grad_bias = DeviceBuffer(static_cast<std::size_t>(r.shard.size() * 4), who + "fp32 grad_bias shard");
        if (!options.grad_weight_f32) {
          r.grad_weight_bf16 = DeviceBuffer(static_cast<std::size_t>(r.shard.size() * H * 2), who + "grad_weight shard");
          if (problem.has_bias()) r.grad_bias_bf16 = DeviceBuffer(static_cast<std::size_t>(r.shard.size() * 2), who + "grad_bias shard");
        }
      }
    }
  }

  // The whole step, enqueued on every rank's stream; waits once at the end for the row statistics.
  std::vector<RowStats> run() {
    for (auto& r : ranks_) {
      r->use();
      if (r->grad_bias.get()) SIMPO_CUDA_CHECK(cudaMemsetAsync(r->grad_bias.get(), 0, r->shard.size() * 4, r->stream));
    }
    first_weight_gemm_ = true;
    walk(schedule_, shape_,
         Stages{.forward =
                    [this](const Chunk& c, bool) {
                      logits_of(c);
                      statistics_of(c);
                    },
                .pair_math = [this](std::int64_t b, std::int64_t e) { pair_math(b, e); },
                .logits = [this](const Chunk& c) { logits_of(c); },
                .backward = [this](const Chunk& c) { backward_of(c); }});
    const std::int64_t N = shape_.N(), H = shape_.H;
    std::vector<RowStats> stats;
    for (auto& r : ranks_) {
      r->use();
      if (gradients_ && r->grad_weight_bf16.get())
        cuda::launch_round_to(r->grad_weight.as<float>(), ld_h_, r->shard.size(), H, r->grad_weight_bf16.as<__nv_bfloat16>(), r->stream);
      if (gradients_ && r->grad_bias_bf16.get())
        cuda::launch_round_to(r->grad_bias.as<float>(), r->shard.size(), 1, r->shard.size(), r->grad_bias_bf16.as<__nv_bfloat16>(), r->stream);
      RowStats s(N);
      SIMPO_CUDA_CHECK(cudaMemcpyAsync(s.lse.data(), r->lse.get(), N * 4, cudaMemcpyDeviceToHost, r->stream));
      SIMPO_CUDA_CHECK(cudaMemcpyAsync(s.z_target.data(), r->z_target.get(), N * 4, cudaMemcpyDeviceToHost, r->stream));
      SIMPO_CUDA_CHECK(cudaMemcpyAsync(s.rowsum.data(), r->rowsum.get(), N * 8, cudaMemcpyDeviceToHost, r->stream));
      stats.push_back(std::move(s));
    }
    for (auto& r : ranks_) {
      r->use();
      SIMPO_CUDA_CHECK(cudaStreamSynchronize(r->stream));
    }
    return stats;
  }

  const Schedule& schedule() const { return schedule_; }

  // run(), then every rank's outputs: forward outputs from its own copy of the statistics, grad_x, its shards.
  std::vector<RankOutputs> compute() {
    const std::vector<RowStats> stats = run();
    const std::int64_t H = shape_.H;
    std::vector<RankOutputs> out;
    for (auto& r : ranks_) {
      r->use();
      RankOutputs o{r->shard, forward_outputs(problem_, targets_, stats[static_cast<std::size_t>(r->index)])};
      if (gradients_) {
        o.outputs[output_name::grad_x] = download(r->grad_x.get(), DType::BF16, output_shape(shape_, output_name::grad_x), r->stream);
        const std::vector<std::int64_t> wshape{r->shard.size(), H}, bshape{r->shard.size()};
        if (options_.grad_weight_f32) {
          Tensor t(DType::F32, wshape);
          SIMPO_CUDA_CHECK(cudaMemcpy2DAsync(t.bytes.data(), H * 4, r->grad_weight.get(), ld_h_ * 4, H * 4,
                                             r->shard.size(), cudaMemcpyDeviceToHost, r->stream));
          o.outputs[output_name::grad_weight] = std::move(t);
          if (problem_.has_bias()) o.outputs[output_name::grad_bias] = download(r->grad_bias.get(), DType::F32, bshape, r->stream);
        } else {
          o.outputs[output_name::grad_weight] = download(r->grad_weight_bf16.get(), DType::BF16, wshape, r->stream);
          if (problem_.has_bias()) o.outputs[output_name::grad_bias] = download(r->grad_bias_bf16.get(), DType::BF16, bshape, r->stream);
        }
      }
      SIMPO_CUDA_CHECK(cudaStreamSynchronize(r->stream));
      out.push_back(std::move(o));
    }
    return out;
  }

 private:
  cuda::LogitRows part_logits(const Rank& r, const RowRange& part, std::int64_t offset) const {
    return {r.logits.as<float>() + offset * r.ld_v, r.ld_v, part.rows(), part.begin, r.shard.size(),
            r.bias.as<__nv_bfloat16>(), r.local_target.as<std::int64_t>(), kIgnored};
  }

  // Every rank's logits of the chunk's rows, as the one-GPU runner computes them.
  void logits_of(const Chunk& c) {
    for (auto& rp : ranks_) {
      Rank& r = *rp;
      r.use();
      const std::int64_t V = r.shard.size();
      const auto* weight = r.weight.as<__nv_bfloat16>();
      std::int64_t offset = 0;
      for (int i = 0; i < c.part_count; ++i) {
        const RowRange& part = c.parts[i];
        const auto* x_part = r.x.as<__nv_bfloat16>() + part.begin * ld_h_;
        float* logits_part = r.logits.as<float>() + offset * r.ld_v;
        // The promoted GEMM stores whole groups of 4 columns; the last V % 4 through cuBLAS, cut along k as often.
        const std::int64_t V4 = logits_gemm_.promoted ? V / 4 * 4 : 0;
        if (V4 > 0)
          cuda::promoted_logits(part.rows(), V4, ld_h_, x_part, weight, logits_part, r.ld_v, logits_gemm_.promotion_k,
                                r.stream, r.gemm_scratch.get(), static_cast<std::size_t>(gemm_bytes_));
        if (V4 < V)
          r.gemms->logits(part.rows(), V - V4, ld_h_, x_part, weight + V4 * ld_h_, logits_part + V4, r.ld_v,
                          logits_gemm_.k_splits);
        offset += part.rows();
      }
    }
  }

  std::vector<Buffer> buffers(DeviceBuffer Rank::*member) const {
    std::vector<Buffer> out;
    for (const auto& r : ranks_) out.push_back({((*r).*member).get(), r->stream});
    return out;
  }

  // Each rank's partial statistics of the chunk's rows, the collectives, the merged [N] row statistics.
  void statistics_of(const Chunk& c) {
    const std::int64_t rows = c.rows();
    for (auto& rp : ranks_) {
      Rank& r = *rp;
      r.use();
      std::int64_t offset = 0;
      for (int i = 0; i < c.part_count; ++i) {
        launch_shard_row_stats(part_logits(r, c.parts[i], offset), offset, r.chunk_stats(rows), r.stream);
        offset += c.parts[i].rows();
      }
    }
    const auto n = static_cast<std::size_t>(rows);
    collectives_.all_reduce(buffers(&Rank::max), n, Collectives::Type::f32, Collectives::Op::max);
    for (auto& r : ranks_) {
      r->use();
      launch_rescale_sums(r->chunk_stats(rows), r->stream);
    }
    collectives_.all_reduce(buffers(&Rank::sum_and_target), 2 * n, Collectives::Type::f32, Collectives::Op::sum);
    collectives_.all_reduce(buffers(&Rank::chunk_rowsum), n, Collectives::Type::f64, Collectives::Op::sum);
    for (auto& rp : ranks_) {
      Rank& r = *rp;
      r.use();
      std::int64_t offset = 0;
      for (int i = 0; i < c.part_count; ++i) {
        const RowRange& part = c.parts[i];
        launch_finish_stats(r.chunk_stats(rows), offset, part.rows(), part.begin, r.target.as<std::int64_t>(),
                            problem_.hp.ignore_index, r.row_max.as<float>(), r.lse.as<float>(), r.z_target.as<float>(),
                            r.rowsum.as<double>(), r.stream);
        offset += part.rows();
      }
    }
  }

  void pair_math(std::int64_t pair_begin, std::int64_t pair_end) {
    if (!gradients_) return;
    const Hyperparameters& hp = problem_.hp;
    const cuda::PairParams params{shape_.T, shape_.P(), hp.ignore_index, hp.beta, hp.gamma, hp.label_smoothing};
    for (auto& r : ranks_) {
      r->use();
      cuda::launch_pair_math(params, pair_begin, pair_end, r->target.as<std::int64_t>(), r->lse.as<float>(),
                             r->z_target.as<float>(), r->completion_tokens.as<std::int64_t>(), r->avg_grad.as<double>(),
                             r->stream);
    }
  }

  // dz on each rank's columns, its gradient GEMMs once over the chunk's rows, its local gradient terms; then the
  // all-reduce of the fp32 grad_x parts and one rounding.
  void backward_of(const Chunk& c) {
    const Hyperparameters& hp = problem_.hp;
    const std::int64_t rows = c.rows(), H = shape_.H;
    const double nll_weight =
        hp.compute_nll_loss && targets_.n_chosen > 0 ? hp.alpha / static_cast<double>(targets_.n_chosen) : 0.0;
    for (auto& rp : ranks_) {
      Rank& r = *rp;
      r.use();
      const std::int64_t V = r.shard.size();
      const cuda::CoefficientParams coefficients{shape_.T, shape_.P(), hp.grad_scale, nll_weight, r.avg_grad.as<double>(),
                                                 r.completion_tokens.as<std::int64_t>()};
      auto* dz = r.dz.as<__nv_bfloat16>();
      float* gx = r.grad_x_part.as<float>();
      const auto* weight = r.weight.as<__nv_bfloat16>();
      std::int64_t offset = 0;
      for (int i = 0; i < c.part_count; ++i) {
        cuda::launch_dz(part_logits(r, c.parts[i], offset), coefficients, r.row_max.as<float>(), r.lse.as<float>(),
                        r.z_target.as<float>(), dz + offset * r.ld_v, r.ld_v, r.target_coef.as<float>(), r.stream);
        offset += c.parts[i].rows();
      }
      r.gemms->grad_x(rows, V, ld_h_, dz, r.ld_v, weight, gx);
      const __nv_bfloat16* x_chunk = r.x.as<__nv_bfloat16>() + c.parts[0].begin * ld_h_;
      if (c.part_count > 1) {  // the weight GEMM wants the chunk's x rows contiguous
        offset = 0;
        for (int i = 0; i < c.part_count; ++i) {
          SIMPO_CUDA_CHECK(cudaMemcpyAsync(r.x_rows.as<__nv_bfloat16>() + offset * ld_h_,
                                           r.x.as<__nv_bfloat16>() + c.parts[i].begin * ld_h_,
                                           c.parts[i].rows() * ld_h_ * 2, cudaMemcpyDeviceToDevice, r.stream));
          offset += c.parts[i].rows();
        }
        x_chunk = r.x_rows.as<__nv_bfloat16>();
      }
      r.gemms->accumulate_grad_weight(rows, V, ld_h_, dz, r.ld_v, x_chunk, r.grad_weight.as<float>(),
                                      /*overwrite=*/first_weight_gemm_);
      offset = 0;
      for (int i = 0; i < c.part_count; ++i) {
        const RowRange& part = c.parts[i];
        launch_owner_target_terms(gx + offset * ld_h_, part.rows(), part.begin, H, ld_h_, weight,
                                  r.local_target.as<std::int64_t>(), r.target_coef.as<float>(), r.own_coef.as<float>(),
                                  r.stream);
        cuda::launch_target_scatter(r.x.as<__nv_bfloat16>(), part.rows(), part.begin, H, ld_h_,
                                    r.local_target.as<std::int64_t>(), r.own_coef.as<float>(), r.grad_weight.as<float>(),
                                    r.grad_bias.as<float>(), r.stream);
        offset += part.rows();
      }
      if (r.grad_bias.get()) {
        cuda::ChunkRows chunk_rows;
        for (int i = 0; i < c.part_count; ++i) {
          chunk_rows.begin[i] = c.parts[i].begin;
          chunk_rows.rows[i] = c.parts[i].rows();
        }
        // The column sums alone: this rank's target terms come with launch_target_scatter above.
        cuda::launch_bias_column_sums(dz, r.ld_v, chunk_rows, V, 0, nullptr, nullptr, r.grad_bias.as<float>(), r.stream);
      }
    }
    first_weight_gemm_ = false;
    collectives_.all_reduce(buffers(&Rank::grad_x_part), static_cast<std::size_t>(rows * ld_h_), Collectives::Type::f32,
                            Collectives::Op::sum);
    for (auto& rp : ranks_) {
      Rank& r = *rp;
      r.use();
      std::int64_t offset = 0;
      for (int i = 0; i < c.part_count; ++i) {
        const RowRange& part = c.parts[i];
        cuda::launch_round_to(r.grad_x_part.as<float>() + offset * ld_h_, ld_h_, part.rows(), H,
                                   r.grad_x.as<__nv_bfloat16>() + part.begin * H, r.stream);
        offset += part.rows();
      }
    }
  }

  const Problem& problem_;
  const Options& options_;
  const Shape shape_;
  const Targets targets_;
  const cuda::LogitsGemm logits_gemm_;
  Collectives& collectives_;
  const std::int64_t ld_h_;
  const bool gradients_;
  std::int64_t gemm_bytes_ = 0;
  Schedule schedule_;
  bool first_weight_gemm_ = true;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace

CudaPlan plan_cuda(int shards, Communication communication) {
  if (shards < 1) throw InputError("--vocab-shards " + std::to_string(shards) + ": needs at least one shard");
  CudaPlan plan;
  plan.devices = device_count();
  if (plan.devices == 0)
    throw InputError("--vocab-shards with the cuda backend: no CUDA device is present (--impl cpu runs the ranks' "
                     "algebra on the CPU)");
  const std::string g = std::to_string(shards), d = std::to_string(plan.devices);
  if (communication == Communication::automatic)
    communication = nccl_built() && plan.devices >= shards ? Communication::nccl : Communication::in_process;
  if (communication == Communication::nccl) {
    if (!nccl_built())
      throw InputError("--vocab-shards " + g + " through NCCL: NCCL is not in this build (CMake found none); the "
                       "in-process collectives run the ranks on one GPU");
    if (plan.devices < shards)
      throw InputError("--vocab-shards " + g + " through NCCL needs one GPU per rank, and " + d + " are visible "
                       "(NCCL refuses two ranks on one GPU: \"Duplicate GPU\"); the in-process collectives run them on one GPU");
  }
  plan.communication = communication;
  int current = 0;
  SIMPO_CUDA_CHECK(cudaGetDevice(&current));
  plan.description = communication == Communication::nccl
                         ? g + (shards == 1 ? " rank" : " ranks") + " on GPUs 0.." + std::to_string(shards - 1) + " of " + d + ", NCCL collectives"
                         : g + (shards == 1 ? " rank" : " ranks") + " on one GPU (device " + std::to_string(current) + " of " + d +
                               " visible), in-process collectives";
  return plan;
}

namespace {

// The collectives `plan` names for `shards` ranks (the in-process ones on `device`).
std::unique_ptr<Collectives> collectives_for(const CudaPlan& plan, int shards, int device) {
  if (plan.communication != Communication::nccl) return make_in_process_collectives(shards, device);
  std::vector<int> devices(static_cast<std::size_t>(shards));
  for (int g = 0; g < shards; ++g) devices[static_cast<std::size_t>(g)] = g;
  return make_nccl_collectives(devices);
}

struct RestoreDevice {  // the ranks switch devices; the caller gets its own back, whatever happens
  int device = 0;
  RestoreDevice() { SIMPO_CUDA_CHECK(cudaGetDevice(&device)); }
  ~RestoreDevice() { cudaSetDevice(device); }
};

}  // namespace

std::vector<double> time_ranks_cuda(const Problem& problem, const Options& options, int shards,
                                    Communication communication, int reps, std::string* schedule) {
  validate(problem, {.scan_values = options.validate});
  split_vocabulary(problem.shape.V, shards);
  const CudaPlan plan = plan_cuda(shards, communication);
  const RestoreDevice restore;
  const std::unique_ptr<Collectives> collectives = collectives_for(plan, shards, restore.device);
  Step step(problem, options, shards, *collectives);
  if (schedule) *schedule = step.schedule().to_string();
  step.run();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    step.run();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  return ms;
}

std::vector<RankOutputs> compute_ranks_cuda(const Problem& problem, const Options& options, int shards,
                                            Communication communication) {
  validate(problem, {.scan_values = options.validate});
  split_vocabulary(problem.shape.V, shards);  // the shard count's error before any device work
  const CudaPlan plan = plan_cuda(shards, communication);
  const RestoreDevice restore;
  const std::unique_ptr<Collectives> collectives = collectives_for(plan, shards, restore.device);
  std::vector<RankOutputs> out;
  {
    Step step(problem, options, shards, *collectives);
    out = step.compute();
  }  // the ranks' buffers and streams go before the communicator
  return out;
}

}  // namespace simpo::fused::vocab_parallel
