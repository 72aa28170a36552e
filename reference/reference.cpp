// The float64 reference: SPEC's function computed as directly as bounded memory allows.
//
// Idea: walk the pairs in blocks. For a block, compute its logits with one GEMM (OpenBLAS) per segment (chosen rows, then
// rejected rows), reduce each row to three numbers (log-sum-exp, token log-prob, sum of logits), and from those the
// pair's averages, preference term and the per-row factor k of SPEC. Then overwrite the logits with
// dz = k (onehot - softmax) and finish with two more GEMMs: grad_x = dz W and grad_W += dz^T x. A pair has to be
// complete before any of its gradients is known, so when a pair does not fit the chunk, its logits are computed
// twice (statistics pass, then gradient pass) instead of being kept.
//
// Nothing here shares code with the fused backends: an oracle that borrowed their math would inherit their bugs.
#include "reference/reference.h"

#include "reference/blas_products.h"
#include "reference/reference_core.h"
#include "reference/reproducible_math.h"

#include "problem/memory.h"

#ifdef SIMPO_REFERENCE_HAVE_CUDA
#include "reference/cuda/reference_cuda.h"
#endif

#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>

namespace simpo::reference {

namespace {

using RowMajorMatrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixView = Eigen::Map<RowMajorMatrix>;
using ConstMatrixView = Eigen::Map<const RowMajorMatrix>;

double libm_exp(double x) { return std::exp(x); }
double libm_log1p(double x) { return std::log1p(x); }
double libm_expm1(double x) { return std::expm1(x); }

// log sigmoid(s) = min(s, 0) - log1p(exp(-|s|)): the exponent is never positive, so nothing overflows, and log1p
// keeps the tiny values log sigmoid takes at large positive s.
double log_sigmoid(double s, const Elementary& f) { return std::min(s, 0.0) - f.log1p(f.exp(-std::abs(s))); }

// sigmoid(s) with a non-positive exponent on both branches.
double sigmoid(double s, const Elementary& f) {
  if (s >= 0) return 1.0 / (1.0 + f.exp(-s));
  const double e = f.exp(s);
  return e / (1.0 + e);
}

// Default chunk sizes (Options::chunk_rows = 0): one pair's logits are kept whole up to this size, so the
// published workload (one pair = 2 x 1024 rows x 128256 x 8 bytes = 2.1 GB) runs in three GEMMs...
constexpr std::int64_t whole_pair_bytes = std::int64_t{4} << 30;
// ...and a pair too large for that is walked in pieces of about this size.
constexpr std::int64_t piece_bytes = std::int64_t{256} << 20;

void check_size(const char* name, std::size_t have, std::int64_t want) {
  if (static_cast<std::int64_t>(have) != want)
    throw InputError(std::string("reference: ") + name + " holds " + std::to_string(have) + " values, the shape needs " +
                     std::to_string(want));
}

}  // namespace

Elementary elementary(const Options& options) {
  if (options.reproducible) return {reproducible::exp, reproducible::log1p, reproducible::expm1};
  return {libm_exp, libm_log1p, libm_expm1};
}

Schedule plan(const Shape& s, const Options& options) {
  const std::int64_t row_bytes = s.V * static_cast<std::int64_t>(sizeof(double));
  std::int64_t rows = options.chunk_rows;
  if (rows <= 0) {
    rows = std::max<std::int64_t>(1, piece_bytes / row_bytes);
    if (options.gradients && s.T <= whole_pair_bytes / (2 * row_bytes)) rows = std::max(rows, 2 * s.T);
  }
  if (rows >= 2 * s.T) {
    const std::int64_t pairs = std::min(s.P(), rows / (2 * s.T));
    return {true, pairs, pairs * s.T, 2 * pairs * s.T};
  }
  const std::int64_t piece = std::min(rows, s.T);
  return {false, 1, piece, piece};
}

std::vector<Piece> pieces_of_block(const Shape& s, const Schedule& schedule, std::int64_t first, std::int64_t pairs) {
  std::vector<Piece> pieces;
  const std::int64_t segment_rows = pairs * s.T;
  for (const std::int64_t segment_start : {first * s.T, (s.P() + first) * s.T}) {
    if (schedule.keep_logits) {
      pieces.push_back({segment_start, segment_rows, static_cast<std::int64_t>(pieces.size()) * segment_rows});
      continue;
    }
    for (std::int64_t r = 0; r < segment_rows; r += schedule.piece_rows)
      pieces.push_back({segment_start + r, std::min(schedule.piece_rows, segment_rows - r), 0});
  }
  return pieces;
}

PairTerms::PairTerms(const Shape& s, const Hyperparameters& hp, std::span<const std::int64_t> target,
                     const Options& options)
    : lse(s.N()), logprob(s.N(), 0.0), logit_sum(s.N()), k(s.N(), 0.0), shape_(s), hp_(hp), target_(target),
      f_(elementary(options)), tokens_(static_cast<std::size_t>(s.B), 0), average_(static_cast<std::size_t>(s.B), 0.0) {
  // What the targets alone decide: tokens per sequence n[b] and the NLL's 1/N_c (0 without an NLL term, and when
  // N_c = 0, which validation allows only with alpha = 0).
  for (std::int64_t row = 0; row < s.N(); ++row) tokens_[row / s.T] += completion(row);
  std::int64_t chosen_tokens = 0;
  for (std::int64_t b = 0; b < s.P(); ++b) chosen_tokens += tokens_[b];
  nll_weight_ = hp.compute_nll_loss && chosen_tokens > 0 ? 1.0 / static_cast<double>(chosen_tokens) : 0.0;
}

void PairTerms::close_pairs(std::int64_t first, std::int64_t pairs) {
  const std::int64_t T = shape_.T, P = shape_.P();
  const Hyperparameters& hp = hp_;
  for (std::int64_t i = first; i < first + pairs; ++i) {
    const std::int64_t chosen = i, rejected = P + i;
    for (const std::int64_t b : {chosen, rejected}) {
      double logprob_sum = 0;
      for (std::int64_t row = b * T; row < (b + 1) * T; ++row)
        if (completion(row)) logprob_sum += logprob[row];
      // n[b] = 0 reaches here only with empty_sequence = zero: the average is 0 and carries no gradient.
      average_[b] = tokens_[b] > 0 ? logprob_sum / static_cast<double>(tokens_[b]) : 0.0;
      if (b == chosen) chosen_logprob_sum_ += logprob_sum;
    }
    const double ls = hp.label_smoothing;
    const double margin = hp.beta * (average_[chosen] - average_[rejected]) - hp.gamma;  // s_i
    preference_sum_ += -(1 - ls) * log_sigmoid(margin, f_) - ls * log_sigmoid(-margin, f_);
    const double g = (-(1 - ls) * sigmoid(-margin, f_) + ls * sigmoid(margin, f_)) / static_cast<double>(P);
    // k = grad_scale m (dL/davg[b] / n[b] - [b < P] alpha / N_c), with dL/davg = +beta g (chosen), -beta g.
    const double k_chosen = tokens_[chosen] > 0
                                ? hp.grad_scale * (hp.beta * g / static_cast<double>(tokens_[chosen]) - hp.alpha * nll_weight_)
                                : 0.0;
    const double k_rejected =
        tokens_[rejected] > 0 ? hp.grad_scale * (-hp.beta * g / static_cast<double>(tokens_[rejected])) : 0.0;
    for (std::int64_t t = 0; t < T; ++t) {
      k[chosen * T + t] = completion(chosen * T + t) ? k_chosen : 0.0;
      k[rejected * T + t] = completion(rejected * T + t) ? k_rejected : 0.0;
    }
  }
}

ForwardOutputs PairTerms::finish() const {
  const std::int64_t T = shape_.T, V = shape_.V, P = shape_.P(), N = shape_.N();
  ForwardOutputs out;
  out.nll_loss = -chosen_logprob_sum_ * nll_weight_;
  out.loss = hp_.alpha * out.nll_loss + preference_sum_ / static_cast<double>(P);
  double chosen_logits = 0, rejected_logits = 0;
  for (std::int64_t row = 0; row < P * T; ++row) chosen_logits += logit_sum[row];
  for (std::int64_t row = P * T; row < N; ++row) rejected_logits += logit_sum[row];
  const double logits_per_side = static_cast<double>(P) * static_cast<double>(T) * static_cast<double>(V);
  out.chosen_logits_mean = chosen_logits / logits_per_side;
  out.rejected_logits_mean = rejected_logits / logits_per_side;
  out.chosen_logps.assign(average_.begin(), average_.begin() + P);
  out.rejected_logps.assign(average_.begin() + P, average_.end());
  return out;
}

std::vector<double> widen(const InputValues& input) {
  std::vector<double> out(input.size());
  input.visit([&out](const auto& values) {
    const auto n = static_cast<std::int64_t>(values.size());
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(static_cast<float>(values[i]));  // exact
  });
  return out;
}

ForwardOutputs compute_core(const DoubleInputs& in, const Options& options, GradientOutputs gradients) {
  if (!options.reproducible && resolve(options.device) == Device::cuda) {
#ifdef SIMPO_REFERENCE_HAVE_CUDA
    return cuda::compute_core(in, options, gradients);
#endif
  }
  const Shape& s = in.shape;
  const Hyperparameters& hp = in.hp;
  const std::int64_t H = s.H, V = s.V, P = s.P(), N = s.N();
  const bool has_bias = !in.bias.empty();
  check_size("x", in.x.size(), N * H);
  check_size("weight", in.weight.size(), V * H);
  if (has_bias) check_size("bias", in.bias.size(), V);
  check_size("target", in.target.size(), N);
  if (options.gradients) {
    check_size("grad_x", gradients.x.size(), N * H);
    check_size("grad_weight", gradients.weight.size(), V * H);
    check_size("grad_bias", gradients.bias.size(), has_bias ? V : 0);
  }

  const Elementary f = elementary(options);
  const ConstMatrixView x(in.x.data(), N, H);
  const ConstMatrixView weight(in.weight.data(), V, H);
  PairTerms terms(s, hp, in.target, options);
  std::vector<double>&lse = terms.lse, &logprob = terms.logprob, &logit_sum = terms.logit_sum, &k = terms.k;
  auto completion = [&](std::int64_t row) { return terms.completion(row); };

  const Schedule schedule = plan(s, options);
  RowMajorMatrix logits(schedule.buffer_rows, V);

  // Without gradients these views are empty and never touched.
  MatrixView grad_x(gradients.x.data(), options.gradients ? N : 0, H);
  MatrixView grad_weight(gradients.weight.data(), options.gradients ? V : 0, H);
  // The reproducible products add into grad_weight; the BLAS path overwrites it with its first piece instead.
  if (options.reproducible) grad_weight.setZero();
  bool grad_weight_written = false;
  std::fill(gradients.bias.begin(), gradients.bias.end(), 0.0);

  // Progress counts row-GEMMs: every row goes through the logits GEMM, with gradients two more, and a third when
  // its logits are recomputed.
  const double total_work = static_cast<double>(N) * (options.gradients ? (schedule.keep_logits ? 3 : 4) : 1);
  double work_done = 0;
  auto advance = [&](std::int64_t rows, int gemms) {
    work_done += static_cast<double>(rows) * gemms;
    if (options.progress) options.progress(std::min(1.0, work_done / total_work));
  };

  auto compute_logits = [&](const Piece& piece) {
    auto z = logits.middleRows(piece.slot, piece.rows);
    if (options.reproducible)
      reproducible::logits(x.data() + piece.row * H, weight.data(), z.data(), piece.rows, V, H);
    else
      blas::logits(x.data() + piece.row * H, weight.data(), z.data(), piece.rows, V, H);
    if (has_bias) {
      const Eigen::Map<const Eigen::RowVectorXd> bias(in.bias.data(), V);
#pragma omp parallel for schedule(static)
      for (std::int64_t r = 0; r < piece.rows; ++r) z.row(r) += bias;
    }
  };

  // lse = max + log1p(sum of exp(z - max) over every entry but the first maximum): exp never overflows whatever
  // the logits' size, and a token log-prob z_t - lse = (z_t - max) - log1p(others) keeps its digits when the
  // target dominates the row (then it is -others, tiny, where max - lse would round to 0).
  auto reduce_rows = [&](const Piece& piece) {
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < piece.rows; ++r) {
      const std::int64_t row = piece.row + r;
      const double* z = &logits(piece.slot + r, 0);
      std::int64_t argmax = 0;
      double sum_z = 0;
      for (std::int64_t v = 0; v < V; ++v) {
        if (z[v] > z[argmax]) argmax = v;
        sum_z += z[v];
      }
      const double max = z[argmax];
      double others = 0;
      for (std::int64_t v = 0; v < argmax; ++v) others += f.exp(z[v] - max);
      for (std::int64_t v = argmax + 1; v < V; ++v) others += f.exp(z[v] - max);
      const double log_sum = f.log1p(others);
      lse[row] = max + log_sum;
      logit_sum[row] = sum_z;
      if (completion(row)) logprob[row] = (z[in.target[row]] - max) - log_sum;
    }
  };

  // dz = k (onehot - softmax), in place. The target entry is k (1 - p) = -k expm1(l): exact even where p rounds
  // to 1 (large logits), where 1 - p would lose every digit. On the way, the off-target softmax's norm and maximum.
  OffTargetSoftmax* off_target = options.off_target;
  if (off_target) {
    off_target->norm.assign(static_cast<std::size_t>(N), 0.0);
    off_target->max.assign(static_cast<std::size_t>(N), 0.0);
  }
  auto logit_gradient = [&](const Piece& piece) {
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < piece.rows; ++r) {
      const std::int64_t row = piece.row + r;
      double* z = &logits(piece.slot + r, 0);
      const double kr = k[row];
      if (kr == 0) {  // ignored token, or a sequence with no gradient: its grad_x row is exactly zero
        std::fill(z, z + V, 0.0);
        continue;
      }
      const double lse_r = lse[row];
      const std::int64_t t = in.target[row];
      double off_sq = 0, off_max = 0;
      for (std::int64_t v = 0; v < V; ++v) {
        const double p = f.exp(z[v] - lse_r);
        if (v != t) off_sq += p * p, off_max = std::max(off_max, p);
        z[v] = -kr * p;
      }
      z[t] = -kr * f.expm1(logprob[row]);
      if (off_target) {
        off_target->norm[static_cast<std::size_t>(row)] = std::sqrt(off_sq);
        off_target->max[static_cast<std::size_t>(row)] = off_max;
      }
    }
  };

  auto accumulate_gradients = [&](const Piece& piece) {
    const auto dz = logits.middleRows(piece.slot, piece.rows);
    if (options.reproducible) {
      reproducible::grad_x(dz.data(), weight.data(), &grad_x(piece.row, 0), piece.rows, V, H);
      reproducible::accumulate_grad_weight(dz.data(), x.data() + piece.row * H, grad_weight.data(), piece.rows, V, H);
    } else {
      blas::grad_x(dz.data(), weight.data(), &grad_x(piece.row, 0), piece.rows, V, H);
      blas::accumulate_grad_weight(dz.data(), x.data() + piece.row * H, grad_weight.data(), piece.rows, V, H,
                                   !grad_weight_written);
      grad_weight_written = true;
    }
    if (has_bias) {
      // Column sums of a row-major block: each thread owns a band of columns and walks the rows in order.
      constexpr std::int64_t band = 4096;
      double* grad_bias = gradients.bias.data();
#pragma omp parallel for schedule(static)
      for (std::int64_t v0 = 0; v0 < V; v0 += band) {
        const std::int64_t v1 = std::min(V, v0 + band);
        for (std::int64_t r = 0; r < piece.rows; ++r) {
          const double* z = &logits(piece.slot + r, 0);
          for (std::int64_t v = v0; v < v1; ++v) grad_bias[v] += z[v];
        }
      }
    }
  };

  for (std::int64_t first = 0; first < P; first += schedule.pairs_per_block) {
    const std::int64_t pairs = std::min(schedule.pairs_per_block, P - first);
    const std::vector<Piece> pieces = pieces_of_block(s, schedule, first, pairs);
    for (const Piece& piece : pieces) {
      compute_logits(piece);
      reduce_rows(piece);
      advance(piece.rows, 1);
    }
    terms.close_pairs(first, pairs);

    if (!options.gradients) continue;
    for (const Piece& piece : pieces) {
      if (!schedule.keep_logits) {
        compute_logits(piece);
        advance(piece.rows, 1);
      }
      logit_gradient(piece);
      accumulate_gradients(piece);
      advance(piece.rows, 2);
    }
  }

  return terms.finish();
}

std::string device_name(Device d) {
  switch (d) {
    case Device::cpu: return "cpu";
    case Device::cuda: return "cuda";
    case Device::automatic: return "auto";
  }
  return "?";
}

Device device_from_name(const std::string& name) {
  if (name == "cpu") return Device::cpu;
  if (name == "cuda") return Device::cuda;
  if (name == "auto") return Device::automatic;
  throw InputError("reference \"" + name + "\": expected cpu, cuda or auto");
}

// Why reference-cuda cannot run here ("" when it can).
std::string cuda_unavailable_reason() {
#ifdef SIMPO_REFERENCE_HAVE_CUDA
  return cuda::unavailable_reason();
#else
  return "this build has no reference-cuda (no CUDA compiler was found when it was configured, or SIMPO_ENABLE_CUDA=OFF)";
#endif
}

bool cuda_available() { return cuda_unavailable_reason().empty(); }

namespace {
std::atomic<Device> default_device_setting{Device::cpu};
}
Device default_device() { return default_device_setting.load(); }
void set_default_device(Device d) { default_device_setting.store(d); }

Device resolve(Device d) {
  if (d == Device::automatic) return cuda_available() ? Device::cuda : Device::cpu;
  if (d == Device::cuda && !cuda_available()) throw InputError("reference cuda: " + cuda_unavailable_reason());
  return d;
}

int set_cpu_product_threads(int threads) { return blas::set_threads(threads); }

Device resolve(Device d, const Shape& s) {
  constexpr double gpu_worthwhile = double(std::int64_t{1} << 28);  // multiply-adds of the logits GEMM
  if (d == Device::automatic)
    return cuda_available() && double(s.N()) * double(s.V) * double(s.H) >= gpu_worthwhile ? Device::cuda : Device::cpu;
  return resolve(d);
}

std::int64_t required_bytes(const Shape& s, bool bias, const Options& options) {
  validate_shape(s);
  const std::int64_t values = s.N() * s.H + s.V * s.H + (bias ? s.V : 0);
  const std::int64_t f64 = static_cast<std::int64_t>(sizeof(double));
  // reference-cuda keeps the inputs and the logits on the device: the host holds the float64 gradients and a few
  // numbers per row.
  if (options.device == Device::cuda && !options.reproducible) return (options.gradients ? values * f64 : 0) + 7 * s.N() * f64;
  return values * f64 * (options.gradients ? 2 : 1) + plan(s, options).buffer_rows * s.V * f64 + 7 * s.N() * f64;
}

namespace {
// The forward outputs as SPEC names them; the rewards are beta times the log-probs.
void add_forward_outputs(TensorMap& out, const ForwardOutputs& f, const Problem& problem) {
  const Shape& s = problem.shape;
  auto per_pair = [&](const std::vector<double>& values, double scale) {
    std::vector<double> scaled(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) scaled[i] = scale * values[i];
    return Tensor::from<double>({s.P()}, scaled);
  };
  out[output_name::loss] = Tensor::scalar(f.loss);
  out[output_name::nll_loss] = Tensor::scalar(f.nll_loss);
  out[output_name::chosen_logits_mean] = Tensor::scalar(f.chosen_logits_mean);
  out[output_name::rejected_logits_mean] = Tensor::scalar(f.rejected_logits_mean);
  out[output_name::chosen_logps] = per_pair(f.chosen_logps, 1.0);
  out[output_name::rejected_logps] = per_pair(f.rejected_logps, 1.0);
  out[output_name::chosen_rewards] = per_pair(f.chosen_logps, problem.hp.beta);
  out[output_name::rejected_rewards] = per_pair(f.rejected_logps, problem.hp.beta);
}
}  // namespace

TensorMap compute(const Problem& problem, const Options& options) {
  validate(problem);
  Options resolved = options;
  resolved.device = options.reproducible ? Device::cpu : resolve(options.device, problem.shape);
  require_memory(required_bytes(problem.shape, problem.bias.has_value(), resolved),
                 "the float64 reference (" + device_name(resolved.device) + ") on " + problem.shape.to_string());
  const Shape& s = problem.shape;
  const bool on_cpu = resolved.device == Device::cpu;
  // reference-cuda widens the bf16 inputs on the device; widen() is exact for every input dtype.
  const std::vector<double> x = on_cpu ? widen(problem.x) : std::vector<double>{};
  const std::vector<double> weight = on_cpu ? widen(problem.weight) : std::vector<double>{};
  const std::vector<double> bias = on_cpu && problem.bias ? widen(*problem.bias) : std::vector<double>{};

  TensorMap out;
  GradientOutputs gradients;
  if (options.gradients) {
    // The gradients are written straight into the output tensors: grad_weight alone is V*H*8 bytes (4.2 GB for
    // the published workload), too much to copy, or even to zero first (every path overwrites each element: the
    // first grad_W product has beta = 0, every row's grad_x is one product, grad_bias is zeroed before it adds).
    auto make = [&](const char* name) -> std::span<double> {
      Tensor& t = out[name] = Tensor::uninitialized(DType::F64, output_shape(s, name));
      return t.as<double>();
    };
    gradients.x = make(output_name::grad_x);
    gradients.weight = make(output_name::grad_weight);
    if (problem.bias) gradients.bias = make(output_name::grad_bias);
  }

#ifdef SIMPO_REFERENCE_HAVE_CUDA
  const ForwardOutputs f = on_cpu ? compute_core({s, problem.hp, x, weight, bias, problem.target}, resolved, gradients)
                                  : cuda::compute_core(problem, resolved, gradients);
#else
  const ForwardOutputs f = compute_core({s, problem.hp, x, weight, bias, problem.target}, resolved, gradients);
#endif

  add_forward_outputs(out, f, problem);
  return out;
}

std::int64_t DeviceArray::numel() const {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;
  return n;
}

DeviceOutputs compute_on_device(const Problem& problem, const Options& options) {
  validate(problem);
  if (!cuda_available()) throw InputError("the float64 reference on the device: " + cuda_unavailable_reason());
  DeviceOutputs out;
#ifdef SIMPO_REFERENCE_HAVE_CUDA
  Options resolved = options;
  resolved.device = Device::cuda;
  resolved.reproducible = false;
  resolved.gradients = true;
  cuda::KeptGradients kept;
  const ForwardOutputs f = cuda::compute_core(problem, resolved, kept);
  add_forward_outputs(out.host, f, problem);
  const Shape& s = problem.shape;
  out.gradients[output_name::grad_x] = {kept.x, output_shape(s, output_name::grad_x), kept.device};
  out.gradients[output_name::grad_weight] = {kept.weight, output_shape(s, output_name::grad_weight), kept.device};
  if (problem.bias) out.gradients[output_name::grad_bias] = {kept.bias, output_shape(s, output_name::grad_bias), kept.device};
#else
  (void)options;
#endif
  return out;
}

}  // namespace simpo::reference
