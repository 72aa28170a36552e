// The vocab-parallel step's own row kernels (shard_kernels.h). The statistics kernel is the one-GPU
// row_stats_kernel (fused/cuda/kernels.cu) with its result left unmerged across ranks: the same row reduction
// (reduce_row, fused/cuda/row_reduce.cuh), so a one-rank run computes the same bits.
#include "fused/vocab_parallel/shard_kernels.h"

#include "fused/cuda/cuda_check.h"
#include "fused/cuda/row_reduce.cuh"
#include "fused/simpo_math.h"

#include <string>

namespace simpo::fused::vocab_parallel {
namespace {

namespace m = ::simpo::fused::math;

// kRowThreads, the 16-byte loads, reduce_row: the one-GPU backend's (fused/cuda/row_reduce.cuh).
using namespace ::simpo::fused::cuda::rows;

template <bool kBias>
__global__ void __launch_bounds__(kRowThreads) shard_row_stats_kernel(cuda::LogitRows a, std::int64_t at,
                                                                     ChunkStats s) {
  const std::int64_t local = blockIdx.x, r = a.row_begin + local, i = at + local;
  const float* row = a.logits + local * a.ld_logits;
  const RowReduction reduced = reduce_row<kBias>(row, a.bias, a.V);
  if (threadIdx.x == 0) {
    const m::LogSumExp<float> total = reduced.lse;
    const std::int64_t t = a.target[r];  // shard-local: >= 0 only on the owner
    s.local_max[i] = total.max;
    s.max[i] = total.max;
    s.sum_and_target[i] = total.sum;
    s.sum_and_target[s.rows + i] = t >= 0 ? load1<kBias>(row, a.bias, t) : 0.0f;  // exact: the others add 0
    s.rowsum[i] = reduced.sum;
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
