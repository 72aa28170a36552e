// Experiment: what the logits GEMM's epilogue costs. The promoted GEMM itself runs at about cuBLAS's speed (its
// promotions hidden by the staggered warpgroups), yet the step's forward, the same mainloop with the row
// statistics reduced in the epilogue and no store, was well behind it: in CUTLASS's cooperative kernel the epilogue
// does not overlap the MMAs, so whatever the pass costs per tile (a spill above all) the tensor cores wait. This
// times the product's three forms of that GEMM, in turns with cuBLAS's bf16-output GEMM (the floor), each at
// promotion every 256 k (the default), 512 k and 4096 k (= H: no promotion but the tile's last):
//   plain:      promoted_logits, fp32 logits stored (CUTLASS's epilogue)
//   statistics: promoted_logits_stats with no logits (the forward: max, one exp per logit, sums, target)
//   distances:  promoted_logits_distances (the full step: the statistics, then 16-bit distances stored)
// First it checks the statistics form against the plain one: each tile's max is the max of the plain GEMM's
// logits over the tile's columns (the same accumulation, so the same bits). M x 128256 x 4096, M = 2048, 4096.
// --chunks C: each body runs C such GEMMs back to back over consecutive row chunks of a C times taller x, as the
// step's forward does (its B = 16 forward is 4 chunks of 4096 rows), against cuBLAS over all C M rows at once.
//   epilogue_cost [--reps N] [--chunks C]
#include "fused/cuda/bench/interleaved_timing.cuh"
#include "fused/cuda/bench/random_fill.cuh"
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_buffer.h"
#include "fused/cuda/plan.h"
#include "fused/cuda/promoted_gemm.h"
#include "fused/cuda/promoted_stats.h"

#include <CLI/CLI.hpp>
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

using namespace simpo::fused::cuda;

int main(int argc, char** argv) {
  CLI::App app{"the promoted logits GEMM with CUTLASS's fp32 store, the statistics epilogue and the distances one"};
  int reps = 15, chunks = 1;
  app.add_option("--reps", reps, "timed rounds (each body once per round; medians reported)");
  app.add_option("--chunks", chunks, "GEMMs per body over consecutive row chunks (the forward's sequence)")
      ->check(CLI::Range(1, 8));
  CLI11_PARSE(app, argc, argv);
  try {
    if (!promoted_stats_available()) {
      std::printf("epilogue_cost: needs the sm_90a kernels on a compute capability 9.0 device\n");
      return 0;
    }
    cudaDeviceProp prop{};
    SIMPO_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s\n", prop.name);
    const int N = 128256, K = 4096, Mmax = 4096;
    const std::int64_t tiles = statistics_tiles(N);
    DeviceBuffer dx(std::size_t{Mmax} * chunks * K * 2, "x"), dw(std::size_t{N} * K * 2, "w");
    DeviceBuffer logits(std::size_t{Mmax} * N * std::max(4, 2 * chunks), "logits"), scratch(64 << 20, "scratch");
    DeviceBuffer target(std::size_t{Mmax} * 8, "target"), z_target(std::size_t{Mmax} * 4, "z_target");
    DeviceBuffer tile_max(std::size_t(tiles) * Mmax * 4, "tile_max"), tile_sum_exp(std::size_t(tiles) * Mmax * 4, "sum_exp");
    DeviceBuffer tile_sum(std::size_t(tiles) * Mmax * 8, "tile_sum");
    bench::fill_uniform<<<4096, 256>>>(dx.as<__nv_bfloat16>(), Mmax * chunks, K, K, 1.7320508f, 1);
    bench::fill_uniform<<<4096, 256>>>(dw.as<__nv_bfloat16>(), N, K, K, std::sqrt(3.0f * 4.0f / K), 2);
    SIMPO_CUDA_CHECK_LAUNCH();
    std::vector<std::int64_t> targets(Mmax);
    for (int i = 0; i < Mmax; ++i) targets[i] = (std::int64_t{i} * 7919) % N;
    SIMPO_CUDA_CHECK(cudaMemcpy(target.get(), targets.data(), Mmax * 8, cudaMemcpyHostToDevice));
    LogitTileStats stats;
    stats.target = target.as<std::int64_t>();
    stats.ld = Mmax;
    stats.tile_max = tile_max.as<float>();
    stats.tile_sum_exp = tile_sum_exp.as<float>();
    stats.tile_sum = tile_sum.as<double>();
    stats.z_target = z_target.as<float>();
    const auto* x = dx.as<__nv_bfloat16>();
    const auto* w = dw.as<__nv_bfloat16>();
    // Chunk c of a body reads x rows [c M, (c + 1) M) and writes the same outputs (as the step reuses its buffers).
    auto plain = [&](int M, std::int64_t pk, int c = 0) {
      promoted_logits(M, N, K, x + std::size_t(c) * M * K, w, logits.as<float>(), N, pk, nullptr, scratch.get(),
                      scratch.bytes());
    };
    auto statistics = [&](int M, std::int64_t pk, int c = 0) {
      promoted_logits_stats(M, N, K, x + std::size_t(c) * M * K, w, pk, stats, nullptr, scratch.get(), scratch.bytes());
    };
    auto distances = [&](int M, std::int64_t pk, int c = 0) {
      promoted_logits_distances(M, N, K, x + std::size_t(c) * M * K, w, reinterpret_cast<std::uint16_t*>(logits.get()),
                                N, pk, stats, nullptr, scratch.get(), scratch.bytes());
    };

    // The check: rows 0 and Mmax - 1, every tile.
    plain(Mmax, 256);
    statistics(Mmax, 256);
    SIMPO_CUDA_CHECK(cudaDeviceSynchronize());
    std::int64_t wrong = 0;
    for (int row : {0, Mmax - 1}) {
      std::vector<float> z(N), maxima(tiles);
      SIMPO_CUDA_CHECK(cudaMemcpy(z.data(), logits.as<float>() + std::size_t(row) * N, N * 4, cudaMemcpyDeviceToHost));
      SIMPO_CUDA_CHECK(cudaMemcpy2D(maxima.data(), 4, tile_max.as<float>() + row, Mmax * 4, 4, tiles,
                                    cudaMemcpyDeviceToHost));
      for (std::int64_t t = 0; t < tiles; ++t) {
        const auto begin = z.begin() + t * statistics_tile_columns;
        const auto end = z.begin() + std::min<std::int64_t>(N, (t + 1) * statistics_tile_columns);
        wrong += *std::max_element(begin, end) != maxima[t];
      }
    }
    std::printf("tile maxima of the statistics epilogue against the plain GEMM's logits: %lld of %lld differ\n",
                static_cast<long long>(wrong), static_cast<long long>(2 * tiles));
    if (wrong) return 1;

    cublasHandle_t h;
    SIMPO_CUBLAS_CHECK(cublasCreate(&h));
    const float one = 1.0f, zero = 0.0f;
    for (int M : {2048, 4096}) {
      std::vector<std::string> names{"cuBLAS, bf16 out (floor)"};
      std::vector<std::function<void()>> bodies{[&] {
        SIMPO_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M * chunks, K, &one, w, CUDA_R_16BF, K, x,
                                        CUDA_R_16BF, K, &zero, logits.get(), CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT));
      }};
      for (std::int64_t pk : {std::int64_t{256}, std::int64_t{512}, std::int64_t{K}}) {
        const std::string every = ", every " + std::to_string(pk) + " k";
        names.push_back("plain" + every);
        bodies.push_back([&, M, pk] { for (int c = 0; c < chunks; ++c) plain(M, pk, c); });
        names.push_back("statistics" + every);
        bodies.push_back([&, M, pk] { for (int c = 0; c < chunks; ++c) statistics(M, pk, c); });
        names.push_back("distances" + every);
        bodies.push_back([&, M, pk] { for (int c = 0; c < chunks; ++c) distances(M, pk, c); });
      }
      const auto t = bench::time_interleaved(nullptr, 3, reps, bodies);
      std::printf("\n%d x M = %d x %d x %d, in turns, median of %d (ms, ratio to the floor)\n", chunks, M, N, K, reps);
      for (std::size_t i = 0; i < t.size(); ++i)
        std::printf("  %-30s %8.3f  %6.3fx\n", names[i].c_str(), t[i].median_ms, t[i].median_ms / t[0].median_ms);
    }
    cublasDestroy(h);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epilogue_cost: %s\n", e.what());
    return 1;
  }
  return 0;
}
