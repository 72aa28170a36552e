// Experiment: how much of the promoted logits GEMM's time is its promotions, and does a deeper wgmma queue hide
// them? Between promotions each consumer warpgroup keeps kInFlight batches (k tiles of wgmmas) queued behind the
// one it issued; at a promotion it drains them all (warpgroup_wait<0>), adds the block into the fp32 sum, and
// starts again. With one batch queued (the product's kernel) the other warpgroup's one or two batches are all
// the tensor cores have while a warpgroup drains; with two, the queue is longer but each stage goes back to the
// producer a k tile later, so the TMA loads run one stage less ahead.
//
// The kernels: register_epilogue.cuh's GEMM (the product's tile, schedule and mainloop) with an empty pass and
// the fp32 store, at kInFlight 1 and 2. Checks that both give the same bits (the arithmetic is the same: the same
// promotion points, the same order of adds), then times, in turns with cuBLAS's bf16-output GEMM (the floor), both
// at promotion every 256 and 512 k, and kInFlight 1 never promoting (promotion_k 0: no drain but the tile's last;
// the cost of promotion itself), and kInFlight 1 on 2x1 clusters (each weight tile loaded once for two CTAs by TMA
// multicast: half the weight's L2 reads). M x 128256 x 4096, M = 2048 and 4096 (the step's chunks).
//   promoted_in_flight [--reps N]
#include "fused/cuda/bench/interleaved_timing.cuh"
#include "fused/cuda/bench/random_fill.cuh"
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_buffer.h"
#include "fused/cuda/register_epilogue.cuh"

#include <CLI/CLI.hpp>
#include <cublas_v2.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

using namespace simpo::fused::cuda;

// Named, not anonymous: nvcc's host stub for the kernel must name the pass's type.
namespace simpo::fused::cuda::dev {

// The empty pass: the accumulators go to CUTLASS's store as they are.
struct NoPass {
  struct Params {
    bool valid() const { return true; }
  };
  Params params;
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccTensor, class TiledMma>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, TileShapeMNK, TileCoordMNKL, AccTensor&, TiledMma, int) const {}
};

template <int kInFlight, int kClusterM = 1>
using Promoted = RegisterEpilogueGemm<NoPass, float, 4, kInFlight, kClusterM>;

}  // namespace simpo::fused::cuda::dev

using simpo::fused::cuda::dev::NoPass;
using simpo::fused::cuda::dev::Promoted;

int main(int argc, char** argv) {
  CLI::App app{"the promoted logits GEMM with one and with two wgmma batches queued between promotions"};
  int reps = 15;
  app.add_option("--reps", reps, "timed rounds (each body once per round; medians reported)");
  CLI11_PARSE(app, argc, argv);
  try {
    cudaDeviceProp prop{};
    SIMPO_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    if (prop.major != 9 || prop.minor != 0) {
      std::printf("promoted_in_flight: needs compute capability 9.0 (this is %d.%d)\n", prop.major, prop.minor);
      return 0;
    }
    std::printf("device: %s\n", prop.name);
    const int N = 128256, K = 4096, Mmax = 4096;
    DeviceBuffer dx(std::size_t{Mmax} * K * 2, "x"), dw(std::size_t{N} * K * 2, "w");
    DeviceBuffer z1(std::size_t{Mmax} * N * 4, "z1"), z2(std::size_t{Mmax} * N * 4, "z2"), scratch(64 << 20, "scratch");
    bench::fill_uniform<<<4096, 256>>>(dx.as<__nv_bfloat16>(), Mmax, K, K, 1.7320508f, 1);
    bench::fill_uniform<<<4096, 256>>>(dw.as<__nv_bfloat16>(), N, K, K, std::sqrt(3.0f * 4.0f / K), 2);
    SIMPO_CUDA_CHECK_LAUNCH();
    cublasHandle_t h;
    SIMPO_CUBLAS_CHECK(cublasCreate(&h));
    const auto* x = dx.as<__nv_bfloat16>();
    const auto* w = dw.as<__nv_bfloat16>();
    // in_flight 1 or 2; 0: one in flight on 2x1 clusters (the weight tile multicast to both CTAs).
    auto promoted = [&](int in_flight, int M, std::int64_t promotion_k, float* z) {
      const NoPass::Params none;
      if (in_flight == 1)
        Promoted<1>::run("promoted, 1 in flight", M, N, K, x, w, z, N, promotion_k, none, nullptr, scratch.get(), scratch.bytes());
      else if (in_flight == 2)
        Promoted<2>::run("promoted, 2 in flight", M, N, K, x, w, z, N, promotion_k, none, nullptr, scratch.get(), scratch.bytes());
      else
        Promoted<1, 2>::run("promoted, 2x1 cluster", M, N, K, x, w, z, N, promotion_k, none, nullptr, scratch.get(), scratch.bytes());
    };

    // The same bits from each variant as from kInFlight 1, the product's mainloop (all of M = 4096).
    std::vector<float> expected(std::size_t{Mmax} * N), got(expected.size());
    for (std::int64_t pk : {std::int64_t{256}, std::int64_t{512}}) {
      promoted(1, Mmax, pk, z1.as<float>());
      SIMPO_CUDA_CHECK(cudaMemcpy(expected.data(), z1.get(), expected.size() * 4, cudaMemcpyDeviceToHost));
      for (int variant : {2, 0}) {
        promoted(variant, Mmax, pk, z2.as<float>());
        SIMPO_CUDA_CHECK(cudaMemcpy(got.data(), z2.get(), got.size() * 4, cudaMemcpyDeviceToHost));
        const bool same = std::memcmp(expected.data(), got.data(), got.size() * 4) == 0;
        std::printf("every %lld k, %s: %s\n", static_cast<long long>(pk), variant == 2 ? "2 in flight" : "2x1 cluster",
                    same ? "the same bits as 1 in flight" : "DIFFERENT bits from 1 in flight");
        if (!same) return 1;
      }
    }

    const float one = 1.0f, zero = 0.0f;
    for (int M : {2048, 4096}) {
      std::vector<std::string> names{"cuBLAS, bf16 out (floor)", "1 in flight, every 256 k", "2 in flight, every 256 k",
                                     "1 in flight, every 512 k", "2 in flight, every 512 k", "1 in flight, never",
                                     "2x1 cluster, every 256 k"};
      std::vector<std::function<void()>> bodies{
          [&] {
            SIMPO_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K, x,
                                            CUDA_R_16BF, K, &zero, z2.get(), CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT));
          },
          [&] { promoted(1, M, 256, z1.as<float>()); }, [&] { promoted(2, M, 256, z1.as<float>()); },
          [&] { promoted(1, M, 512, z1.as<float>()); }, [&] { promoted(2, M, 512, z1.as<float>()); },
          [&] { promoted(1, M, 0, z1.as<float>()); }, [&] { promoted(0, M, 256, z1.as<float>()); }};
      const auto t = bench::time_interleaved(nullptr, 3, reps, bodies);
      std::printf("\nM = %d x %d x %d, in turns, median of %d (ms, ratio to the floor, TFLOP/s)\n", M, N, K, reps);
      for (std::size_t i = 0; i < t.size(); ++i)
        std::printf("  %-28s %8.3f  %6.3fx  %5.0f\n", names[i].c_str(), t[i].median_ms, t[i].median_ms / t[0].median_ms,
                    2.0 * M * N * K / t[i].median_ms / 1e9);
    }
    cublasDestroy(h);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "promoted_in_flight: %s\n", e.what());
    return 1;
  }
  return 0;
}
