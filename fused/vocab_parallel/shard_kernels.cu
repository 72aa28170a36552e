// The vocab-parallel step's own row kernels (shard_kernels.h). The statistics kernel is the one-GPU
// row_stats_kernel (fused/cuda/kernels.cu) with its result left unmerged across ranks: the same 16-byte loads,
// online (max, sum exp) per thread, warp shuffles and block merge, so a one-rank run computes the same bits.
#include "fused/vocab_parallel/shard_kernels.h"

#include "fused/cuda/cuda_check.h"
#include "fused/simpo_math.h"

#include <string>

namespace simpo::fused::vocab_parallel {
namespace {

namespace m = ::simpo::fused::math;

constexpr int kRowThreads = 256;
constexpr int kWarps = kRowThreads / 32;

template <bool kBias>
__device__ inline void load8(const float* row, const __nv_bfloat16* bias, std::int64_t v, float z[8]) {
  const float4 lo = *reinterpret_cast<const float4*>(row + v);
  const float4 hi = *reinterpret_cast<const float4*>(row + v + 4);
  z[0] = lo.x; z[1] = lo.y; z[2] = lo.z; z[3] = lo.w;
  z[4] = hi.x; z[5] = hi.y; z[6] = hi.z; z[7] = hi.w;
  if constexpr (kBias) {
    const uint4 raw = *reinterpret_cast<const uint4*>(bias + v);
    const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 b = __bfloat1622float2(pairs[i]);
      z[2 * i] += b.x;
      z[2 * i + 1] += b.y;
    }
  }
}

template <bool kBias>
__device__ inline float load1(const float* row, const __nv_bfloat16* bias, std::int64_t v) {
  float z = row[v];
  if constexpr (kBias) z += __bfloat162float(bias[v]);
  return z;
}

__device__ inline m::LogSumExp<float> warp_merge(m::LogSumExp<float> s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const m::LogSumExp<float> other{__shfl_xor_sync(0xffffffffu, s.max, offset),
                                    __shfl_xor_sync(0xffffffffu, s.sum, offset)};
    s = m::lse_merge(s, other);
  }
  return s;
}

__device__ inline double warp_sum(double x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <bool kBias>
__global__ void __launch_bounds__(kRowThreads) shard_row_stats_kernel(cuda::LogitRows a, std::int64_t at,
                                                                     ChunkStats s) {
  const std::int64_t local = blockIdx.x, r = a.row_begin + local, i = at + local;
  const float* row = a.logits + local * a.ld_logits;
  const std::int64_t V8 = a.V / 8 * 8;

  m::LogSumExp<float> state = m::lse_empty<float>();
  double sum = 0;
  for (std::int64_t v = std::int64_t(threadIdx.x) * 8; v < V8; v += kRowThreads * 8) {
    float z[8];
    load8<kBias>(row, a.bias, v, z);
    float partial = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      state = m::lse_add(state, z[k]);
      partial += z[k];
    }
    sum += partial;
  }
  for (std::int64_t v = V8 + threadIdx.x; v < a.V; v += kRowThreads) {
    const float z = load1<kBias>(row, a.bias, v);
    state = m::lse_add(state, z);
    sum += z;
  }

  __shared__ float shared_max[kWarps], shared_sum[kWarps];
  __shared__ double shared_total[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  state = warp_merge(state);
  sum = warp_sum(sum);
  if (lane == 0) {
    shared_max[warp] = state.max;
    shared_sum[warp] = state.sum;
    shared_total[warp] = sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    m::LogSumExp<float> total = m::lse_empty<float>();
    double total_sum = 0;
    for (int w = 0; w < kWarps; ++w) {
      total = m::lse_merge(total, m::LogSumExp<float>{shared_max[w], shared_sum[w]});
      total_sum += shared_total[w];
    }
    const std::int64_t t = a.target[r];  // shard-local: >= 0 only on the owner
    s.local_max[i] = total.max;
    s.max[i] = total.max;
    s.sum_and_target[i] = total.sum;
    s.sum_and_target[s.rows + i] = t >= 0 ? load1<kBias>(row, a.bias, t) : 0.0f;  // exact: the others add 0
    s.rowsum[i] = total_sum;
  }
}

__global__ void rescale_sums_kernel(ChunkStats s) {
  const std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x;
  if (i >= s.rows) return;
  // lse_merge's rescale of the smaller-max side: sum exp(z - M) = sum exp(z - m_g) * exp(m_g - M).
  if (s.local_max[i] != s.max[i]) s.sum_and_target[i] *= m::exp_(s.local_max[i] - s.max[i]);
}

__global__ void finish_stats_kernel(ChunkStats s, std::int64_t at, std::int64_t rows, std::int64_t row_begin,
                                    const std::int64_t* target, std::int64_t ignore_index, float* row_max,
                                    float* lse, float* z_target, double* rowsum) {
  const std::int64_t local = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x;
  if (local >= rows) return;
  const std::int64_t i = at + local, r = row_begin + local;
  const float M = s.max[i];
  row_max[r] = M;
  lse[r] = m::lse_value(m::LogSumExp<float>{0.0f, s.sum_and_target[i]});  // relative to M, as row_stats_kernel
  z_target[r] = target[r] != ignore_index ? s.sum_and_target[s.rows + i] - M : 0.0f;
  rowsum[r] = s.rowsum[i];
}

__global__ void __launch_bounds__(kRowThreads) owner_target_terms_kernel(float* part, std::int64_t row_begin,
                                                                        std::int64_t H, std::int64_t ld_h,
                                                                        const __nv_bfloat16* weight,
                                                                        const std::int64_t* local_target,
                                                                        const float* coef, float* own_coef) {
  const std::int64_t local = blockIdx.x, r = row_begin + local, t = local_target[r];
  const float c = t >= 0 ? coef[r] : 0.0f;
  if (threadIdx.x == 0) own_coef[r] = c;
  if (c == 0.0f) return;
  float* out = part + local * ld_h;
  const __nv_bfloat16* w = weight + t * ld_h;
  for (std::int64_t h = threadIdx.x; h < H; h += kRowThreads) out[h] += c * __bfloat162float(w[h]);
}

unsigned grid_rows(std::int64_t rows) {
  if (rows > 2147483647) throw cuda::CudaError("vocab-parallel: chunk of " + std::to_string(rows) + " rows exceeds the grid");
  return static_cast<unsigned>(rows);
}

}  // namespace

void launch_shard_row_stats(const cuda::LogitRows& a, std::int64_t at, const ChunkStats& s, cudaStream_t stream) {
  if (a.rows == 0) return;
  if (a.bias) shard_row_stats_kernel<true><<<grid_rows(a.rows), kRowThreads, 0, stream>>>(a, at, s);
  else shard_row_stats_kernel<false><<<grid_rows(a.rows), kRowThreads, 0, stream>>>(a, at, s);
  SIMPO_CUDA_CHECK_LAUNCH();
}

void launch_rescale_sums(const ChunkStats& s, cudaStream_t stream) {
  if (s.rows == 0) return;
  rescale_sums_kernel<<<grid_rows((s.rows + 255) / 256), 256, 0, stream>>>(s);
  SIMPO_CUDA_CHECK_LAUNCH();
}

void launch_finish_stats(const ChunkStats& s, std::int64_t at, std::int64_t rows, std::int64_t row_begin,
                         const std::int64_t* target, std::int64_t ignore_index, float* row_max, float* lse,
                         float* z_target, double* rowsum, cudaStream_t stream) {
  if (rows == 0) return;
  finish_stats_kernel<<<grid_rows((rows + 255) / 256), 256, 0, stream>>>(s, at, rows, row_begin, target,
                                                                          ignore_index, row_max, lse, z_target,
                                                                          rowsum);
  SIMPO_CUDA_CHECK_LAUNCH();
}

void launch_owner_target_terms(float* grad_x_part, std::int64_t rows, std::int64_t row_begin, std::int64_t H,
                               std::int64_t ld_h, const __nv_bfloat16* weight, const std::int64_t* local_target,
                               const float* target_coef, float* own_coef, cudaStream_t stream) {
  if (rows == 0) return;
  owner_target_terms_kernel<<<grid_rows(rows), kRowThreads, 0, stream>>>(grad_x_part, row_begin, H, ld_h, weight,
                                                                          local_target, target_coef, own_coef);
  SIMPO_CUDA_CHECK_LAUNCH();
}

}  // namespace simpo::fused::vocab_parallel
