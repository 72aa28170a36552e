// reference-cuda's float64 kernels (kernels.h). Clarity over speed: they touch the logits a few times each, which
// costs milliseconds against the hundreds the float64 GEMMs take at the published workload.
#include "reference/cuda/kernels.h"

#include <cfloat>
#include <cstdint>

namespace simpo::reference::cuda::kernels {

namespace {

constexpr int kRowThreads = 512;  // one block per row of logits (V up to ~10^5-10^6)
constexpr int kWarps = kRowThreads / 32;

// Butterfly: every lane ends with the warp's sum.
__device__ double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The block's sum, in every thread. `scratch` holds kWarps doubles.
__device__ double block_sum(double v, double* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read from a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < kWarps ? scratch[lane] : 0.0;
  return warp_sum(v);
}

// The largest value and its first index (ties: the smallest index, as the CPU's strict > scan picks), in every
// thread after the call.
__device__ void block_argmax(double& value, std::int64_t& index, double* values, std::int64_t* indices) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto better = [](double v, std::int64_t i, double w, std::int64_t j) { return v > w || (v == w && i < j); };
  for (int offset = 16; offset > 0; offset /= 2) {
    const double v = __shfl_down_sync(0xffffffffu, value, offset);
    const std::int64_t i = __shfl_down_sync(0xffffffffu, index, offset);
    if (better(v, i, value, index)) value = v, index = i;
  }
  __syncthreads();
  if (lane == 0) values[warp] = value, indices[warp] = index;
  __syncthreads();
  value = values[0], index = indices[0];
  for (int w = 1; w < kWarps; ++w)
    if (better(values[w], indices[w], value, index)) value = values[w], index = indices[w];
}

__global__ void widen_bf16_kernel(const std::uint16_t* in, double* out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x)
    out[i] = static_cast<double>(__uint_as_float(static_cast<unsigned>(in[i]) << 16));
}

__global__ void add_bias_kernel(double* z, std::int64_t rows, std::int64_t V, const double* bias) {
  for (std::int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (std::int64_t v = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; v < V; v += std::int64_t{gridDim.x} * blockDim.x)
      z[r * V + v] += bias[v];
}

__global__ void __launch_bounds__(kRowThreads) row_statistics_kernel(const double* z, std::int64_t V, const std::int64_t* target,
                                                                     std::int64_t ignore_index, std::int64_t first_row,
                                                                     double* lse, double* logprob, double* logit_sum) {
  __shared__ double scratch[kWarps];
  __shared__ std::int64_t scratch_index[kWarps];
  const std::int64_t r = blockIdx.x, row = first_row + r;
  const double* zr = z + r * V;

  double max = -DBL_MAX, sum = 0;
  std::int64_t argmax = V;
  for (std::int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const double value = zr[v];
    if (value > max) max = value, argmax = v;  // increasing v: strict > keeps this thread's first maximum
    sum += value;
  }
  block_argmax(max, argmax, scratch, scratch_index);
  sum = block_sum(sum, scratch);

  double others = 0;
  for (std::int64_t v = threadIdx.x; v < V; v += blockDim.x)
    if (v != argmax) others += exp(zr[v] - max);
  others = block_sum(others, scratch);

  if (threadIdx.x == 0) {
    const double log_sum = log1p(others);
    lse[row] = max + log_sum;
    logit_sum[row] = sum;
    const std::int64_t t = target[row];
    logprob[row] = t != ignore_index ? (zr[t] - max) - log_sum : 0.0;
  }
}

__global__ void logit_gradient_kernel(double* z, std::int64_t rows, std::int64_t V, const std::int64_t* target,
                                      std::int64_t first_row, const double* lse, const double* logprob, const double* k) {
  for (std::int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const std::int64_t row = first_row + r;
    const double kr = k[row];
    double* zr = z + r * V;
    const std::int64_t start = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x, stride = std::int64_t{gridDim.x} * blockDim.x;
    if (kr == 0) {
      for (std::int64_t v = start; v < V; v += stride) zr[v] = 0.0;
      continue;
    }
    // k (1 - p) at the target is -k expm1(l): exact where p rounds to 1 (large logits).
    const double lse_r = lse[row], target_value = -kr * expm1(logprob[row]);
    const std::int64_t t = target[row];
    for (std::int64_t v = start; v < V; v += stride) zr[v] = v == t ? target_value : -kr * exp(zr[v] - lse_r);
  }
}

__global__ void __launch_bounds__(kRowThreads) off_target_softmax_kernel(const double* z, std::int64_t V, const std::int64_t* target,
                                                                         std::int64_t first_row, const double* lse, const double* k,
                                                                         double* norm, double* max) {
  __shared__ double scratch[kWarps];
  __shared__ std::int64_t scratch_index[kWarps];
  const std::int64_t r = blockIdx.x, row = first_row + r;
  if (k[row] == 0) {  // as the CPU reference: rows without a gradient are left 0
    if (threadIdx.x == 0) norm[row] = max[row] = 0.0;
    return;
  }
  const double* zr = z + r * V;
  const double lse_r = lse[row];
  const std::int64_t t = target[row];
  double sq = 0, largest = 0;
  std::int64_t unused = 0;
  for (std::int64_t v = threadIdx.x; v < V; v += blockDim.x)
    if (v != t) {
      const double p = exp(zr[v] - lse_r);
      sq += p * p;
      largest = fmax(largest, p);
    }
  sq = block_sum(sq, scratch);
  block_argmax(largest, unused, scratch, scratch_index);
  if (threadIdx.x == 0) norm[row] = sqrt(sq), max[row] = largest;
}

__global__ void accumulate_bias_gradient_kernel(const double* dz, std::int64_t rows, std::int64_t V, double* grad_bias) {
  const std::int64_t v = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (v >= V) return;
  double sum = 0;
  for (std::int64_t r = 0; r < rows; ++r) sum += dz[r * V + v];  // coalesced: a warp reads 32 neighbouring columns
  grad_bias[v] += sum;
}

unsigned blocks_for(std::int64_t n, int threads, std::int64_t cap) {
  const std::int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > cap ? cap : b));
}

}  // namespace

void widen_bf16(const std::uint16_t* in, double* out, std::int64_t n, cudaStream_t stream) {
  widen_bf16_kernel<<<blocks_for(n, 256, 1 << 20), 256, 0, stream>>>(in, out, n);
}

void add_bias(double* z, std::int64_t rows, std::int64_t V, const double* bias, cudaStream_t stream) {
  const dim3 grid(blocks_for(V, 256, 1024), static_cast<unsigned>(rows < 65535 ? rows : 65535));
  add_bias_kernel<<<grid, 256, 0, stream>>>(z, rows, V, bias);
}

void row_statistics(const double* z, std::int64_t rows, std::int64_t V, const std::int64_t* target,
                    std::int64_t ignore_index, std::int64_t first_row, double* lse, double* logprob, double* logit_sum,
                    cudaStream_t stream) {
  row_statistics_kernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(z, V, target, ignore_index, first_row, lse,
                                                                                 logprob, logit_sum);
}

void logit_gradient(double* z, std::int64_t rows, std::int64_t V, const std::int64_t* target, std::int64_t first_row,
                    const double* lse, const double* logprob, const double* k, cudaStream_t stream) {
  const dim3 grid(blocks_for(V, 256, 1024), static_cast<unsigned>(rows < 65535 ? rows : 65535));
  logit_gradient_kernel<<<grid, 256, 0, stream>>>(z, rows, V, target, first_row, lse, logprob, k);
}

void off_target_softmax(const double* z, std::int64_t rows, std::int64_t V, const std::int64_t* target, std::int64_t first_row,
                        const double* lse, const double* k, double* norm, double* max, cudaStream_t stream) {
  off_target_softmax_kernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(z, V, target, first_row, lse, k, norm, max);
}

void accumulate_bias_gradient(const double* dz, std::int64_t rows, std::int64_t V, double* grad_bias, cudaStream_t stream) {
  accumulate_bias_gradient_kernel<<<blocks_for(V, 256, INT32_MAX), 256, 0, stream>>>(dz, rows, V, grad_bias);
}

}  // namespace simpo::reference::cuda::kernels
