// Experiment: a one-chunk step's weight gradient written once in bf16, with no lo. The step keeps each row's target
// term, k (1 - p_target) x, out of dz (in bf16 beside the large softmax terms it would lose its small part) and adds
// it after the weight GEMM; for that sum to be rounded once, the GEMM stores the hi/lo pair even where one chunk holds
// every row (B <= 4 at the default budget): 1 GiB of lo written at V = 128256, H = 4096, and held. Here the target
// terms come first, as a compact fp32 matrix T [rows, H] (row i: the terms of every row whose target is row i's, in
// target_rows_kernel's order, at its first such row) and a map [V] from a weight row to its row of T (or -1), and the
// GEMM's epilogue adds T[map[m]] to the fp32 accumulator before the one rounding:
//
//   D[m, n] = bf16(s (sum_r dz[r, m] x[r, n] + T[map[m], n]))      (T's term 0 where map[m] < 0)
//
// by a visitor node of its own (Sm90RowMappedTerms: per element a map lookup, and a load of T on the few rows that
// have one). The same node lets the last chunk of a multi-chunk step store hi alone, its lo never written:
//
//   hi[m, n] = bf16(s (sum_r dz[r, m] x[r, n] + hi[m, n] + lo[m, n] + T[map[m], n]))
//
// This times, in turns, on a chunk's shape (M = V = 128256 rows of grad_W, N = H = 4096, K = --rows token rows):
//   floor:       cuBLAS, dz^T x into bf16 (the step's floor GEMM)
//   hi/lo first: the hi/lo GEMM of a first chunk (stores hi and lo: today's one-chunk step, before its target term)
//   mapped:      the hi/lo GEMM's mainloop (128x256x64 cooperative) with the mapped-term epilogue, bf16 out
//   hi/lo later: the hi/lo GEMM of a later chunk (reads the pair, stores both: today's last chunk)
//   last:        the same mainloop reading the pair, adding the mapped terms, storing hi alone
// First it checks mapped and last against cuBLAS's fp32 GEMM with the pair and T added and rounded once by a plain
// kernel (the fp32 sums differ only in order: at most one bf16 ulp apart), on every element.
//   target_term_epilogue [--rows K] [--reps N]
#include "fused/cuda/bench/interleaved_timing.cuh"
#include "fused/cuda/bench/random_fill.cuh"
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_buffer.h"
#include "fused/cuda/hilo_gemm.h"
#include "fused/cuda/register_epilogue.cuh"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#include <CLI/CLI.hpp>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>
#include <vector>

using namespace simpo::fused::cuda;
namespace fusion = cutlass::epilogue::fusion;

// The node's parameters: where its terms are.
struct RowMappedTermsArgs {
  const int* map = nullptr;      // [M]: a row of terms, or -1
  const float* terms = nullptr;  // [rows of terms, ld]
  std::int64_t ld = 0;
  bool valid() const { return map != nullptr && terms != nullptr; }
};

// Per output element at (m, n) of grad_W: terms[map[m] * ld + n], or 0 where the map holds -1. No shared
// memory and no producer load: the map is read through L1 (a few rows per thread and subtile), T only on mapped rows.
// The node's plumbing (arguments, workspace, no loads) is register_epilogue.cuh's EpilogueParams; its leaf visit is
// its own.
template <class ElementCompute>
struct Sm90RowMappedTerms : EpilogueParams<RowMappedTermsArgs> {
  using Base = EpilogueParams<RowMappedTermsArgs>;
  using typename Base::Params;
  using Base::Base;

  template <class CTensor, class Residue>
  struct ConsumerStoreCallbacks : fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor tCcD, Residue residue, const int* map, const float* terms, int ld)
        : tCcD(tCcD), residue(residue), map(map), terms(terms), ld(ld) {}
    CTensor tCcD;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) coordinates relative to this thread's first element
    Residue residue;
    const int* map;      // at this thread's first element's row
    const float* terms;  // at its column
    int ld;

    template <class ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementCompute, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n) {
      cutlass::Array<ElementCompute, FragmentSize> out;
      auto tCcD_mn = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const auto coord = tCcD_mn(epi_v * FragmentSize + i);
        const int row = cute::elem_less(coord, residue) ? __ldg(map + int(cute::get<0>(coord))) : -1;
        out[i] = row < 0 ? ElementCompute(0) : ElementCompute(__ldg(terms + row * ld + int(cute::get<1>(coord))));
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    // The epilogue passes coordinates relative to each thread's first element and the residue from there to the
    // problem's corner (M, N): that element's global coordinates are the difference.
    auto [M, N, K, L] = args.problem_shape_mnkl;
    const int m0 = int(M) - int(cute::get<0>(args.residue_tCcD));
    const int n0 = int(N) - int(cute::get<1>(args.residue_tCcD));
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(
        args.tCcD, args.residue_tCcD, params.map + m0, params.terms + n0, int(params.ld));
  }
};

using Element = cutlass::bfloat16_t;
using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
using Schedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
using RowMajor = cutlass::layout::RowMajor;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
using Plus = fusion::Sm90Compute<cutlass::plus, float, float, kRound>;
// s times a tree's value, rounded to bf16 once.
template <class Sum>
using Scaled = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, Element, float, kRound>,
                               fusion::Sm90ScalarBroadcast<float>, Sum>;

// The hi/lo GEMM's mainloop (dz^T M-major, x N-major, 128x256x64 cooperative, hilo_gemm.cu) with an epilogue of
// visitor nodes Callbacks over a C of ElementC (void: none) and a bf16 D, both [M, ld_w].
template <class ElementC, class Callbacks>
struct WeightGemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, RowMajor, 8, Element, RowMajor, 8,
      Schedule, Callbacks>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::ColumnMajor, 8, Element,
      RowMajor, 8, float, TileShape, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // Callbacks' arguments nest as the tree: {children..., node}.
  static void run(int K, int M, int N, const void* dz, int ld_dz, const void* x, int ld_x,
                  typename Callbacks::Arguments thread, const void* c, void* d, int ld_w) {
    using namespace cute;
    typename Epilogue::StrideD sw{ld_w, Int<1>{}, 0};
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {M, N, K, 1};
    args.mainloop = {static_cast<const Element*>(dz), typename Mainloop::StrideA{Int<1>{}, ld_dz, 0},
                     static_cast<const Element*>(x), typename Mainloop::StrideB{Int<1>{}, ld_x, 0}};
    args.epilogue.thread = thread;
    args.epilogue.ptr_C = static_cast<const typename Epilogue::ElementC*>(c);
    args.epilogue.dC = sw;
    args.epilogue.ptr_D = static_cast<Element*>(d);
    args.epilogue.dD = sw;
    args.hw_info = {0, cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0)};
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess ||
        gemm.initialize(args, nullptr) != cutlass::Status::kSuccess || gemm.run() != cutlass::Status::kSuccess)
      throw CudaError("weight GEMM with the mapped target terms failed");
  }
};

// One chunk: D = bf16(s (acc + terms)), no C.
using Mapped = Scaled<fusion::Sm90EVT<Plus, fusion::Sm90AccFetch, Sm90RowMappedTerms<float>>>;
using MappedGemm = WeightGemm<void, Mapped>;

// The last chunk: the pair read (lo as C, hi through an aux load, as in hilo_gemm.cu), the mapped terms added, hi
// stored in place (D) and lo not at all: D = bf16(s ((acc + hi) + (lo + terms))).
using Descriptor = cutlass::epilogue::collective::detail::EpilogueDescriptor<
    TileShape, cutlass::epilogue::collective::EpilogueTileAuto, Element, Element, Schedule>;
using HiDescriptor = cutlass::epilogue::collective::detail::AuxLoadDescriptor<Descriptor, RowMajor, Element>;
using HiLoad = fusion::Sm90AuxLoad<HiDescriptor::Stages, typename Descriptor::EpilogueTile, Element,
                                   typename HiDescriptor::Stride, typename HiDescriptor::SmemLayoutAtom,
                                   typename HiDescriptor::CopyOpS2R>;
using LastChunk = Scaled<fusion::Sm90EVT<Plus, fusion::Sm90EVT<Plus, fusion::Sm90AccFetch, HiLoad>,
                                         fusion::Sm90EVT<Plus, fusion::Sm90SrcFetch<Element>, Sm90RowMappedTerms<float>>>>;
using LastChunkGemm = WeightGemm<Element, LastChunk>;

// The check's reference: bf16(sum + hi + lo + T[map[m]]) from cuBLAS's fp32 sum (hi and lo: the pair before the
// call, null for none), and the count of elements of `got` more than one bf16 ulp from it.
__global__ void count_beyond_one_ulp(const float* sum, const __nv_bfloat16* hi, const __nv_bfloat16* lo,
                                     const int* map, const float* terms, std::int64_t ld_terms,
                                     const __nv_bfloat16* got, std::int64_t M, std::int64_t N,
                                     unsigned long long* beyond) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < M * N;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t m = i / N, n = i % N;
    const int row = map[m];
    const float pair = hi == nullptr ? 0.0f : __bfloat162float(hi[i]) + __bfloat162float(lo[i]);
    const float want =
        __bfloat162float(__float2bfloat16_rn(sum[i] + pair + (row < 0 ? 0.0f : terms[row * ld_terms + n])));
    const float have = __bfloat162float(got[i]);
    if (fabsf(have - want) > ldexpf(fabsf(want), -7) + 1e-30f) atomicAdd(beyond, 1ull);
  }
}

int main(int argc, char** argv) {
  CLI::App app{"a one-chunk weight GEMM into bf16 with its target terms added in the epilogue, against cuBLAS and "
               "the hi/lo GEMM"};
  int reps = 15;
  std::int64_t K = 2048;
  app.add_option("--rows", K, "token rows of the chunk (K)")->capture_default_str();
  app.add_option("--reps", reps, "timed rounds (each body once per round; medians reported)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    if (!hilo_gemm_available()) {
      std::printf("target_term_epilogue: needs the sm_90a kernels on a compute capability 9.0 device\n");
      return 0;
    }
    cudaDeviceProp prop{};
    SIMPO_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s\n", prop.name);
    const std::int64_t V = 128256, H = 4096;
    DeviceBuffer dz(std::size_t(K) * V * 2, "dz"), x(std::size_t(K) * H * 2, "x");
    DeviceBuffer hi(std::size_t(V) * H * 2, "hi"), lo(std::size_t(V) * H * 2, "lo"), hi_before(hi.bytes(), "hi kept");
    DeviceBuffer out(std::size_t(V) * H * 2, "bf16 out"), sum(std::size_t(V) * H * 4, "cuBLAS fp32 sum");
    DeviceBuffer terms(std::size_t(K) * H * 4, "target terms"), map(std::size_t(V) * 4, "map");
    DeviceBuffer blas_ws(std::size_t{32} << 20, "cuBLAS workspace"), beyond(8, "count");
    bench::fill_uniform<<<4096, 256>>>(dz.as<__nv_bfloat16>(), K, V, V, 1e-3f, 4);
    bench::fill_uniform<<<4096, 256>>>(x.as<__nv_bfloat16>(), K, H, H, 1.7320508f, 1);
    SIMPO_CUDA_CHECK_LAUNCH();
    // Each token row a target drawn from the vocabulary; a weight row's terms at its first row (the rest of T unused),
    // of the size of the sum they join (the softmax terms of K rows, ~1e-3 * sqrt(K) here).
    std::vector<int> host_map(V, -1);
    std::vector<float> host_terms(std::size_t(K) * H, 0.0f);
    std::int64_t mapped_rows = 0;
    for (std::int64_t r = 0; r < K; ++r) {
      const auto t = static_cast<std::int64_t>(bench::splitmix64(7, r) % std::uint64_t(V));
      if (host_map[t] >= 0) continue;
      host_map[t] = static_cast<int>(r);
      ++mapped_rows;
      for (std::int64_t n = 0; n < H; ++n) host_terms[r * H + n] = 0.05f * bench::uniform_pm1(9, r * H + n);
    }
    SIMPO_CUDA_CHECK(cudaMemcpy(map.get(), host_map.data(), map.bytes(), cudaMemcpyHostToDevice));
    SIMPO_CUDA_CHECK(cudaMemcpy(terms.get(), host_terms.data(), terms.bytes(), cudaMemcpyHostToDevice));

    cublasHandle_t blas;
    SIMPO_CUBLAS_CHECK(cublasCreate(&blas));
    SIMPO_CUBLAS_CHECK(cublasSetWorkspace(blas, blas_ws.get(), blas_ws.bytes()));
    const float one = 1.0f, zero = 0.0f;
    // Row-major grad_W[V, H] = dz^T x as column-major grad_W^T[H, V] = x^T dz (cuda_bench's floor call).
    auto cublas_gemm = [&](void* c, cudaDataType type) {
      SIMPO_CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, int(H), int(V), int(K), &one, x.get(),
                                      CUDA_R_16BF, int(H), dz.get(), CUDA_R_16BF, int(V), &zero, c, type, int(H),
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    const RowMappedTermsArgs mapped_terms{map.as<int>(), terms.as<float>(), H};
    auto mapped = [&] {
      MappedGemm::run(int(K), int(V), int(H), dz.get(), int(V), x.get(), int(H), {{{1.0f}}, {{}, mapped_terms, {}}, {}},
                      nullptr, out.get(), int(H));
    };
    auto hilo_chunk = [&](bool overwrite) {
      hilo_accumulate_grad_weight(K, V, H, dz.as<__nv_bfloat16>(), V, x.as<__nv_bfloat16>(), H,
                                  hi.as<__nv_bfloat16>(), lo.as<__nv_bfloat16>(), H, overwrite, Scale{}, nullptr,
                                  nullptr, 0);
    };
    const typename HiDescriptor::Stride hi_stride{H, cute::Int<1>{}, 0};
    auto last = [&] {
      // {s, {{acc, hi}, {lo, terms}, plus}, multiplies}
      LastChunkGemm::run(int(K), int(V), int(H), dz.get(), int(V), x.get(), int(H),
                         {{{1.0f}},
                          {{{}, {hi.as<Element>(), Element(0), hi_stride}, {}}, {{}, mapped_terms, {}}, {}},
                          {}},
                         lo.get(), hi.get(), int(H));
    };
    // Every element of `got` within one bf16 ulp of bf16(sum + pair + T); the pair as it was before (null: none).
    auto check = [&](const char* what, const void* got, const void* pair_hi, const void* pair_lo) {
      SIMPO_CUDA_CHECK(cudaMemset(beyond.get(), 0, 8));
      count_beyond_one_ulp<<<4096, 256>>>(sum.as<float>(), static_cast<const __nv_bfloat16*>(pair_hi),
                                          static_cast<const __nv_bfloat16*>(pair_lo), map.as<int>(), terms.as<float>(),
                                          H, static_cast<const __nv_bfloat16*>(got), V, H,
                                          beyond.as<unsigned long long>());
      SIMPO_CUDA_CHECK_LAUNCH();
      unsigned long long host_beyond = 0;
      SIMPO_CUDA_CHECK(cudaMemcpy(&host_beyond, beyond.get(), 8, cudaMemcpyDeviceToHost));
      std::printf("check %s: %llu of %lld elements more than one bf16 ulp from the reference (%lld mapped rows): %s\n",
                  what, host_beyond, (long long)(V * H), (long long)mapped_rows, host_beyond == 0 ? "ok" : "FAILED");
      return host_beyond == 0;
    };

    cublas_gemm(sum.get(), CUDA_R_32F);
    mapped();
    if (!check("mapped", out.get(), nullptr, nullptr)) return 1;
    // A pair as a first chunk leaves it (random values of the size of one chunk's sum), kept to check last against.
    hilo_chunk(true);
    SIMPO_CUDA_CHECK(cudaMemcpy(hi_before.get(), hi.get(), hi.bytes(), cudaMemcpyDeviceToDevice));
    last();
    if (!check("last", hi.get(), hi_before.get(), lo.get())) return 1;

    const auto t = bench::time_interleaved(nullptr, 3, reps,
                                           {[&] { cublas_gemm(out.get(), CUDA_R_16BF); }, [&] { hilo_chunk(true); },
                                            mapped, [&] { hilo_chunk(false); }, last});
    bench::print_gemm_timings(V, H, K, reps,
                              {"floor (cuBLAS, bf16 out)", "hi/lo, first chunk", "mapped terms, bf16 out",
                               "hi/lo, later chunk", "last chunk, hi alone"},
                              t);
    SIMPO_CUBLAS_CHECK(cublasDestroy(blas));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "target_term_epilogue: %s\n", e.what());
    return 1;
  }
  return 0;
}
