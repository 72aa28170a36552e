// The benchmarks' random inputs, drawn on the device or the host: problem/generate.h's splitmix64 (the project's one
// random source) as a stateless function of (seed, index), element i being the (i + 1)-th draw of Rng(seed), so
// every thread draws its own elements and a fill does not depend on the launch shape. Never zeros: they run faster
// than real data.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace simpo::fused::cuda::bench {

// The (i + 1)-th draw of splitmix64 seeded with `seed`.
__host__ __device__ inline std::uint64_t splitmix64(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [-1, 1), 24 bits.
__host__ __device__ inline float uniform_pm1(std::uint64_t seed, std::uint64_t i) {
  return static_cast<float>(splitmix64(seed, i) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

// A [rows, ld] bf16 matrix, columns < cols uniform in [-scale, scale), the padding columns zero (ld = cols: dense).
// Launch with any grid (a grid-stride loop); static: each benchmark's translation unit has its own.
static __global__ void fill_uniform(__nv_bfloat16* out, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                                    float scale, std::uint64_t seed) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < rows * ld;
       i += std::int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(i % ld < cols ? scale * uniform_pm1(seed, i) : 0.0f);
}

}  // namespace simpo::fused::cuda::bench
