// The bf16_logits profile's per-row pass on the device (device_logit_rows.h). Per chunk of m token rows:
//   Z = X W^T                         (DGEMM; float64 logits, the bias added in the row kernel)
//   row kernel: max and its index m, |z| and z^2 sums, lse, the log-prob error terms and B; with gradients it
//               leaves P = softmax with p_m - 1 at m (0 on rows with no target) and overwrites Z with (p_v z_v)^2
//   G = P W = g - w_m                 (DGEMM), then ||g - w_m||^2 kept and w_m added back
//   WG = G W^T                        (DGEMM, over P's buffer)
//   C kernel:   C^2 = sum_v (p_v z_v)^2 ||w_v - g||^2, ||w_v - g||^2 = ||w_v||^2 - 2 w_v.g + ||g||^2 (the peak's kept)
// The formulas are the host pass's (logit_rows.cpp), line for line, in float64 as there: the two differ by the
// order of their sums.
#include "verifier/device_logit_rows.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace simpo::verifier::device {

namespace {

constexpr int row_threads = 512;
constexpr double u = 0x1.0p-8;  // bf16's unit roundoff: each logit's relative rounding is at most u

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("bf16_logits scales on the device: ") + what + ": " + cudaGetErrorString(e));
}
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("bf16_logits scales on the device: ") + what + ": cuBLAS status " + std::to_string(static_cast<int>(s)));
}

// Owns a device allocation (plain cudaMalloc: the pass synchronizes once per chunk anyway).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t bytes) { check(cudaMalloc(&p_, std::max<std::size_t>(bytes, 1)), "cudaMalloc"); }
  ~Buffer() {
    if (p_) cudaFree(p_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <class T> T* as() const { return static_cast<T*>(p_); }

 private:
  void* p_ = nullptr;
};

class Handle {
 public:
  Handle() { check(cublasCreate(&h_), "cublasCreate"); }
  ~Handle() { cublasDestroy(h_); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

__global__ void widen_kernel(const void* in, int element_bytes, bool f16, double* out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if (element_bytes == 4)
      out[i] = static_cast<double>(static_cast<const float*>(in)[i]);
    else if (f16)
      out[i] = static_cast<double>(__half2float(static_cast<const __half*>(in)[i]));
    else
      out[i] = static_cast<double>(__bfloat162float(static_cast<const __nv_bfloat16*>(in)[i]));
  }
}

// Block-wide sum and max of one double per thread; every thread gets the result.
__device__ double block_sum(double v) {
  __shared__ double partial[row_threads / 32];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // partial[] may still be read by the previous reduction
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  double s = 0;
  for (int w = 0; w < row_threads / 32; ++w) s += partial[w];
  return s;
}
__device__ double block_max(double v) {
  __shared__ double partial[row_threads / 32];
  for (int o = 16; o > 0; o /= 2) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  double s = partial[0];
  for (int w = 1; w < row_threads / 32; ++w) s = fmax(s, partial[w]);
  return s;
}

// The block's largest value and its first index (the host's strict > scan keeps the first); every thread gets both.
__device__ void block_argmax(double& value, std::int64_t& index) {
  __shared__ double values[row_threads / 32];
  __shared__ std::int64_t indices[row_threads / 32];
  for (int o = 16; o > 0; o /= 2) {
    const double v = __shfl_xor_sync(0xffffffffu, value, o);
    const std::int64_t j = __shfl_xor_sync(0xffffffffu, index, o);
    if (v > value || (v == value && j < index)) {
      value = v;
      index = j;
    }
  }
  __syncthreads();
  if (threadIdx.x % 32 == 0) {
    values[threadIdx.x / 32] = value;
    indices[threadIdx.x / 32] = index;
  }
  __syncthreads();
  value = values[0];
  index = indices[0];
  for (int w = 1; w < row_threads / 32; ++w)
    if (values[w] > value || (values[w] == value && indices[w] < index)) {
      value = values[w];
      index = indices[w];
    }
}

// One block per row of the chunk. z: the row's float64 logits without bias (with gradients overwritten by
// (p_v z_v)^2); probs: the softmax with its peak's entry p_m - 1 (so that P W = g - w_m, small where p_m ~ 1,
// without cancelling), or null without gradients. nonlinear[i] keeps the row's expm1(D) / D for C, peak[i] m
// (-1 on a row with no target).
__global__ void __launch_bounds__(row_threads) row_kernel(double* z, double* probs, const double* bias,
                                                          const std::int64_t* target, std::int64_t V,
                                                          std::int64_t ignore_index, LogitRow* out, double* nonlinear,
                                                          std::int64_t* peak) {
  const std::int64_t i = blockIdx.x;
  double* zr = z + i * V;
  double* pr = probs ? probs + i * V : nullptr;
  auto logit = [&](std::int64_t v) { return zr[v] + (bias ? bias[v] : 0.0); };
  double zmax = -INFINITY, zabs_max = 0, abs_sum = 0, sq_sum = 0;
  std::int64_t argmax = V;
  for (std::int64_t v = threadIdx.x; v < V; v += row_threads) {
    const double zv = logit(v);
    if (zv > zmax) {
      zmax = zv;
      argmax = v;
    }
    zabs_max = fmax(zabs_max, fabs(zv));
    abs_sum += fabs(zv);
    sq_sum += zv * zv;
  }
  block_argmax(zmax, argmax);
  zabs_max = block_max(zabs_max);
  abs_sum = block_sum(abs_sum);
  sq_sum = block_sum(sq_sum);
  const std::int64_t t = target[i];
  LogitRow row;
  row.abs_sum = abs_sum;
  row.sq_sum = sq_sum;
  if (t == ignore_index || t < 0 || t >= V) {  // no target: no log-prob, and no softmax for C
    if (pr)
      for (std::int64_t v = threadIdx.x; v < V; v += row_threads) pr[v] = zr[v] = 0.0;
    if (threadIdx.x == 0) {
      out[i] = row;
      nonlinear[i] = 1.0;
      peak[i] = -1;
    }
    return;
  }
  const double zt = logit(t);  // read before the pass below overwrites z
  double sum = 0;
  for (std::int64_t v = threadIdx.x; v < V; v += row_threads) sum += exp(logit(v) - zmax);
  const double lse = zmax + log(block_sum(sum));
  // B^2 as the host pass splits it (logit_rows.cpp): the peak m's terms apart, so that a peaked row does not cancel.
  double a_sq = 0, a_off = 0, p_off = 0, own = 0, own4_off = 0, off_abs = 0, off_sq = 0;
  for (std::int64_t v = threadIdx.x; v < V; v += row_threads) {
    const double zv = logit(v), pv = exp(zv - lse), q = pv * pv * zv * zv;
    const double gap = v == argmax ? -expm1(zv - lse) : 1 - pv;
    a_sq += q;
    own += q * gap * gap;
    if (v != argmax) {
      a_off += q;
      p_off += pv * pv;
      own4_off += q * pv * pv;
    }
    if (pr) {
      pr[v] = v == argmax ? expm1(zv - lse) : pv;
      zr[v] = q;
    }
    if (v != t) {
      off_abs += pv * fabs(zv);
      off_sq += q;
    }
  }
  a_sq = block_sum(a_sq);
  a_off = block_sum(a_off);
  p_off = block_sum(p_off);
  own = block_sum(own);
  own4_off = block_sum(own4_off);
  off_abs = block_sum(off_abs);
  off_sq = block_sum(off_sq);
  if (threadIdx.x != 0) return;
  const double gt = -expm1(zt - lse), p_peak = exp(zmax - lse);  // 1 - p_t; p_m
  row.target_gap = gt;
  const double D = 2 * u * zabs_max;
  const double nl = D > 0 ? expm1(D) / D : 1.0;
  const double sigma_sq = u * u / 3;
  row.worst_l = nl * u * (fabs(zt) * gt + off_abs);
  row.var_l = nl * nl * sigma_sq * (zt * zt * gt * gt + off_sq);
  row.b_row = nl * sqrt(fmax(0.0, own + p_off * a_sq - own4_off + p_peak * p_peak * a_off));
  out[i] = row;
  nonlinear[i] = nl;
  peak[i] = argmax;
}

// g = (g - w_m) + w_m in place, after keeping ||g - w_m||^2 (the peak's ||w_m - g||^2, free of cancellation).
__global__ void __launch_bounds__(row_threads) peak_kernel(double* g, const double* w, std::int64_t H,
                                                           const std::int64_t* peak, double* d_sq) {
  const std::int64_t i = blockIdx.x;
  double* gr = g + i * H;
  double s = 0;
  for (std::int64_t h = threadIdx.x; h < H; h += row_threads) s += gr[h] * gr[h];
  s = block_sum(s);
  if (threadIdx.x == 0) d_sq[i] = s;
  if (peak[i] < 0) return;
  const double* wm = w + peak[i] * H;
  for (std::int64_t h = threadIdx.x; h < H; h += row_threads) gr[h] += wm[h];
}

// ||w_v||^2 per vocabulary row.
__global__ void __launch_bounds__(row_threads) row_norms_kernel(const double* w, std::int64_t H, double* w_sq) {
  const double* wr = w + blockIdx.x * H;
  double s = 0;
  for (std::int64_t h = threadIdx.x; h < H; h += row_threads) s += wr[h] * wr[h];
  s = block_sum(s);
  if (threadIdx.x == 0) w_sq[blockIdx.x] = s;
}

// C of each row: pz_sq = (p_v z_v)^2, wg = w_v . g, g = the row of G. The rms sigma C is the estimate where many
// roundings share the row; where one token carries it the row keeps sqrt(3) times that token's term (README).
__global__ void __launch_bounds__(row_threads) c_kernel(const double* pz_sq, const double* wg, const double* g,
                                                        const double* w_sq, std::int64_t V, std::int64_t H,
                                                        const double* nonlinear, const std::int64_t* peak,
                                                        const double* d_sq, LogitRow* out) {
  const std::int64_t i = blockIdx.x;
  double g_sq = 0;
  for (std::int64_t h = threadIdx.x; h < H; h += row_threads) g_sq += g[i * H + h] * g[i * H + h];
  g_sq = block_sum(g_sq);
  double c_sq = 0, c_max = 0;
  for (std::int64_t v = threadIdx.x; v < V; v += row_threads) {
    const double q = pz_sq[i * V + v];
    if (q > 0) {
      const double gap = v == peak[i] ? d_sq[i] : fmax(0.0, w_sq[v] - 2 * wg[i * V + v] + g_sq);
      const double term = q * gap;
      c_sq += term;
      c_max = fmax(c_max, term);
    }
  }
  c_sq = block_sum(c_sq);
  c_max = block_max(c_max);
  if (threadIdx.x == 0) out[i].c_row = nonlinear[i] * fmax(sqrt(c_sq), sqrt(3.0) * sqrt(c_max));
}

int blocks_for(std::int64_t n) { return static_cast<int>(std::min<std::int64_t>((n + 255) / 256, 4096)); }

int dimension(std::int64_t n) {
  if (n > 0x7fffffff) throw std::runtime_error("bf16_logits scales on the device: a dimension beyond cuBLAS's int");
  return static_cast<int>(n);
}

// Row-major C[m, n] = A[m, k] B[n, k]^T (column-major: C^T = B A^T).
void gemm_abt(cublasHandle_t h, std::int64_t m, std::int64_t n, std::int64_t k, const double* a, const double* b, double* c) {
  const double one = 1.0, zero = 0.0;
  check(cublasDgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, dimension(n), dimension(m), dimension(k), &one, b, dimension(k), a,
                    dimension(k), &zero, c, dimension(n)),
        "cublasDgemm (A B^T)");
}
// Row-major C[m, n] = A[m, k] B[k, n] (column-major: C^T = B^T A^T).
void gemm_ab(cublasHandle_t h, std::int64_t m, std::int64_t n, std::int64_t k, const double* a, const double* b, double* c) {
  const double one = 1.0, zero = 0.0;
  check(cublasDgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, dimension(n), dimension(m), dimension(k), &one, b, dimension(n), a,
                    dimension(k), &zero, c, dimension(n)),
        "cublasDgemm (A B)");
}

// Uploads n elements and widens them to float64 in `out`, through `staging` (at least n * element_bytes).
void widen(const LogitRowsInput& in, const void* host, std::int64_t n, void* staging, double* out) {
  const std::size_t bytes = static_cast<std::size_t>(n) * static_cast<std::size_t>(in.element_bytes);
  check(cudaMemcpy(staging, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy (inputs)");
  widen_kernel<<<blocks_for(n), 256>>>(staging, in.element_bytes, in.f16, out, n);
  check(cudaGetLastError(), "widen_kernel");
}

}  // namespace

bool logit_rows(const LogitRowsInput& in, LogitRow* out) {
  if (in.N <= 0) return true;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || in.device >= count) {
    cudaGetLastError();  // no driver or no such device: the host pass runs instead
    return false;
  }
  int previous = 0;
  check(cudaGetDevice(&previous), "cudaGetDevice");
  check(cudaSetDevice(in.device), "cudaSetDevice");
  struct Restore {
    int device;
    ~Restore() { cudaSetDevice(device); }
  } restore{previous};

  const std::int64_t N = in.N, H = in.H, V = in.V;
  const std::size_t d = sizeof(double);
  // Resident: W and X in float64, ||w_v||^2, the bias, the inputs' staging; per chunk row: Z and P (V each), X and G (H each), the row outputs.
  const std::size_t fixed = (static_cast<std::size_t>(V * H) + static_cast<std::size_t>(N * H) + 2 * static_cast<std::size_t>(V)) * d +
                            static_cast<std::size_t>(std::max(V * H, N * H)) * static_cast<std::size_t>(in.element_bytes);
  const std::size_t per_row = (2 * static_cast<std::size_t>(V) + 2 * static_cast<std::size_t>(H) + 1) * d + sizeof(LogitRow) + 8;
  std::size_t free_bytes = 0, total_bytes = 0;
  check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  // Half the free memory at most (others may share the device), and chunks of at most 2 GiB of row buffers.
  const std::size_t usable = free_bytes / 2;
  if (usable < fixed + per_row) return false;
  const std::int64_t m = std::min<std::int64_t>(
      N, static_cast<std::int64_t>(std::min<std::size_t>((usable - fixed) / per_row, (std::size_t{2} << 30) / per_row)));
  if (m < 1) return false;

  Buffer staging(static_cast<std::size_t>(std::max(V * H, N * H)) * static_cast<std::size_t>(in.element_bytes));
  Buffer w(static_cast<std::size_t>(V * H) * d), w_sq(static_cast<std::size_t>(V) * d);
  Buffer bias(in.bias ? static_cast<std::size_t>(V) * d : 0);
  widen(in, in.weight, V * H, staging.as<void>(), w.as<double>());
  if (in.bias) widen(in, in.bias, V, staging.as<void>(), bias.as<double>());
  if (in.gradients) {
    row_norms_kernel<<<dimension(V), row_threads>>>(w.as<double>(), H, w_sq.as<double>());
    check(cudaGetLastError(), "row_norms_kernel");
  }
  Buffer x(static_cast<std::size_t>(N * H) * d);
  widen(in, in.x, N * H, staging.as<void>(), x.as<double>());
  Buffer z(static_cast<std::size_t>(m * V) * d), probs(in.gradients ? static_cast<std::size_t>(m * V) * d : 0);
  Buffer g(in.gradients ? static_cast<std::size_t>(m * H) * d : 0);
  Buffer target(static_cast<std::size_t>(m) * 8), rows(static_cast<std::size_t>(m) * sizeof(LogitRow)),
      nonlinear(static_cast<std::size_t>(m) * d), peak(static_cast<std::size_t>(m) * 8), d_sq(static_cast<std::size_t>(m) * d);
  Handle handle;
  for (std::int64_t r0 = 0; r0 < N; r0 += m) {
    const std::int64_t rows_here = std::min(m, N - r0);
    check(cudaMemcpy(target.as<void>(), in.target + r0, static_cast<std::size_t>(rows_here) * 8, cudaMemcpyHostToDevice),
          "cudaMemcpy (targets)");
    gemm_abt(handle.get(), rows_here, V, H, x.as<double>() + r0 * H, w.as<double>(), z.as<double>());
    row_kernel<<<dimension(rows_here), row_threads>>>(z.as<double>(), in.gradients ? probs.as<double>() : nullptr,
                                                       in.bias ? bias.as<double>() : nullptr, target.as<std::int64_t>(), V,
                                                       in.ignore_index, rows.as<LogitRow>(), nonlinear.as<double>(),
                                                       peak.as<std::int64_t>());
    check(cudaGetLastError(), "row_kernel");
    if (in.gradients) {
      gemm_ab(handle.get(), rows_here, H, V, probs.as<double>(), w.as<double>(), g.as<double>());
      peak_kernel<<<dimension(rows_here), row_threads>>>(g.as<double>(), w.as<double>(), H, peak.as<std::int64_t>(),
                                                         d_sq.as<double>());
      check(cudaGetLastError(), "peak_kernel");
      double* wg = probs.as<double>();  // P is read only by the product above
      gemm_abt(handle.get(), rows_here, V, H, g.as<double>(), w.as<double>(), wg);
      c_kernel<<<dimension(rows_here), row_threads>>>(z.as<double>(), wg, g.as<double>(), w_sq.as<double>(), V, H,
                                                      nonlinear.as<double>(), peak.as<std::int64_t>(), d_sq.as<double>(),
                                                      rows.as<LogitRow>());
      check(cudaGetLastError(), "c_kernel");
    }
    check(cudaMemcpy(out + r0, rows.as<void>(), static_cast<std::size_t>(rows_here) * sizeof(LogitRow), cudaMemcpyDeviceToHost),
          "cudaMemcpy (rows)");
  }
  return true;
}

}  // namespace simpo::verifier::device
