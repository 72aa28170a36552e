// reference-cuda's host side: device buffers, the schedule (reference_core.h: the CPU reference's), the three
// products in cuBLAS DGEMM, the row kernels (kernels.h), and the per-pair terms on the host (PairTerms: the same
// code the CPU reference runs; they need a few numbers per row, copied back once per block).
//
// Row-major buffers in cuBLAS's column-major terms: a row-major [m, n] matrix is a column-major [n, m] one, so
//   logits  Z[rows, V]   = X W^T      is  Z^T = W^T' X^T  ->  gemm(T, N, V, rows, H, W, X)
//   grad_x  dX[rows, H]  = dZ W       is  dX^T = W^T dZ^T ->  gemm(N, N, H, rows, V, W, dZ)
//   grad_W  dW[V, H]    += dZ^T X     is  dW^T += X^T dZ  ->  gemm(N, T, H, V, rows, X, dZ), beta = 1
#include "reference/cuda/reference_cuda.h"

#include "reference/cuda/kernels.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <cstdio>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

namespace simpo::reference::cuda {

namespace {

constexpr std::int64_t f64 = sizeof(double);

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("reference cuda: ") + what + ": " + cudaGetErrorString(e));
}
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("reference cuda: ") + what + ": " + cublasGetStatusString(s));
}
// After a kernel launch: a bad configuration shows here, a fault at the next synchronization.
void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

std::string gib(std::int64_t bytes) {
  char text[64];
  std::snprintf(text, sizeof text, "%lld bytes (%.1f GiB)", static_cast<long long>(bytes), static_cast<double>(bytes) / (1 << 30));
  return text;
}

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::int64_t bytes) {
    if (bytes > 0) check(cudaMalloc(&p_, static_cast<std::size_t>(bytes)), ("cudaMalloc of " + gib(bytes)).c_str());
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  template <class T> T* as() const { return static_cast<T*>(p_); }
  // Ownership to a shared pointer that frees the memory with its last copy.
  std::shared_ptr<const double> share() {
    return std::shared_ptr<const double>(static_cast<const double*>(std::exchange(p_, nullptr)),
                                         [](const double* p) { cudaFree(const_cast<double*>(p)); });
  }

 private:
  void* p_ = nullptr;
};

// One stream and one cuBLAS handle per host thread, made on first use and kept (creating a handle costs
// milliseconds; the finite-difference tests call the reference thousands of times).
struct Context {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  // Two pinned staging buffers for large downloads (download()), made on the first one: a sweep's threads judge
  // small cases and never need them.
  static constexpr std::size_t staging_bytes = std::size_t{64} << 20;
  void* staging[2] = {nullptr, nullptr};
  cudaEvent_t staged[2] = {nullptr, nullptr};
};
Context& context() {
  thread_local Context c = [] {
    Context made;
    check(cudaStreamCreateWithFlags(&made.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cublasCreate(&made.blas), "cublasCreate");
    check(cublasSetStream(made.blas, made.stream), "cublasSetStream");
    // Plain IEEE float64 (the H100/H200's DMMA units are IEEE double FMAs); never cuBLAS's emulated FP64.
    check(cublasSetMathMode(made.blas, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    return made;
  }();
  return c;
}

// Device to host at the link's speed. A cudaMemcpy into pageable memory runs through the driver's own staging
// on one core, and the destination's first touch (a fresh 4.2 GB grad_weight) costs page faults on top: 2-3 s for
// the published workload. Here the device fills one pinned buffer while every core copies the other into place.
void download(void* host, const void* device, std::size_t bytes, Context& c) {
  const std::size_t chunk = Context::staging_bytes;
  if (bytes <= chunk / 2) {  // small: one plain copy
    check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, c.stream), "gradients to the host");
    check(cudaStreamSynchronize(c.stream), "gradients to the host");
    return;
  }
  if (!c.staging[0])
    for (int i = 0; i < 2; ++i) {
      check(cudaMallocHost(&c.staging[i], chunk), "cudaMallocHost (staging)");
      check(cudaEventCreateWithFlags(&c.staged[i], cudaEventDisableTiming), "cudaEventCreate");
    }
  const std::size_t chunks = (bytes + chunk - 1) / chunk;
  auto enqueue = [&](std::size_t i) {
    const std::size_t n = std::min(chunk, bytes - i * chunk);
    check(cudaMemcpyAsync(c.staging[i % 2], static_cast<const char*>(device) + i * chunk, n, cudaMemcpyDeviceToHost, c.stream),
          "gradients to the host");
    check(cudaEventRecord(c.staged[i % 2], c.stream), "cudaEventRecord");
  };
  if (chunks > 0) enqueue(0);
  for (std::size_t i = 0; i < chunks; ++i) {
    if (i + 1 < chunks) enqueue(i + 1);  // its buffer was emptied by the copy of chunk i - 1, just finished
    check(cudaEventSynchronize(c.staged[i % 2]), "gradients to the host");
    const auto n = static_cast<std::int64_t>(std::min(chunk, bytes - i * chunk));
    char* to = static_cast<char*>(host) + i * chunk;
    const char* from = static_cast<const char*>(c.staging[i % 2]);
    constexpr std::int64_t piece = std::int64_t{1} << 20;
#pragma omp parallel for schedule(static)
    for (std::int64_t p = 0; p < n; p += piece)
      std::memcpy(to + p, from + p, static_cast<std::size_t>(std::min(piece, n - p)));
  }
}

int dimension(std::int64_t n, const char* name) {
  if (n > INT_MAX) throw InputError(std::string("reference cuda: ") + name + " = " + std::to_string(n) + " exceeds cuBLAS's 32-bit dimensions");
  return static_cast<int>(n);
}

void gemm(cublasOperation_t a_op, cublasOperation_t b_op, std::int64_t m, std::int64_t n, std::int64_t k, const double* a,
          std::int64_t lda, const double* b, std::int64_t ldb, double beta, double* c, std::int64_t ldc) {
  const double one = 1.0;
  check(cublasDgemm(context().blas, a_op, b_op, dimension(m, "m"), dimension(n, "n"), dimension(k, "k"), &one, a,
                    dimension(lda, "lda"), b, dimension(ldb, "ldb"), &beta, c, dimension(ldc, "ldc")),
        "cublasDgemm");
}

void check_size(const char* name, std::size_t have, std::int64_t want) {
  if (static_cast<std::int64_t>(have) != want)
    throw InputError(std::string("reference cuda: ") + name + " holds " + std::to_string(have) +
                     " values, the shape needs " + std::to_string(want));
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

struct DeviceInputs {
  DeviceBuffer x, weight, bias, target;  // double, double, double (or none), int64
};

// Fills the device inputs (allocated by the caller) on the stream.
using Upload = std::function<void(DeviceInputs&, cudaStream_t)>;

// keep: the gradients stay on the device, handed over there instead of downloaded into `gradients`.
ForwardOutputs run(const Shape& s, const Hyperparameters& hp, std::span<const std::int64_t> target, bool has_bias,
                   const Options& options, GradientOutputs gradients, Timings* timings, const Upload& upload,
                   KeptGradients* keep = nullptr) {
  const std::int64_t H = s.H, V = s.V, P = s.P(), N = s.N();
  check_size("target", target.size(), N);
  if (keep && !options.gradients) throw std::logic_error("reference cuda: gradients kept on the device need Options::gradients");
  if (options.gradients && !keep) {
    check_size("grad_x", gradients.x.size(), N * H);
    check_size("grad_weight", gradients.weight.size(), V * H);
    check_size("grad_bias", gradients.bias.size(), has_bias ? V : 0);
  }
  if (!unavailable_reason().empty()) throw InputError("reference cuda: " + unavailable_reason());
  const std::int64_t needed = required_device_bytes(s, has_bias, options);
  std::size_t free_bytes = 0, total_bytes = 0;
  check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  if (needed > static_cast<std::int64_t>(free_bytes))
    throw InputError("reference cuda on " + s.to_string() + " needs " + gib(needed) + " of device memory; only " +
                     gib(static_cast<std::int64_t>(free_bytes)) + " are free on " + device_description());

  Context& c = context();
  Timings local;
  Timings& time = timings ? *timings : local;
  auto clock = std::chrono::steady_clock::now();

  DeviceInputs in;
  in.x = DeviceBuffer(N * H * f64);
  in.weight = DeviceBuffer(V * H * f64);
  if (has_bias) in.bias = DeviceBuffer(V * f64);
  in.target = DeviceBuffer(N * static_cast<std::int64_t>(sizeof(std::int64_t)));
  check(cudaMemcpyAsync(in.target.as<void>(), target.data(), target.size_bytes(), cudaMemcpyHostToDevice, c.stream), "target to the device");
  upload(in, c.stream);

  const Schedule schedule = plan(s, options);
  DeviceBuffer logits(schedule.buffer_rows * V * f64);
  DeviceBuffer lse(N * f64), logprob(N * f64), logit_sum(N * f64), k(N * f64);
  OffTargetSoftmax* off_target = options.gradients ? options.off_target : nullptr;
  DeviceBuffer off_norm(off_target ? N * f64 : 0), off_max(off_target ? N * f64 : 0);
  DeviceBuffer grad_x, grad_weight, grad_bias;
  if (options.gradients) {
    grad_x = DeviceBuffer(N * H * f64);
    grad_weight = DeviceBuffer(V * H * f64);
    check(cudaMemsetAsync(grad_weight.as<void>(), 0, static_cast<std::size_t>(V * H * f64), c.stream), "cudaMemset");
    if (has_bias) {
      grad_bias = DeviceBuffer(V * f64);
      check(cudaMemsetAsync(grad_bias.as<void>(), 0, static_cast<std::size_t>(V * f64), c.stream), "cudaMemset");
    }
  }
  check(cudaStreamSynchronize(c.stream), "upload");
  time.upload = seconds_since(clock);
  clock = std::chrono::steady_clock::now();

  const double* x = in.x.as<double>();
  const double* weight = in.weight.as<double>();
  const std::int64_t* device_target = in.target.as<std::int64_t>();
  double* z = logits.as<double>();
  auto compute_logits = [&](const Piece& piece) {
    double* zp = z + piece.slot * V;
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, V, piece.rows, H, weight, H, x + piece.row * H, H, 0.0, zp, V);
    if (has_bias) {
      kernels::add_bias(zp, piece.rows, V, in.bias.as<double>(), c.stream);
      check_launch("add_bias");
    }
  };

  // Progress counts row-GEMMs as the CPU reference does, reported where the host has waited for the device (so
  // the work reported is done).
  const double total_work = static_cast<double>(N) * (options.gradients ? (schedule.keep_logits ? 3 : 4) : 1);
  double work_enqueued = 0;
  auto report = [&] {
    if (options.progress) options.progress(std::min(1.0, work_enqueued / total_work));
  };

  PairTerms terms(s, hp, target, options);
  for (std::int64_t first = 0; first < P; first += schedule.pairs_per_block) {
    const std::int64_t pairs = std::min(schedule.pairs_per_block, P - first);
    const std::vector<Piece> pieces = pieces_of_block(s, schedule, first, pairs);
    for (const Piece& piece : pieces) {
      compute_logits(piece);
      kernels::row_statistics(z + piece.slot * V, piece.rows, V, device_target, hp.ignore_index, piece.row, lse.as<double>(),
                              logprob.as<double>(), logit_sum.as<double>(), c.stream);
      check_launch("row_statistics");
      work_enqueued += static_cast<double>(piece.rows);
    }
    // The block's rows are two segments (chosen, rejected); their log-probs and logit sums to the host.
    const std::int64_t segment_rows = pairs * s.T;
    for (const std::int64_t start : {first * s.T, (P + first) * s.T}) {
      const std::size_t bytes = static_cast<std::size_t>(segment_rows * f64);
      check(cudaMemcpyAsync(&terms.logprob[start], logprob.as<double>() + start, bytes, cudaMemcpyDeviceToHost, c.stream), "log-probs to the host");
      check(cudaMemcpyAsync(&terms.logit_sum[start], logit_sum.as<double>() + start, bytes, cudaMemcpyDeviceToHost, c.stream), "logit sums to the host");
    }
    check(cudaStreamSynchronize(c.stream), "block statistics");
    report();
    terms.close_pairs(first, pairs);
    if (!options.gradients) continue;

    for (const std::int64_t start : {first * s.T, (P + first) * s.T})
      check(cudaMemcpyAsync(k.as<double>() + start, &terms.k[start], static_cast<std::size_t>(segment_rows * f64),
                            cudaMemcpyHostToDevice, c.stream), "k to the device");
    for (const Piece& piece : pieces) {
      if (!schedule.keep_logits) {
        compute_logits(piece);
        work_enqueued += static_cast<double>(piece.rows);
      }
      double* dz = z + piece.slot * V;
      if (off_target) {
        kernels::off_target_softmax(dz, piece.rows, V, device_target, piece.row, lse.as<double>(), k.as<double>(),
                                    off_norm.as<double>(), off_max.as<double>(), c.stream);
        check_launch("off_target_softmax");
      }
      kernels::logit_gradient(dz, piece.rows, V, device_target, piece.row, lse.as<double>(), logprob.as<double>(), k.as<double>(),
                              c.stream);
      check_launch("logit_gradient");
      gemm(CUBLAS_OP_N, CUBLAS_OP_N, H, piece.rows, V, weight, H, dz, V, 0.0, grad_x.as<double>() + piece.row * H, H);
      gemm(CUBLAS_OP_N, CUBLAS_OP_T, H, V, piece.rows, x + piece.row * H, H, dz, V, 1.0, grad_weight.as<double>(), H);
      if (has_bias) {
        kernels::accumulate_bias_gradient(dz, piece.rows, V, grad_bias.as<double>(), c.stream);
        check_launch("accumulate_bias_gradient");
      }
      work_enqueued += 2.0 * static_cast<double>(piece.rows);
    }
  }
  check(cudaStreamSynchronize(c.stream), "the reference's blocks");
  report();
  time.compute = seconds_since(clock);
  clock = std::chrono::steady_clock::now();

  if (keep) {
    check(cudaGetDevice(&keep->device), "cudaGetDevice");
    keep->x = grad_x.share();
    keep->weight = grad_weight.share();
    if (has_bias) keep->bias = grad_bias.share();
  } else if (options.gradients) {
    download(gradients.x.data(), grad_x.as<void>(), gradients.x.size_bytes(), c);
    download(gradients.weight.data(), grad_weight.as<void>(), gradients.weight.size_bytes(), c);
    if (has_bias) download(gradients.bias.data(), grad_bias.as<void>(), gradients.bias.size_bytes(), c);
  }
  if (options.gradients) {
    if (off_target) {
      off_target->norm.resize(static_cast<std::size_t>(N));
      off_target->max.resize(static_cast<std::size_t>(N));
      check(cudaMemcpyAsync(off_target->norm.data(), off_norm.as<void>(), static_cast<std::size_t>(N * f64), cudaMemcpyDeviceToHost, c.stream),
            "off-target softmax to the host");
      check(cudaMemcpyAsync(off_target->max.data(), off_max.as<void>(), static_cast<std::size_t>(N * f64), cudaMemcpyDeviceToHost, c.stream),
            "off-target softmax to the host");
    }
    check(cudaStreamSynchronize(c.stream), "gradients to the host");
  }
  time.download = seconds_since(clock);
  return terms.finish();
}

}  // namespace

const std::string& unavailable_reason() {
  static const std::string reason = [] {
    int devices = 0;
    const cudaError_t e = cudaGetDeviceCount(&devices);
    if (e != cudaSuccess) return std::string("no CUDA device usable here (") + cudaGetErrorString(e) + ")";
    if (devices == 0) return std::string("no CUDA device here");
    return std::string();
  }();
  return reason;
}

std::string device_description() {
  if (!unavailable_reason().empty()) return unavailable_reason();
  int device = 0;
  cudaDeviceProp p{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&p, device) != cudaSuccess) return "a CUDA device";
  int version = 0;
  cublasGetVersion(context().blas, &version);
  char memory[64];
  std::snprintf(memory, sizeof memory, "%.1f GiB", static_cast<double>(p.totalGlobalMem) / (1 << 30));
  return std::string(p.name) + " (" + memory + ", cuBLAS " + std::to_string(version / 10000) + "." +
         std::to_string(version / 100 % 100) + "." + std::to_string(version % 100) + ")";
}

std::int64_t required_device_bytes(const Shape& s, bool bias, const Options& options) {
  validate_shape(s);
  const std::int64_t inputs = (s.N() * s.H + s.V * s.H + (bias ? s.V : 0)) * f64 + s.N() * f64;  // + target
  const std::int64_t rows = 6 * s.N() * f64 + plan(s, options).buffer_rows * s.V * f64;
  const std::int64_t grads = options.gradients ? (s.N() * s.H + s.V * s.H + (bias ? s.V : 0)) * f64 : 0;
  const std::int64_t staging = std::max(s.N() * s.H, s.V * s.H) * 2;  // one bf16 input at a time, while widened
  return inputs + std::max(staging, rows + grads);
}

ForwardOutputs compute_core(const DoubleInputs& in, const Options& options, GradientOutputs gradients, Timings* timings) {
  const Shape& s = in.shape;
  check_size("x", in.x.size(), s.N() * s.H);
  check_size("weight", in.weight.size(), s.V * s.H);
  const bool has_bias = !in.bias.empty();
  if (has_bias) check_size("bias", in.bias.size(), s.V);
  return run(s, in.hp, in.target, has_bias, options, gradients, timings, [&](DeviceInputs& d, cudaStream_t stream) {
    check(cudaMemcpyAsync(d.x.as<void>(), in.x.data(), in.x.size_bytes(), cudaMemcpyHostToDevice, stream), "x to the device");
    check(cudaMemcpyAsync(d.weight.as<void>(), in.weight.data(), in.weight.size_bytes(), cudaMemcpyHostToDevice, stream), "weight to the device");
    if (has_bias)
      check(cudaMemcpyAsync(d.bias.as<void>(), in.bias.data(), in.bias.size_bytes(), cudaMemcpyHostToDevice, stream), "bias to the device");
  });
}

namespace {
ForwardOutputs run_bf16(const Problem& problem, const Options& options, GradientOutputs gradients, Timings* timings,
                        KeptGradients* keep) {
  const Shape& s = problem.shape;
  check_size("x", problem.x.size(), s.N() * s.H);
  check_size("weight", problem.weight.size(), s.V * s.H);
  if (problem.bias) check_size("bias", problem.bias->size(), s.V);
  return run(s, problem.hp, problem.target, problem.has_bias(), options, gradients, timings, [&](DeviceInputs& d, cudaStream_t stream) {
    // bf16 to the device (a quarter of the bytes of doubles), widened there; one staging buffer, freed before the
    // logits and gradients are allocated. f16 and f32 inputs are widened on the host (widen() is exact for every
    // input dtype) and copied as doubles.
    const bool bf16_inputs = problem.input_dtype() == DType::BF16;
    DeviceBuffer staging(bf16_inputs ? std::max(s.N() * s.H, s.V * s.H) * 2 : 0);
    auto widen_one = [&](const InputValues& values, const DeviceBuffer& out, const char* what) {
      if (!bf16_inputs) {
        const std::vector<double> wide = widen(values);
        check(cudaMemcpy(out.as<void>(), wide.data(), wide.size() * sizeof(double), cudaMemcpyHostToDevice), what);
        return;
      }
      const std::vector<bf16>& narrow = values.as<bf16>();
      check(cudaMemcpyAsync(staging.as<void>(), narrow.data(), narrow.size() * sizeof(bf16), cudaMemcpyHostToDevice, stream), what);
      kernels::widen_bf16(staging.as<std::uint16_t>(), out.as<double>(), static_cast<std::int64_t>(narrow.size()), stream);
      check_launch("widen_bf16");
    };
    widen_one(problem.x, d.x, "x to the device");
    widen_one(problem.weight, d.weight, "weight to the device");
    if (problem.bias) widen_one(*problem.bias, d.bias, "bias to the device");
    check(cudaStreamSynchronize(stream), "widening the inputs");  // the staging buffer goes next
  }, keep);
}
}  // namespace

ForwardOutputs compute_core(const Problem& problem, const Options& options, GradientOutputs gradients, Timings* timings) {
  return run_bf16(problem, options, gradients, timings, nullptr);
}

ForwardOutputs compute_core(const Problem& problem, const Options& options, KeptGradients& keep, Timings* timings) {
  return run_bf16(problem, options, {}, timings, &keep);
}

}  // namespace simpo::reference::cuda
