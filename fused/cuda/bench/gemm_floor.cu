// The real GEMM floor of the fused step (METHOD.md's "two numbers"): for each of the step's GEMM shapes
// on a chunk of M rows of the published workload (T=1024, H=4096, V=128256; bf16 operands, fp32 accumulation),
// the fastest GEMM this card runs, out of
//   cublas    cublasGemmEx with CUBLAS_GEMM_DEFAULT, what torch runs (cuda_bench's floor);
//   lt#i      every algorithm cublasLtMatmulAlgoGetHeuristic returns (up to --lt-algos, 64 MiB workspace);
//   cutlass   CUTLASS 3.x sm_90a warp-specialized kernels from the collective builder (cooperative and ping-pong,
//             a few tiles and clusters, persistent scheduler), each at several rasterizations and swizzles (run
//             time arguments, so they cost no compile time); built only with CUTLASS and an sm_90a target.
// Shapes (row-major; M = rows of the chunk):
//   logits_bf16 / logits_f32   Z[M, V] = X[M, H] W[V, H]^T, bf16 or fp32 out
//   grad_x                     dX[M, H] = dZ[M, V] W[V, H], bf16 out
//   grad_w_bf16 / grad_w_f32   dW[V, H] += dZ[M, V]^T X[M, H] (beta = 1), bf16 or fp32 accumulator
// Every candidate is first checked against cuBLAS's default on 64K sampled elements (the output poisoned with
// NaN before, or reset to the same random start for the accumulating shapes) and is never timed or reported
// when it disagrees: a wrong layout must not become a floor. cuBLAS's default is itself checked against fp64 on
// the host on a few elements. Times: median of --reps CUDA-event intervals after --warmup, each candidate in turns
// with cuBLAS's default (the clocks drift over a run by more than the differences measured; cuda_bench.cu), so
// each ratio is to the default timed beside it. Inputs are random on the device (random_fill.cuh), never zeros.
// Output: a table per shape, a "FLOOR shape=..." line per shape, a "JSON {...}" line per candidate, and the
// device's measured peak (cuBLAS bf16 8192^3) first.
//   gemm_floor [--M 2048 4096] [--full] [--shapes ...] [--reps 10] [--quick]
#include "fused/cuda/bench/interleaved_timing.cuh"
#include "fused/cuda/bench/random_fill.cuh"
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_buffer.h"

#include <CLI/CLI.hpp>
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(SIMPO_HAVE_CUTLASS_SM90)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#endif

using namespace simpo::fused::cuda;
using namespace simpo::fused::cuda::bench;

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Problems, in cuBLAS's column-major terms: C[m, n] (ldc) = alpha op(A)[m, k] op(B)[k, n] + beta C. Every row-major
// shape above is its transpose, as cuda_bench.cu writes them.

enum class Kind { logits_bf16, logits_f32, grad_x, grad_x_f32, grad_w_bf16, grad_w_f32 };

struct Problem {
  Kind kind;
  std::string name, formula;
  cublasOperation_t ta, tb;
  std::int64_t m, n, k;
  const __nv_bfloat16* A;
  std::int64_t lda;
  const __nv_bfloat16* B;
  std::int64_t ldb;
  void* C;
  std::int64_t ldc;
  cudaDataType ctype;
  float beta;
  double flops() const { return 2.0 * double(m) * double(n) * double(k); }
  std::int64_t elements() const { return m * n; }  // C is dense (ldc = m) in every shape here
  bool f32() const { return ctype == CUDA_R_32F; }
};

struct Candidate {
  std::string name;
  std::function<void()> run;  // enqueues one GEMM on the bench's stream
};

// ---------------------------------------------------------------------------------------------------------------
// Device helpers.

// fp32 counterpart of random_fill.cuh's fill_uniform (the same draws), for the fp32 accumulator's start.
__global__ void fill_uniform_f32(float* out, std::int64_t count, float scale, std::uint64_t seed) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < count;
       i += std::int64_t(gridDim.x) * blockDim.x)
    out[i] = scale * uniform_pm1(seed, i);
}

// The sampled positions: the last `tail` elements (the residue tiles a kernel may skip), then hashed positions
// spread over the whole matrix; the same for every candidate of a shape.
__host__ __device__ inline std::int64_t sample_index(int s, int tail, std::int64_t total) {
  if (s < tail) return total - 1 - s;
  return static_cast<std::int64_t>(splitmix64(0x5eedull, static_cast<std::uint64_t>(s)) % static_cast<std::uint64_t>(total));
}

// Copies the sampled elements of a dense bf16 or fp32 matrix out as floats (one thread per sample).
__global__ void gather_sample(const void* out, bool f32, std::int64_t total, int count, int tail, float* sample) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= count) return;
  const std::int64_t i = sample_index(s, tail, total);
  sample[s] = f32 ? static_cast<const float*>(out)[i] : __bfloat162float(static_cast<const __nv_bfloat16*>(out)[i]);
}

void fill_bf16(__nv_bfloat16* p, std::int64_t rows, std::int64_t cols, float scale, std::uint64_t seed,
               cudaStream_t stream) {
  fill_uniform<<<4096, 256, 0, stream>>>(p, rows, cols, cols, scale, seed);
  SIMPO_CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------------------------
// cuBLAS and cuBLASLt.

void cublas_default(cublasHandle_t blas, const Problem& p) {
  const float one = 1.0f;
  SIMPO_CUBLAS_CHECK(cublasGemmEx(blas, p.ta, p.tb, int(p.m), int(p.n), int(p.k), &one, p.A, CUDA_R_16BF, int(p.lda),
                                  p.B, CUDA_R_16BF, int(p.ldb), &p.beta, p.C, p.ctype, int(p.ldc), CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
}

// cublasLt's tile and cluster enums by name, for the tiles a Hopper bf16 kernel uses; others print as their id.
#define SIMPO_LT_TILES(X)                                                                                           \
  X(64x64) X(64x96) X(64x128) X(64x192) X(64x256) X(96x64) X(96x128) X(128x64) X(128x96) X(128x128) X(128x160)    \
  X(128x192) X(128x256) X(160x128) X(192x64) X(192x128) X(192x192) X(192x256) X(256x64) X(256x128) X(256x192)
#define SIMPO_LT_CLUSTERS(X) X(1x1x1) X(2x1x1) X(4x1x1) X(1x2x1) X(2x2x1) X(1x4x1) X(4x2x1) X(2x4x1)

std::string lt_tile_name(std::uint32_t id) {
#define SIMPO_TILE_CASE(t) \
  if (id == CUBLASLT_MATMUL_TILE_##t) return #t;
  SIMPO_LT_TILES(SIMPO_TILE_CASE)
#undef SIMPO_TILE_CASE
  return id == CUBLASLT_MATMUL_TILE_UNDEFINED ? "auto" : "#" + std::to_string(id);
}
std::string lt_cluster_name(std::uint16_t id) {
#define SIMPO_CLUSTER_CASE(c) \
  if (id == CUBLASLT_CLUSTER_SHAPE_##c) return #c;
  SIMPO_LT_CLUSTERS(SIMPO_CLUSTER_CASE)
#undef SIMPO_CLUSTER_CASE
  return id == CUBLASLT_CLUSTER_SHAPE_AUTO ? "auto" : "#" + std::to_string(id);
}

// What an algorithm's configuration says (kernel id, tile, stages, split-k, swizzle, cluster).
std::string lt_algo_name(const cublasLtMatmulAlgo_t& algo) {
  std::int32_t id = -1, splitk = 0;
  std::uint32_t tile = 0, stages = 0, swizzle = 0;
  std::uint16_t cluster = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), nullptr);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), nullptr);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), nullptr);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), nullptr);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle), nullptr);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster),
                                       nullptr);
  return "algo " + std::to_string(id) + " tile " + lt_tile_name(tile) + " stages#" + std::to_string(stages) +
         " splitk " + std::to_string(splitk) + " swz " + std::to_string(swizzle) + " cluster " +
         lt_cluster_name(cluster);
}

// One problem's matmul descriptors; they live as long as the candidates that use them.
struct LtProblem {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  LtProblem(const Problem& p) {
    SIMPO_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    SIMPO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &p.ta, sizeof(p.ta)));
    SIMPO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &p.tb, sizeof(p.tb)));
    // Layouts are of the stored matrices: op(A) is m x k, so A is k x m when transposed.
    const bool na = p.ta == CUBLAS_OP_N, nb = p.tb == CUBLAS_OP_N;
    SIMPO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, na ? p.m : p.k, na ? p.k : p.m, p.lda));
    SIMPO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, nb ? p.k : p.n, nb ? p.n : p.k, p.ldb));
    SIMPO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, p.ctype, p.m, p.n, p.ldc));
  }
  ~LtProblem() {
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatmulDescDestroy(desc);
  }
  LtProblem(const LtProblem&) = delete;
  LtProblem& operator=(const LtProblem&) = delete;
};

// One algorithm on one problem.
struct LtRun {
  cublasLtHandle_t lt;
  std::shared_ptr<LtProblem> problem;
  cublasLtMatmulAlgo_t algo;
  const void *A, *B;
  void* C;
  float beta;
  void* workspace;
  std::size_t workspace_bytes;
  cudaStream_t stream;
  void operator()() const {
    const float one = 1.0f;
    SIMPO_CUBLAS_CHECK(cublasLtMatmul(lt, problem->desc, &one, A, problem->a, B, problem->b, &beta, C, problem->c, C,
                                      problem->c, &algo, workspace, workspace_bytes, stream));
  }
};

std::vector<Candidate> lt_candidates(cublasLtHandle_t lt, const Problem& p, int requested, void* workspace,
                                     std::size_t workspace_bytes, cudaStream_t stream) {
  auto shared = std::make_shared<LtProblem>(p);
  cublasLtMatmulPreference_t pref;
  SIMPO_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  SIMPO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &workspace_bytes, sizeof(workspace_bytes)));
  // A plain array: nvcc's front end fails (an internal error) on a std::vector of this struct.
  std::unique_ptr<cublasLtMatmulHeuristicResult_t[]> results(new cublasLtMatmulHeuristicResult_t[requested]());
  int returned = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(lt, shared->desc, shared->a, shared->b, shared->c,
                                                               shared->c, pref, requested, results.get(), &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  std::vector<Candidate> out;
  if (status != CUBLAS_STATUS_SUCCESS) {
    std::printf("  cublasLt heuristic: %s\n", cublasGetStatusString(status));
    return out;
  }
  for (int i = 0; i < returned; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    out.push_back({"lt#" + std::to_string(i) + " " + lt_algo_name(results[i].algo),
                   LtRun{lt, shared, results[i].algo, p.A, p.B, p.C, p.beta, workspace, workspace_bytes, stream}});
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// CUTLASS sm_90a kernels. The row-major problem D[Mc, Nc] = A[Mc, K] B[K, Nc] (+ C) is the column-major one above
// transposed: Mc = n, Nc = m, CUTLASS's A is cuBLAS's B and the other way round. Layouts per shape:
//   logits   A = X  [M, H] k-contiguous (RowMajor), B = W [V, H] k-contiguous (ColumnMajor as a K x N operand)
//   grad_x   A = dZ [M, V] RowMajor, B = W [K = V, N = H] n-contiguous (RowMajor)
//   grad_W   A = dZ^T [V, M] m-contiguous (ColumnMajor), B = X [K = M, N = H] RowMajor; C = D = dW
#if defined(SIMPO_HAVE_CUTLASS_SM90)
// No `using namespace cute` here: with it, nvcc's generated stubs find two anonymous namespaces (ours, cute's).
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
using PingEpi = cutlass::epilogue::TmaWarpSpecialized;

// A tile, a cluster and a schedule. Cooperative: both consumer warpgroups share one tile (M split in two);
// ping-pong: each warpgroup owns a tile and their epilogues overlap the other's mainloop.
template <int TM, int TN, int CM, int CN, class Schedule_, class Epi_>
struct Config {
  using Tile = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::_64>;
  using Cluster = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;
  using Schedule = Schedule_;
  using Epi = Epi_;
  static std::string name() {
    return std::string(std::is_same_v<Schedule, Coop> ? "coop " : "pingpong ") + std::to_string(TM) + "x" +
           std::to_string(TN) + "x64 cluster " + std::to_string(CM) + "x" + std::to_string(CN);
  }
};
using Coop128x256c2x1 = Config<128, 256, 2, 1, Coop, CoopEpi>;
using Coop128x256c1x2 = Config<128, 256, 1, 2, Coop, CoopEpi>;
using Coop256x128c2x1 = Config<256, 128, 2, 1, Coop, CoopEpi>;
using Coop128x192c1x1 = Config<128, 192, 1, 1, Coop, CoopEpi>;
using Ping128x128c1x2 = Config<128, 128, 1, 2, Ping, PingEpi>;
using Ping128x128c1x1 = Config<128, 128, 1, 1, Ping, PingEpi>;
using Ping64x256c1x1 = Config<64, 256, 1, 1, Ping, PingEpi>;

// 16-byte accesses; a void C (no source) takes D's.
template <class T, class D>
constexpr int alignment() {
  if constexpr (std::is_void_v<T>) return 16 / static_cast<int>(sizeof(D));
  else return 16 / static_cast<int>(sizeof(T));
}

template <class LayoutA, class LayoutB, class ElementC, class ElementD, class Cfg>
struct Sm90Gemm {
  using Element = cutlass::bfloat16_t;
  using Source = ElementC;  // void: no C operand (beta = 0)
  using LayoutD = cutlass::layout::RowMajor;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD, alignment<ElementC, ElementD>(),
      ElementD, LayoutD, alignment<ElementD, ElementD>(), typename Cfg::Epi>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8, float,
      typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;

// A dense operand's stride for modes (mode0, mode1, batch): the dynamic one of the first two is the other's extent
// (CUTLASS's tools/util make_cute_packed_stride, which the pinned headers do not ship).
template <class S>
S packed_stride(std::int64_t mode0, std::int64_t mode1) {
  S s{};
  if constexpr (cute::is_constant<1, cute::remove_cvref_t<decltype(cute::get<1>(s))>>::value) cute::get<0>(s) = mode1;
  else cute::get<1>(s) = mode0;
  cute::get<2>(s) = mode0 * mode1;
  return s;
}

// One kernel at one rasterization: the adapter initialized once (arguments, TMA descriptors), then run as is.
template <class G>
std::string make_cutlass(const Problem& p, int swizzle, Raster raster, cudaStream_t stream, Candidate& out) {
  using Gemm = typename G::Gemm;
  using Kernel = typename G::Kernel;
  using Source = typename G::Source;
  using ElementD = typename Gemm::ElementD;
  const int M = int(p.n), N = int(p.m), K = int(p.k);
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {M, N, K, 1};
  args.mainloop.ptr_A = reinterpret_cast<const cutlass::bfloat16_t*>(p.B);
  args.mainloop.dA = packed_stride<typename Kernel::StrideA>(M, K);
  args.mainloop.ptr_B = reinterpret_cast<const cutlass::bfloat16_t*>(p.A);
  args.mainloop.dB = packed_stride<typename Kernel::StrideB>(N, K);
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = p.beta;
  if constexpr (!std::is_void_v<Source>) args.epilogue.ptr_C = static_cast<const Source*>(p.C);
  args.epilogue.dC = packed_stride<typename Kernel::StrideC>(M, N);
  args.epilogue.ptr_D = static_cast<ElementD*>(p.C);
  args.epilogue.dD = packed_stride<typename Kernel::StrideD>(M, N);
  int device = 0;
  SIMPO_CUDA_CHECK(cudaGetDevice(&device));
  args.hw_info = {device, cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device)};
  args.scheduler.max_swizzle_size = swizzle;
  args.scheduler.raster_order = raster;

  auto gemm = std::make_shared<Gemm>();
  cutlass::Status status = gemm->can_implement(args);
  if (status != cutlass::Status::kSuccess)
    return std::string("cannot implement: ") + cutlass::cutlassGetStatusString(status);
  auto workspace = std::make_shared<DeviceBuffer>(std::max<std::size_t>(Gemm::get_workspace_size(args), 16),
                                                  "CUTLASS workspace");
  status = gemm->initialize(args, workspace->get(), stream);
  if (status != cutlass::Status::kSuccess)
    return std::string("initialize: ") + cutlass::cutlassGetStatusString(status);
  out.run = [gemm, workspace, stream] {
    const cutlass::Status s = gemm->run(stream);
    if (s != cutlass::Status::kSuccess) throw CudaError(std::string("CUTLASS run: ") + cutlass::cutlassGetStatusString(s));
    SIMPO_CUDA_CHECK_LAUNCH();
  };
  return "";
}

struct KernelFactory {
  std::string name;
  std::string (*make)(const Problem&, int, Raster, cudaStream_t, Candidate&);
};

template <class LayoutA, class LayoutB, class ElementC, class ElementD, class... Cfgs>
std::vector<KernelFactory> kernels() {
  return {KernelFactory{Cfgs::name(), &make_cutlass<Sm90Gemm<LayoutA, LayoutB, ElementC, ElementD, Cfgs>>}...};
}

// The instantiated kernels per shape (each one is a compile of its own: a handful; the bf16 shapes get more).
std::vector<KernelFactory> cutlass_kernels(Kind kind) {
  using Row = cutlass::layout::RowMajor;
  using Col = cutlass::layout::ColumnMajor;
  using bf16 = cutlass::bfloat16_t;
  switch (kind) {
    case Kind::logits_bf16:
      return kernels<Row, Col, void, bf16, Coop128x256c2x1, Coop128x256c1x2, Coop256x128c2x1, Coop128x192c1x1,
                     Ping128x128c1x2>();
    case Kind::logits_f32: return kernels<Row, Col, void, float, Coop128x256c1x2, Coop128x192c1x1>();
    case Kind::grad_x:
      return kernels<Row, Row, void, bf16, Coop128x256c2x1, Coop128x256c1x2, Coop256x128c2x1, Ping128x128c1x2>();
    // The accumulator's read and write per tile is what a cooperative kernel does not overlap with its MMAs; a
    // ping-pong kernel runs one warpgroup's epilogue under the other's mainloop.
    case Kind::grad_x_f32:
      return kernels<Row, Row, float, float, Coop128x256c1x2, Ping128x128c1x2, Ping128x128c1x1, Ping64x256c1x1>();
    case Kind::grad_w_bf16:
      return kernels<Col, Row, bf16, bf16, Coop128x256c2x1, Coop128x256c1x2, Coop256x128c2x1, Ping128x128c1x2>();
    case Kind::grad_w_f32: return kernels<Col, Row, float, float, Coop128x256c2x1, Coop256x128c2x1>();
  }
  return {};
}

std::vector<Candidate> cutlass_candidates(const Problem& p, bool quick, cudaStream_t stream) {
  std::vector<Candidate> out;
  int major = 0, device = 0;
  SIMPO_CUDA_CHECK(cudaGetDevice(&device));
  SIMPO_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major != 9) {
    std::printf("  cutlass: skipped (sm_90a kernels; this device is sm_%d)\n", major * 10);
    return out;
  }
  struct Order {
    Raster raster;
    const char* name;
  };
  std::vector<Order> orders = {{Raster::AlongN, "N"}, {Raster::AlongM, "M"}};
  std::vector<int> swizzles = {1, 2, 4, 8};
  if (quick) {
    orders = {{Raster::Heuristic, "heur"}};
    swizzles = {1};
  }
  for (const KernelFactory& f : cutlass_kernels(p.kind))
    for (const Order& o : orders)
      for (int s : swizzles) {
        Candidate c{"cutlass " + f.name + " raster " + o.name + " swz " + std::to_string(s), {}};
        const std::string why = f.make(p, s, o.raster, stream, c);
        if (!why.empty()) std::printf("  %-64s skipped: %s\n", c.name.c_str(), why.c_str());
        else out.push_back(std::move(c));
      }
  return out;
}
#else
std::vector<Candidate> cutlass_candidates(const Problem&, bool, cudaStream_t) {
  std::printf("  cutlass: not built (needs CUTLASS 3 headers and an sm_90a target)\n");
  return {};
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// Checks.

// Max |a - b| over the sample divided by max |b| (b: the reference); NaN or inf anywhere reads as infinite.
double sample_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return scale > 0 ? diff / scale : std::numeric_limits<double>::infinity();
}

// `count` bf16 values from `base` at `stride`-element steps (a row or a column of an operand), as floats.
__global__ void gather_strided(const __nv_bfloat16* base, std::int64_t stride, std::int64_t count, float* out) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < count;
       i += std::int64_t(gridDim.x) * blockDim.x)
    out[i] = __bfloat162float(base[i * stride]);
}

std::vector<double> fetch_vector(const __nv_bfloat16* base, std::int64_t stride, std::int64_t count) {
  DeviceBuffer dev(count * 4, "host check vector");
  gather_strided<<<256, 256>>>(base, stride, count, dev.as<float>());
  SIMPO_CUDA_CHECK_LAUNCH();
  std::vector<float> raw(count);
  SIMPO_CUDA_CHECK(cudaMemcpy(raw.data(), dev.get(), count * 4, cudaMemcpyDeviceToHost));
  return std::vector<double>(raw.begin(), raw.end());
}

// cuBLAS's default against fp64 on the host at the first `count` hashed sample positions (start: C's sampled
// values before the GEMM, for beta = 1): a wrong operand description in the reference itself fails here.
double reference_error(const Problem& p, const std::vector<float>& start, const std::vector<float>& ref, int tail,
                       int count) {
  double diff = 0, scale = 0;
  for (int s = tail; s < tail + count && s < int(ref.size()); ++s) {
    const std::int64_t idx = sample_index(s, tail, p.elements());
    const std::int64_t i = idx % p.ldc, j = idx / p.ldc;  // C[i, j], column-major
    // Row i of op(A) and column j of op(B).
    const auto a = p.ta == CUBLAS_OP_N ? fetch_vector(p.A + i, p.lda, p.k) : fetch_vector(p.A + i * p.lda, 1, p.k);
    const auto b = p.tb == CUBLAS_OP_N ? fetch_vector(p.B + j * p.ldb, 1, p.k) : fetch_vector(p.B + j, p.ldb, p.k);
    double exact = p.beta != 0.0f ? p.beta * double(start[s]) : 0.0;  // start is NaN where beta = 0
    for (std::int64_t l = 0; l < p.k; ++l) exact += a[l] * b[l];
    diff = std::max(diff, std::abs(ref[s] - exact));
    scale = std::max(scale, std::abs(exact));
    if (!std::isfinite(ref[s])) return std::numeric_limits<double>::infinity();
  }
  return scale > 0 ? diff / scale : std::numeric_limits<double>::infinity();
}

const char* shape_names[] = {"logits_bf16", "logits_f32", "grad_x", "grad_x_f32", "grad_w_bf16", "grad_w_f32"};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The best GEMM this card runs on each of the fused step's GEMM shapes (cuBLAS, every cuBLASLt "
               "heuristic algorithm, CUTLASS sm_90a), checked against cuBLAS's default"};
  std::vector<std::int64_t> rows = {2048, 4096};
  const std::vector<std::string> all_shapes(std::begin(shape_names), std::end(shape_names));
  std::vector<std::string> shapes = all_shapes;
  std::int64_t H = 4096, V = 128256, peak_n = 8192;
  int warmup = 3, reps = 10, lt_algos = 32, lt_workspace_mib = 64;
  bool quick = false, full = false;
  app.add_option("--M", rows, "rows of a chunk (B*T for the whole batch); a list")->capture_default_str();
  app.add_flag("--full", full, "M = 2048 4096 8192 16384 (B*T at B = 2..16, T = 1024)");
  app.add_option("--shapes", shapes, "which GEMMs")->check(CLI::IsMember(all_shapes))->capture_default_str();
  app.add_option("--H", H, "hidden size")->capture_default_str();
  app.add_option("--V", V, "vocabulary")->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions (the median is reported)")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed repetitions first")->capture_default_str();
  app.add_option("--lt-algos", lt_algos, "algorithms asked of cublasLtMatmulAlgoGetHeuristic")->capture_default_str();
  app.add_option("--lt-workspace-mib", lt_workspace_mib, "cuBLASLt's workspace")->capture_default_str();
  app.add_option("--peak-n", peak_n, "the square bf16 GEMM timed as the device's peak (0: none)")->capture_default_str();
  app.add_flag("--quick", quick, "a smoke run: the first M only, 8 cuBLASLt algorithms, CUTLASS at its heuristic "
                                 "rasterization only, 3 reps");
  CLI11_PARSE(app, argc, argv);
  if (full) rows = {2048, 4096, 8192, 16384};
  if (quick) {
    rows.resize(1);
    lt_algos = std::min(lt_algos, 8);
    reps = std::min(reps, 3);
  }
  if (H % 8 != 0 || V % 8 != 0) {
    std::fprintf(stderr, "gemm_floor: H and V must be multiples of 8 (dense 16-byte rows)\n");
    return 2;
  }
  constexpr int sample_count = 65536, sample_tail = 1024, host_checked = 8;

  try {
    cudaDeviceProp prop{};
    SIMPO_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    int clock_khz = 0;
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
    std::printf("device: %s, sm_%d%d, %d SMs, %.1f GiB, L2 %d MiB, max SM clock %d MHz; H=%lld V=%lld; median of %d "
                "after %d warm-up, each in turns with cuBLAS's default\n",
                prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0,
                prop.l2CacheSize >> 20, clock_khz / 1000, (long long)H, (long long)V, reps, warmup);
    cudaStream_t stream;
    SIMPO_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cublasHandle_t blas;
    SIMPO_CUBLAS_CHECK(cublasCreate(&blas));
    SIMPO_CUBLAS_CHECK(cublasSetStream(blas, stream));
    cublasLtHandle_t lt;
    SIMPO_CUBLAS_CHECK(cublasLtCreate(&lt));
    DeviceBuffer lt_workspace(std::size_t(lt_workspace_mib) << 20, "cuBLASLt workspace");

    // The device's measured peak: cuBLAS's default on a large square bf16 GEMM.
    double peak_tflops = 0;
    if (peak_n > 0) {
      const std::int64_t n = peak_n;
      DeviceBuffer a(n * n * 2, "peak A"), b(n * n * 2, "peak B"), c(n * n * 2, "peak C");
      fill_bf16(a.as<__nv_bfloat16>(), n, n, 1.0f, 11, stream);
      fill_bf16(b.as<__nv_bfloat16>(), n, n, 1.0f, 12, stream);
      Problem sq{Kind::logits_bf16, "peak", "", CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, a.as<__nv_bfloat16>(), n,
                 b.as<__nv_bfloat16>(), n, c.get(), n, CUDA_R_16BF, 0.0f};
      const double ms = time_interleaved(stream, warmup, reps, {[&] { cublas_default(blas, sq); }})[0].median_ms;
      peak_tflops = sq.flops() / ms / 1e9;
      std::printf("peak: cuBLAS bf16 %lld^3 %.3f ms, %.1f TFLOP/s\n", (long long)n, ms, peak_tflops);
      std::printf("JSON {\"bench\": \"gemm_floor\", \"peak\": true, \"n\": %lld, \"ms\": %.4f, \"tflops\": %.1f}\n",
                  (long long)n, ms, peak_tflops);
    }

    for (const std::int64_t M : rows) {
      // Operands: x ~ U(-sqrt3, sqrt3), W for logits of standard deviation ~2 (as cuda_bench), dz small (a
      // softmax gradient's scale), the accumulators' start of the size of one chunk's contribution.
      DeviceBuffer x(M * H * 2, "x"), w(V * H * 2, "W"), dz(M * V * 2, "dz");
      const std::size_t out_bytes = std::max<std::size_t>(M * V, V * H) * 4;
      DeviceBuffer out(out_bytes, "GEMM output"), sample_dev(sample_count * 4, "sample");
      fill_bf16(x.as<__nv_bfloat16>(), M, H, 1.7320508f, 1, stream);
      fill_bf16(w.as<__nv_bfloat16>(), V, H, static_cast<float>(std::sqrt(3.0 * 4.0 / H)), 2, stream);
      fill_bf16(dz.as<__nv_bfloat16>(), M, V, 1e-3f, 4, stream);
      const float start_scale = 0.03f;
      auto* X = x.as<__nv_bfloat16>();
      auto* W = w.as<__nv_bfloat16>();
      auto* DZ = dz.as<__nv_bfloat16>();

      for (const std::string& shape : shapes) {
        Problem p;
        if (shape == "logits_bf16" || shape == "logits_f32") {
          const bool f32 = shape == "logits_f32";
          p = {f32 ? Kind::logits_f32 : Kind::logits_bf16, shape,
               std::string("Z[M, V] = X W^T, ") + (f32 ? "fp32" : "bf16") + " out", CUBLAS_OP_T, CUBLAS_OP_N, V, M,
               H, W, H, X, H, out.get(), V, f32 ? CUDA_R_32F : CUDA_R_16BF, 0.0f};
        } else if (shape == "grad_x" || shape == "grad_x_f32") {
          const bool f32 = shape == "grad_x_f32";
          p = {f32 ? Kind::grad_x_f32 : Kind::grad_x, shape,
               f32 ? "dX[M, H] += dZ W, fp32 accumulator" : "dX[M, H] = dZ W, bf16 out", CUBLAS_OP_N, CUBLAS_OP_N, H,
               M, V, W, H, DZ, V, out.get(), H, f32 ? CUDA_R_32F : CUDA_R_16BF, f32 ? 1.0f : 0.0f};
        } else {
          const bool f32 = shape == "grad_w_f32";
          p = {f32 ? Kind::grad_w_f32 : Kind::grad_w_bf16, shape,
               std::string("dW[V, H] += dZ^T X, ") + (f32 ? "fp32" : "bf16") + " accumulator", CUBLAS_OP_N,
               CUBLAS_OP_T, H, V, M, X, H, DZ, V, out.get(), H, f32 ? CUDA_R_32F : CUDA_R_16BF, 1.0f};
        }
        const bool accumulate = p.beta != 0.0f;
        // Before a checked run: NaN everywhere (0xff bytes), or the accumulator's same random start.
        auto reset = [&] {
          if (!accumulate) SIMPO_CUDA_CHECK(cudaMemsetAsync(p.C, 0xff, p.elements() * (p.f32() ? 4 : 2), stream));
          else if (p.f32()) {
            fill_uniform_f32<<<4096, 256, 0, stream>>>(static_cast<float*>(p.C), p.elements(), start_scale, 5);
            SIMPO_CUDA_CHECK_LAUNCH();
          } else
            fill_bf16(static_cast<__nv_bfloat16*>(p.C), V, H, start_scale, 5, stream);
        };
        auto sample = [&] {
          gather_sample<<<(sample_count + 255) / 256, 256, 0, stream>>>(p.C, p.f32(), p.elements(), sample_count,
                                                                         sample_tail, sample_dev.as<float>());
          SIMPO_CUDA_CHECK_LAUNCH();
          std::vector<float> host(sample_count);
          SIMPO_CUDA_CHECK(cudaMemcpyAsync(host.data(), sample_dev.get(), sample_count * 4, cudaMemcpyDeviceToHost,
                                           stream));
          SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
          return host;
        };
        const double tolerance = p.f32() ? 1e-3 : 1e-2;

        std::printf("\n== %s M=%lld: %s (m=%lld n=%lld k=%lld, %.2f TFLOP)\n", p.name.c_str(), (long long)M,
                    p.formula.c_str(), (long long)p.m, (long long)p.n, (long long)p.k, p.flops() / 1e12);
        reset();
        const std::vector<float> start = sample();
        cublas_default(blas, p);
        const std::vector<float> ref = sample();
        const double ref_error = reference_error(p, start, ref, sample_tail, host_checked);
        std::printf("  cublas default against fp64 on %d elements: %.2e (max |diff| / max |exact|)%s\n", host_checked,
                    ref_error, ref_error > tolerance ? "  REFERENCE WRONG: nothing below is checked" : "");

        std::vector<Candidate> candidates;
        candidates.push_back({"cublas default", [&] { cublas_default(blas, p); }});
        for (auto& c : lt_candidates(lt, p, lt_algos, lt_workspace.get(), lt_workspace.bytes(), stream))
          candidates.push_back(std::move(c));
        for (auto& c : cutlass_candidates(p, quick, stream)) candidates.push_back(std::move(c));

        std::printf("  %-70s %9s %8s %8s %9s\n", "candidate", "ms", "TFLOP/s", "/cublas", "max diff");
        std::string best_name;
        double best_ms = 0, best_ratio = 0;
        for (const Candidate& c : candidates) {
          double diff = 0;
          try {
            reset();
            c.run();
            diff = sample_difference(sample(), ref);
          } catch (const std::exception& e) {
            std::printf("  %-70s FAILED: %s\n", c.name.c_str(), e.what());
            SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
            continue;
          }
          if (!(diff <= tolerance) || !(ref_error <= tolerance)) {
            std::printf("  %-70s REJECTED: max diff %.2e from cuBLAS's default (tolerance %.0e)\n", c.name.c_str(),
                        diff, tolerance);
            std::printf("JSON {\"bench\": \"gemm_floor\", \"shape\": \"%s\", \"M\": %lld, \"candidate\": \"%s\", "
                        "\"ok\": false, \"max_diff\": %.3e}\n",
                        p.name.c_str(), (long long)M, c.name.c_str(), diff);
            continue;
          }
          const auto t = time_interleaved(stream, warmup, reps, {c.run, [&] { cublas_default(blas, p); }});
          const double ms[2] = {t[0].median_ms, t[1].median_ms};
          const double tflops = p.flops() / ms[0] / 1e9, ratio = ms[0] / ms[1];
          std::printf("  %-70s %9.3f %8.1f %8.3f %9.2e\n", c.name.c_str(), ms[0], tflops, ratio, diff);
          std::printf("JSON {\"bench\": \"gemm_floor\", \"shape\": \"%s\", \"M\": %lld, \"m\": %lld, \"n\": %lld, "
                      "\"k\": %lld, \"candidate\": \"%s\", \"ok\": true, \"ms\": %.4f, \"tflops\": %.1f, "
                      "\"cublas_ms\": %.4f, \"ratio_cublas\": %.4f, \"max_diff\": %.3e, \"peak_tflops\": %.1f}\n",
                      p.name.c_str(), (long long)M, (long long)p.m, (long long)p.n, (long long)p.k, c.name.c_str(),
                      ms[0], tflops, ms[1], ratio, diff, peak_tflops);
          std::fflush(stdout);
          if (best_name.empty() || ms[0] < best_ms) {
            best_name = c.name;
            best_ms = ms[0];
            best_ratio = ratio;
          }
        }
        if (!best_name.empty())
          std::printf("FLOOR shape=%s M=%lld best=\"%s\" ms=%.4f tflops=%.1f ratio_cublas=%.3f peak_frac=%.3f\n",
                      p.name.c_str(), (long long)M, best_name.c_str(), best_ms, p.flops() / best_ms / 1e9, best_ratio,
                      peak_tflops > 0 ? p.flops() / best_ms / 1e9 / peak_tflops : 0.0);
        std::fflush(stdout);
      }
    }
    cublasLtDestroy(lt);
    cublasDestroy(blas);
    SIMPO_CUDA_CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gemm_floor: %s\n", e.what());
    return 1;
  }
  return 0;
}
