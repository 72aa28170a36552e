// Device helpers for kernels that give one block to one token row (fused/cuda/kernels.cu, and the vocab-parallel
// shard kernels that reduce a rank's columns the same way, so a one-rank run computes the same bits): 16-byte
// access to 8 consecutive columns per thread and step, warp and block reductions, and the row's online
// (max, sum of exp) with the double sum of its logits.
#pragma once

#include "fused/simpo_math.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace simpo::fused::cuda::rows {

namespace m = ::simpo::fused::math;

inline constexpr int kRowThreads = 256;  // one block per token row; 8 warps keep ~16 KB of loads in flight per row
inline constexpr int kWarps = kRowThreads / 32;

// The inputs' element types (bf16, f16, f32) to and from fp32, one element or eight consecutive ones (16-byte
// accesses: the pointer 16-byte aligned).
__device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float to_float(__half v) { return __half2float(v); }
__device__ inline float to_float(float v) { return v; }
template <class T> __device__ inline T from_float(float v);
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ inline __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ inline float from_float<float>(float v) { return v; }

__device__ inline void load8(const float* p, float z[8]) {
  const float4 lo = *reinterpret_cast<const float4*>(p);
  const float4 hi = *reinterpret_cast<const float4*>(p + 4);
  z[0] = lo.x; z[1] = lo.y; z[2] = lo.z; z[3] = lo.w;
  z[4] = hi.x; z[5] = hi.y; z[6] = hi.z; z[7] = hi.w;
}
__device__ inline void load8(const __nv_bfloat16* p, float z[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    z[2 * i] = f.x;
    z[2 * i + 1] = f.y;
  }
}
__device__ inline void load8(const __half* p, float z[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(pairs[i]);
    z[2 * i] = f.x;
    z[2 * i + 1] = f.y;
  }
}

__device__ inline void store8(__nv_bfloat16* out, const float v[8]) {
  uint4 raw;
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(out) = raw;
}
__device__ inline void store8(__half* out, const float v[8]) {
  uint4 raw;
  auto* pairs = reinterpret_cast<__half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(out) = raw;
}
__device__ inline void store8(float* out, const float v[8]) {
  *reinterpret_cast<float4*>(out) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(out + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

// Eight values rounded into hi and, where lo is not null, their residues v - hi rounded into lo.
template <class T>
__device__ inline void store8_hilo(T* hi, T* lo, const float v[8]) {
  store8(hi, v);
  if (lo == nullptr) return;
  float residue[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) residue[i] = v[i] - to_float(from_float<T>(v[i]));  // exact in fp32 (Sterbenz)
  store8(lo, residue);
}

// Eight fp32 logits plus, with a bias (the inputs' dtype), eight biases.
template <bool kBias, class B>
__device__ inline void load8(const float* row, const B* bias, std::int64_t v, float z[8]) {
  load8(row + v, z);
  if constexpr (kBias) {
    float b[8];
    load8(bias + v, b);
#pragma unroll
    for (int i = 0; i < 8; ++i) z[i] += b[i];
  }
}

template <bool kBias, class B>
__device__ inline float load1(const float* row, const B* bias, std::int64_t v) {
  float z = row[v];
  if constexpr (kBias) z += to_float(bias[v]);
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

// Sums `x` over the block; the result is valid in thread 0. Each call in a kernel needs its own `shared`
// array: there is no barrier after thread 0 reads it.
__device__ inline double block_sum(double x, double* shared /*[kWarps]*/) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  x = warp_sum(x);
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  double total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kWarps; ++w) total += shared[w];
  return total;
}

struct RowReduction {
  m::LogSumExp<float> lse;  // max and sum of exp(z - max) over the row's columns
  double sum = 0;           // sum of the logits
};

// One row of V fp32 logits (+ bias), read once by the block's kRowThreads threads: each folds its columns into
// an online (max, sum of exp) state and a double sum, warps merge by shuffles, the block through shared
// memory. Valid in thread 0; called once per kernel (its shared arrays have no barrier after the read).
template <bool kBias, class B>
__device__ inline RowReduction reduce_row(const float* row, const B* bias, std::int64_t V) {
  const std::int64_t V8 = V / 8 * 8;
  m::LogSumExp<float> state = m::lse_empty<float>();
  double sum = 0;
  for (std::int64_t v = std::int64_t(threadIdx.x) * 8; v < V8; v += kRowThreads * 8) {
    float z[8];
    load8<kBias>(row, bias, v, z);
    float partial = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      state = m::lse_add(state, z[i]);
      partial += z[i];
    }
    sum += partial;
  }
  for (std::int64_t v = V8 + threadIdx.x; v < V; v += kRowThreads) {
    const float z = load1<kBias>(row, bias, v);
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
  RowReduction total{m::lse_empty<float>(), 0.0};
  if (threadIdx.x == 0)
    for (int w = 0; w < kWarps; ++w) {
      total.lse = m::lse_merge(total.lse, m::LogSumExp<float>{shared_max[w], shared_sum[w]});
      total.sum += shared_total[w];
    }
  return total;
}

}  // namespace simpo::fused::cuda::rows
