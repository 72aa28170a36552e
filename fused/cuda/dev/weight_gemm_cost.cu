// Experiment: where the hi/lo weight GEMM's time above cuBLAS goes (in the full step, the largest excess over
// cuBLAS's weight GEMM with a bf16 output: BENCHMARKS.md, "Where the H100's step goes"). Three causes could be it: the
// mainloop (CUTLASS's 128x256 cooperative kernel with both operands MN-major, against cuBLAS's own), the second
// store (hi and lo: 4 bytes per element where cuBLAS writes 2), and the read of the pair that every chunk after the
// first adds (4 more bytes per element, which a cooperative kernel does not overlap with its MMAs). This times, in
// turns, on one chunk's shape (M = V = 128256 rows of grad_W, N = H = 4096, K = 4096 token rows; --M and --K give
// another, e.g. the low-memory schedule's tile: --M 2880 --K 5504):
//   floor:       cuBLAS, dz^T x into bf16 (the step's floor GEMM)
//   floor_f32:   cuBLAS into fp32 with beta = 1 (an fp32 accumulator's read-modify-write)
//   overwrite:   the hi/lo GEMM of a step's first chunk (stores hi and lo, reads nothing)
//   accumulate:  the hi/lo GEMM of every later chunk (reads the pair, adds, stores both)
//   finish:      the hi/lo GEMM of a step's last chunk after the first (reads the pair, adds, stores hi alone)
//   plain:       the hi/lo GEMM's mainloop (128x256x64 cooperative, both operands MN-major) with CUTLASS's plain
//                epilogue (bf16 D, no C)
//   ping-pong:   the same hi/lo GEMM (hilo_gemm_kernel.cuh) as a 128x128 ping-pong kernel, first, later and last
//                chunk: one consumer warpgroup's epilogue (the pair's read-modify-write) under the other's MMAs,
//                which a cooperative kernel cannot overlap; its smaller tiles also fill the waves of a short M
//                (the low-memory tile's 2880 rows are 2.8 waves of 128x256 tiles on 132 SMs)
// so plain / floor is the mainloop, overwrite / plain the pair's epilogue, accumulate / overwrite the read. (x read
// K-major, as x^T, measured no different from N-major: git history of this file, BENCHMARKS.md.) First it checks the
// overwrite's hi against cuBLAS's bf16 output (the same sum, each rounded once to bf16: at most one ulp apart).
//   weight_gemm_cost [--reps N] [--M V_ROWS] [--K TOKEN_ROWS]
#include "fused/cuda/bench/interleaved_timing.cuh"
#include "fused/cuda/bench/random_fill.cuh"
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_buffer.h"
#include "fused/cuda/hilo_gemm.h"
#include "fused/cuda/hilo_gemm_kernel.cuh"

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#include <CLI/CLI.hpp>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <vector>

using namespace simpo::fused::cuda;

// The hi/lo GEMM's mainloop with CUTLASS's plain epilogue (bf16 D, no C): what the mainloop alone costs.
struct PlainGemm {
  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::RowMajor, 8, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::ColumnMajor, 8, Element,
      cutlass::layout::RowMajor, 8, float, TileShape, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static void run(int K, int M, int N, const void* dz, int ld_dz, const void* x, int ld_x, void* out, int ld_out) {
    using namespace cute;
    typename Mainloop::StrideA sa{Int<1>{}, ld_dz, 0};
    typename Mainloop::StrideB sb{Int<1>{}, ld_x, 0};
    typename Epilogue::StrideD sd{ld_out, Int<1>{}, 0};
    cutlass::KernelHardwareInfo hw{0, cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0)};
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1},
                                  {static_cast<const Element*>(dz), sa, static_cast<const Element*>(x), sb},
                                  {{}, nullptr, sd, static_cast<Element*>(out), sd}, hw};
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess || gemm.initialize(args, nullptr) != cutlass::Status::kSuccess ||
        gemm.run() != cutlass::Status::kSuccess)
      throw CudaError("plain CUTLASS GEMM failed");
  }
};

// The hi/lo GEMM as a ping-pong kernel of 128x128 tiles (no L2 prefetch: its epilogue subtiles are 64 rows).
template <PairOutput kOutput>
using PingPongHiLo =
    hilo::HiLoGemm<cute::Shape<cute::_128, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                   cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized, kOutput>;

int main(int argc, char** argv) {
  CLI::App app{"the hi/lo weight GEMM (first chunk and later chunks) in turns with cuBLAS's weight GEMM"};
  int reps = 15;
  std::int64_t V = 128256, K = 4096;
  app.add_option("--reps", reps, "timed rounds (each body once per round; medians reported)");
  app.add_option("--M", V, "rows of grad_W (a vocabulary slice's columns)")
      ->check(CLI::Range(std::int64_t{8}, std::int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--K", K, "token rows summed over")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 16))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    if (!hilo_gemm_available()) {
      std::printf("weight_gemm_cost: needs the sm_90a kernels on a compute capability 9.0 device\n");
      return 0;
    }
    cudaDeviceProp prop{};
    SIMPO_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s\n", prop.name);
    const std::int64_t H = 4096;
    if (V % 8 != 0) throw std::invalid_argument("--M must be a multiple of 8 (the hi/lo GEMM's TMA rows)");
    DeviceBuffer dz(std::size_t(K) * V * 2, "dz"), x(std::size_t(K) * H * 2, "x");
    DeviceBuffer hi(std::size_t(V) * H * 2, "hi"), lo(std::size_t(V) * H * 2, "lo");
    DeviceBuffer out(std::size_t(V) * H * 2, "cuBLAS bf16 out"), out32(std::size_t(V) * H * 4, "cuBLAS fp32 out");
    DeviceBuffer blas_ws(std::size_t{32} << 20, "cuBLAS workspace");
    bench::fill_uniform<<<4096, 256>>>(dz.as<__nv_bfloat16>(), K, V, V, 1e-3f, 4);
    bench::fill_uniform<<<4096, 256>>>(x.as<__nv_bfloat16>(), K, H, H, 1.7320508f, 1);
    SIMPO_CUDA_CHECK_LAUNCH();
    SIMPO_CUDA_CHECK(cudaMemset(out32.get(), 0, out32.bytes()));
    cublasHandle_t blas;
    SIMPO_CUBLAS_CHECK(cublasCreate(&blas));
    SIMPO_CUBLAS_CHECK(cublasSetWorkspace(blas, blas_ws.get(), blas_ws.bytes()));
    const float one = 1.0f, zero = 0.0f;
    // Row-major grad_W[V, H] = dz^T x as column-major grad_W^T[H, V] = x^T dz (cuda_bench's floor call).
    auto floor = [&] {
      SIMPO_CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, int(H), int(V), int(K), &one, x.get(), CUDA_R_16BF,
                                int(H), dz.get(), CUDA_R_16BF, int(V), &zero, out.get(), CUDA_R_16BF, int(H),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    auto floor_f32 = [&] {
      SIMPO_CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, int(H), int(V), int(K), &one, x.get(), CUDA_R_16BF,
                                int(H), dz.get(), CUDA_R_16BF, int(V), &one, out32.get(), CUDA_R_32F, int(H),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    auto hilo = [&](bool overwrite, PairOutput output = PairOutput::hi_and_lo) {
      hilo_accumulate_grad_weight(K, V, H, dz.as<__nv_bfloat16>(), V, x.as<__nv_bfloat16>(), H,
                                  hi.as<__nv_bfloat16>(), lo.as<__nv_bfloat16>(), H, overwrite, Scale{}, nullptr,
                                  nullptr, 0, output);
    };

    auto pingpong = [&](bool overwrite, PairOutput output = PairOutput::hi_and_lo) {
      (output == PairOutput::hi ? PingPongHiLo<PairOutput::hi>::run : PingPongHiLo<PairOutput::hi_and_lo>::run)(
          K, V, H, dz.as<__nv_bfloat16>(), V, x.as<__nv_bfloat16>(), H, hi.as<__nv_bfloat16>(), lo.as<__nv_bfloat16>(),
          H, overwrite, Scale{}, nullptr, nullptr, 0);
    };

    // Check: each first chunk's hi is cuBLAS's bf16 output to within one bf16 ulp (both round the fp32 sum once).
    floor();
    const std::size_t sample = std::min<std::size_t>(std::size_t(1) << 22, std::size_t(V) * H);
    std::vector<__nv_bfloat16> a(sample), b(sample);
    SIMPO_CUDA_CHECK(cudaMemcpy(b.data(), out.get(), sample * 2, cudaMemcpyDeviceToHost));
    for (const bool pp : {false, true}) {
      pp ? pingpong(true) : hilo(true);
      SIMPO_CUDA_CHECK(cudaDeviceSynchronize());
      SIMPO_CUDA_CHECK(cudaMemcpy(a.data(), hi.get(), sample * 2, cudaMemcpyDeviceToHost));
      std::size_t beyond = 0;
      for (std::size_t i = 0; i < sample; ++i) {
        const float p = __bfloat162float(a[i]), q = __bfloat162float(b[i]);
        if (std::fabs(p - q) > std::ldexp(std::fabs(q), -7) + 1e-30f) ++beyond;
      }
      std::printf("check (%s): %zu of %zu elements of hi more than one bf16 ulp from cuBLAS's: %s\n",
                  pp ? "ping-pong" : "cooperative", beyond, sample, beyond == 0 ? "ok" : "FAILED");
      if (beyond != 0) return 1;
    }

    auto plain = [&] {
      PlainGemm::run(int(K), int(V), int(H), dz.get(), int(V), x.get(), int(H), out.get(), int(H));
    };
    const auto t = bench::time_interleaved(
        nullptr, 3, reps,
        {floor, floor_f32, [&] { hilo(true); }, [&] { hilo(false); }, [&] { hilo(false, PairOutput::hi); }, plain,
         [&] { pingpong(true); }, [&] { pingpong(false); }, [&] { pingpong(false, PairOutput::hi); }});
    bench::print_gemm_timings(V, H, K, reps,
                              {"floor (cuBLAS, bf16 out)", "cuBLAS into fp32, beta = 1", "hi/lo, first chunk",
                               "hi/lo, later chunk", "hi/lo, last chunk (hi alone)", "CUTLASS mainloop, bf16 out",
                               "ping-pong hi/lo, first chunk", "ping-pong hi/lo, later chunk",
                               "ping-pong hi/lo, last (hi)"},
                              t);
    SIMPO_CUBLAS_CHECK(cublasDestroy(blas));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weight_gemm_cost: %s\n", e.what());
    return 1;
  }
  return 0;
}
