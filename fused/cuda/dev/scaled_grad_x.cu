// Experiment (issue: the fused step at QuACK's speed): grad_x straight from E, not from dz. The logits GEMM's
// epilogue could store E = exp(z - m) with m its tile's row max (bf16, in place of the 16-bit distances); then
//   dz[r, v] = s[r, t(v)] E[r, v]  (less the target term),   s[r, t] = k_r exp(m[r, t] - lse_r)
// and grad_x = dz W needs no dz pass if the GEMM applies s per (row, k block) as it accumulates. CUTLASS's blockwise
// scaled mainloop (MainloopSm90TmaGmmaWarpSpecializedBlockwiseFP8: scales of A per (row, 64 k), carried through the
// mainloop pipeline, applied at each promotion) does that; its builder takes FP8 only, so the collective is made here
// from the bf16 builder's tile layouts (as promoted_mainloop.cuh does with the FP8 mainloop). The question: what
// promoting every 64 k with per-row scales costs against cuBLAS's plain GEMM, i.e. whether the scaled GEMM plus no
// dz pass beats the dz pass plus cuBLAS. It times, in turns, at one chunk's shape (M = 4096 token rows, N = H = 4096,
// K = V = 128256):
//   floor:   cuBLAS, dz[M, V] W[V, H] into fp32 (the step's grad_x GEMM)
//   dz pass: dz = bf16(s E) over [M, V] (read E and s, write dz: the pass this would remove, as a plain kernel)
//   scaled:  the blockwise scaled GEMM from E and s into fp32
// First it checks the scaled GEMM against float64 on sampled elements, within (64 + K / 64) 2^-23 sum |s E W|: the
// tensor cores' fp32 sum over each 64-k block, then one fp32 multiply-add per block at its promotion (K 2^-23 would
// be looser than the values themselves at K = V: random signs make |sum| ~ sum |terms| / sqrt(K)).
//   scaled_grad_x [--rows M] [--reps N]
#include "fused/cuda/bench/interleaved_timing.cuh"
#include "fused/cuda/bench/random_fill.cuh"
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_buffer.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#include <CLI/CLI.hpp>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

using namespace simpo::fused::cuda;

namespace scaled {

using Element = cutlass::bfloat16_t;
using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
constexpr int kScaleK = 64;  // a scale per row and 64 k: E's 192-column tile scale given three times
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, kScaleK>;  // B's scales: one per tile column
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto,
    float, float, void, cutlass::layout::RowMajor, 4, float, cutlass::layout::RowMajor, 4,
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
constexpr int kEpilogueSmem = static_cast<int>(sizeof(typename Epilogue::SharedStorage));
// E [M, K = V] k-contiguous, W [K = V, N = H] n-contiguous.
using Plain = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
    cutlass::layout::RowMajor, 8, float, Tile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmem>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
constexpr int kStages = cutlass::gemm::collective::detail::compute_stage_count_with_blockwise_scale<
    cutlass::gemm::collective::detail::sm90_smem_capacity_bytes, Element, Element, float, Tile, 128, 1>(
    cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmem>{});
using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise;
using Mainloop = cutlass::gemm::collective::CollectiveMma<
    cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedBlockwiseFP8<kStages, Cluster, Schedule>, Tile, Element,
    cute::tuple<typename Plain::StrideA, LayoutSFA>, Element, cute::tuple<typename Plain::StrideB, LayoutSFB>,
    typename Plain::TiledMma, typename Plain::GmemTiledCopyA, typename Plain::SmemLayoutAtomA,
    typename Plain::SmemCopyAtomA, typename Plain::TransformA, typename Plain::GmemTiledCopyB,
    typename Plain::SmemLayoutAtomB, typename Plain::SmemCopyAtomB, typename Plain::TransformB>;
using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                    cutlass::gemm::PersistentScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

// grad_x[M, N] = sum_k sfa[k / 64][m] E[m, k] W[k, n] (sfb all ones).
struct Run {
  Gemm gemm;
  DeviceBuffer workspace;  // allocated once the arguments say how much
  Run(int M, int N, int K, const __nv_bfloat16* e, const __nv_bfloat16* w, const float* sfa, const float* sfb,
      float* out) {
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {M, N, K, 1};
    args.mainloop.ptr_A = reinterpret_cast<const Element*>(e);
    args.mainloop.dA = typename Plain::StrideA{K, cute::Int<1>{}, 0};
    args.mainloop.ptr_B = reinterpret_cast<const Element*>(w);
    args.mainloop.dB = typename Plain::StrideB{cute::Int<1>{}, N, 0};
    args.mainloop.ptr_SFA = sfa;
    const auto shape = cute::make_shape(M, N, K, 1);
    args.mainloop.layout_SFA = ScaleConfig::tile_atom_to_shape_SFA(shape);
    args.mainloop.ptr_SFB = sfb;
    args.mainloop.layout_SFB = ScaleConfig::tile_atom_to_shape_SFB(shape);
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.ptr_D = out;
    args.epilogue.dD = typename Kernel::StrideD{N, cute::Int<1>{}, 0};
    args.hw_info = {0, cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0)};
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) throw CudaError("scaled GEMM: cannot implement");
    workspace = DeviceBuffer(std::max<std::size_t>(Gemm::get_workspace_size(args), 16), "scaled GEMM workspace");
    if (gemm.initialize(args, workspace.get()) != cutlass::Status::kSuccess)
      throw CudaError("scaled GEMM: initialize failed");
  }
  void operator()() {
    if (gemm.run() != cutlass::Status::kSuccess) throw CudaError("scaled GEMM: run failed");
    SIMPO_CUDA_CHECK_LAUNCH();
  }
};

}  // namespace scaled

// dz[m, k] = bf16(sfa[k / 64][m] E[m, k]): the dz pass the scaled GEMM would remove (8 elements a thread).
__global__ void dz_pass(const __nv_bfloat16* e, const float* sfa, std::int64_t M, std::int64_t K, __nv_bfloat16* dz) {
  const std::int64_t i = (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i >= M * K) return;
  const std::int64_t m = i / K, k = i % K;
  const float s = sfa[(k / scaled::kScaleK) * M + m];
  uint4 raw = *reinterpret_cast<const uint4*>(e + i);
  auto* v = reinterpret_cast<__nv_bfloat162*>(&raw);
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(v[j]);
    v[j] = __floats2bfloat162_rn(s * f.x, s * f.y);
  }
  *reinterpret_cast<uint4*>(dz + i) = raw;
}

__global__ void fill_scales(float* out, std::int64_t n, std::uint64_t seed) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n; i += stride)
    out[i] = exp2f(-4.0f * (1.0f + bench::uniform_pm1(seed, i)));  // (2^-8, 1]: a softmax's tile factors
}

int main(int argc, char** argv) {
  CLI::App app{"grad_x from E with per-(row, 64 k) scales (CUTLASS's blockwise scaled mainloop) against the dz "
               "pass plus cuBLAS"};
  std::int64_t M = 4096;
  int reps = 9;
  app.add_option("--rows", M, "token rows of the chunk")->check(CLI::Range(std::int64_t{128}, std::int64_t{16384}));
  app.add_option("--reps", reps, "timed rounds (each body once per round; medians reported)");
  CLI11_PARSE(app, argc, argv);
  try {
    cudaDeviceProp prop{};
    if (const cudaError_t status = cudaGetDeviceProperties(&prop, 0); status != cudaSuccess) {
      std::printf("scaled_grad_x: needs a compute capability 9.0 device (%s)\n", cudaGetErrorString(status));
      return 0;
    }
    if (prop.major != 9) {
      std::printf("scaled_grad_x: needs a compute capability 9.0 device (this is %d.%d)\n", prop.major, prop.minor);
      return 0;
    }
    std::printf("device: %s\n", prop.name);
    const std::int64_t K = 128256, N = 4096, blocks = (K + scaled::kScaleK - 1) / scaled::kScaleK;
    DeviceBuffer e(M * K * 2, "E"), dz(M * K * 2, "dz"), w(K * N * 2, "W"), sfa(blocks * M * 4, "row scales");
    DeviceBuffer sfb(blocks * (N / 128) * 4, "column scales"), out(M * N * 4, "scaled out");
    DeviceBuffer ref(M * N * 4, "cuBLAS out");
    DeviceBuffer blas_ws(std::size_t{32} << 20, "cuBLAS workspace");
    bench::fill_uniform<<<4096, 256>>>(e.as<__nv_bfloat16>(), M, K, K, 1.0f, 7);  // |E| <= 1 as exp(<= 0); signs mixed
    bench::fill_uniform<<<4096, 256>>>(w.as<__nv_bfloat16>(), K, N, N, 0.03f, 8);
    fill_scales<<<1024, 256>>>(sfa.as<float>(), blocks * M, 9);
    std::vector<float> ones(blocks * (N / 128), 1.0f);
    SIMPO_CUDA_CHECK(cudaMemcpy(sfb.get(), ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
    SIMPO_CUDA_CHECK_LAUNCH();

    scaled::Run scaled_gemm(int(M), int(N), int(K), e.as<__nv_bfloat16>(), w.as<__nv_bfloat16>(), sfa.as<float>(),
                            sfb.as<float>(), out.as<float>());
    cublasHandle_t blas;
    SIMPO_CUBLAS_CHECK(cublasCreate(&blas));
    SIMPO_CUBLAS_CHECK(cublasSetWorkspace(blas, blas_ws.get(), blas_ws.bytes()));
    const float one = 1.0f, zero = 0.0f;
    const unsigned pass_blocks = static_cast<unsigned>((M * K / 8 + 255) / 256);
    auto pass = [&] {
      dz_pass<<<pass_blocks, 256>>>(e.as<__nv_bfloat16>(), sfa.as<float>(), M, K, dz.as<__nv_bfloat16>());
      SIMPO_CUDA_CHECK_LAUNCH();
    };
    // Row-major grad_x[M, N] = dz W as column-major grad_x^T[N, M] = W^T dz^T.
    auto floor = [&] {
      SIMPO_CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, int(N), int(M), int(K), &one, w.get(),
                                      CUDA_R_16BF, int(N), dz.get(), CUDA_R_16BF, int(K), &zero, ref.get(), CUDA_R_32F,
                                      int(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };

    // Check against float64 on 64 elements (a row and a column of each from the device).
    scaled_gemm();
    SIMPO_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<__nv_bfloat16> e_row(K), w_col(K);
    std::vector<float> s_row(blocks);
    int misses = 0;
    for (int i = 0; i < 64; ++i) {
      const std::int64_t m = (i * 2654435761ull) % M, n = (i * 40503ull + 17) % N;
      SIMPO_CUDA_CHECK(cudaMemcpy(e_row.data(), e.as<__nv_bfloat16>() + m * K, K * 2, cudaMemcpyDeviceToHost));
      SIMPO_CUDA_CHECK(cudaMemcpy2D(w_col.data(), 2, w.as<__nv_bfloat16>() + n, N * 2, 2, K, cudaMemcpyDeviceToHost));
      SIMPO_CUDA_CHECK(cudaMemcpy2D(s_row.data(), 4, sfa.as<float>() + m, M * 4, 4, blocks, cudaMemcpyDeviceToHost));
      double exact = 0, bound = 0;
      for (std::int64_t k = 0; k < K; ++k) {
        const double term = double(s_row[k / scaled::kScaleK]) * double(__bfloat162float(e_row[k])) *
                            double(__bfloat162float(w_col[k]));
        exact += term;
        bound += std::abs(term);
      }
      float got = 0;
      SIMPO_CUDA_CHECK(cudaMemcpy(&got, out.as<float>() + m * N + n, 4, cudaMemcpyDeviceToHost));
      misses += !(std::abs(double(got) - exact) <= double(64 + blocks) * std::ldexp(bound, -23));
    }
    std::printf("check: %d of 64 sampled elements outside (64 + K / 64) 2^-23 sum |terms| of float64: %s\n", misses,
                misses == 0 ? "ok" : "FAILED");
    if (misses != 0) return 1;

    pass();
    const auto t = bench::time_interleaved(nullptr, 3, reps, {floor, pass, [&] { scaled_gemm(); }});
    bench::print_gemm_timings(M, N, K, reps, {"floor (cuBLAS from dz)", "dz pass", "scaled GEMM from E"}, t);
    std::printf("dz pass + floor %.3f ms against the scaled GEMM %.3f ms\n", t[0].median_ms + t[1].median_ms,
                t[2].median_ms);
    SIMPO_CUBLAS_CHECK(cublasDestroy(blas));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "scaled_grad_x: %s\n", e.what());
    return 1;
  }
  return 0;
}
