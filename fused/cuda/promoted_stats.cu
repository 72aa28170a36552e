// The promoted logits GEMM with the row statistics in its epilogue (promoted_stats.h). The mainloop is
// promoted_gemm.cu's default (128x192x64 tile, CUTLASS's FP8-style promotion with bf16 operands, the two
// warpgroups promoting out of step: promoted_mainloop.cuh), inside a kernel of this file's own
// (HandoffStatsKernel) whose epilogue runs beside the next tile's wgmmas: the consumers leave each accumulator
// tile in shared memory, and the producer warpgroup's three idle warps reduce its rows there (a max, then one
// exp per logit against it, a sum; one lane per row writes the tile's partials) and, for the full step, store
// the fp32 logits. Before it: CUTLASS's cooperative kernel with the reduction in its epilogue (a visitor node,
// then the registers), whose epilogue the tensor cores waited for (BENCHMARKS.md, second and fifth rounds).
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/promoted_gemm.h"
#include "fused/cuda/promoted_stats.h"

#include <algorithm>
#include <string>

#if defined(SIMPO_HAVE_CUTLASS_SM90)
#include "cute/tensor.hpp"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "fused/cuda/promoted_mainloop.cuh"
#endif

namespace simpo::fused::cuda {

#if defined(SIMPO_HAVE_CUTLASS_SM90)
namespace {

using namespace cute;

// The consumers hand each finished accumulator tile to the epilogue warps through this buffer, row-major. Rows
// are padded to 208 floats (832 B, half a bank cycle past a multiple of 128 B): the epilogue's reads (two rows
// of 64 contiguous bytes per half-warp) are free of bank conflicts and the consumers' 8-byte stores (the wgmma
// layout: 4 rows of 32 bytes per half-warp) conflict two-way, ~200 cycles a tile against its ~49,000 of wgmmas.
template <int kTileM, int kTileN>
struct TileBuffer {
  static constexpr int kStride = kTileN + 16;
  alignas(16) float values[kTileM * kStride];
  alignas(16) float bias[kTileN];  // the tile's bias (kBias), loaded once per tile by the epilogue warps
};

// A consumer thread's accumulators into the buffer: in the wgmma layout values i and i + 1 (i even) are one
// row's two adjacent columns, so each pair is one 8-byte store.
template <int kStride, class Accumulators, class Coords>
CUTLASS_DEVICE void stash_tile(Accumulators const& acc, Coords const& coords, float* buffer) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const int row = get<0>(coords(i)), column = get<1>(coords(i));
    *reinterpret_cast<float2*>(buffer + row * kStride + column) = make_float2(acc(i), acc(i + 1));
  }
}

// exp(x) for x <= 0 as ex2.approx(x log2 e): its error, ~2 ulp plus |x| ulp of the argument's rounding, is
// relative to the term, and the sum of exp is dominated by the terms near the max, where it is ~2 ulp.
CUTLASS_DEVICE float fast_exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// One tile's row statistics from the buffer (and its fp32 logits to global memory when `logits` is given), by
// the epilogue warps: eight lanes per row, four rows per warp at a time; lane g of a row's eight holds columns
// 2g, 2g + 1 of every 16. Two passes over the buffer (the max, then one exp per logit against it, the sum of exp
// and of z) keep the registers to a handful (the producer warpgroup has 40); three shuffles merge a row's lanes.
template <int kTileM, int kTileN, bool kBias>
CUTLASS_DEVICE void reduce_tile(TileBuffer<kTileM, kTileN> const& tile, int first_row, int row_step, int lane,
                                int m_tile, int n_tile, int M, int N, LogitTileStats const& stats, float* logits,
                                std::int64_t ld_logits) {
  constexpr int kStride = TileBuffer<kTileM, kTileN>::kStride;
  constexpr int kSteps = kTileN / 16;  // float2 per lane per row
  static_assert(kTileN % 16 == 0, "reduce_tile: 8 lanes of 2 columns");
  const int m0 = m_tile * kTileM, n0 = n_tile * kTileN;
  const int rows = cute::min(kTileM, M - m0);
  const int g = lane % 8;
  const int columns = cute::min(kTileN, N - n0);  // a multiple of 4: a pair is whole or absent
  for (int base = first_row; base < rows; base += row_step) {  // every lane of the warp goes round together
    const int r = cute::min(base + lane / 8, rows - 1);        // the tail's idle lanes repeat the last row
    const bool active = base + lane / 8 < rows;
    const int row = m0 + r;
    const std::int64_t t = stats.target[row];
    const float* values = tile.values + r * kStride + 2 * g;
    auto logit = [&](int step, int c) {
      float z = values[16 * step + c];
      if constexpr (kBias) z += tile.bias[16 * step + 2 * g + c];
      return z;
    };
    float row_max = -INFINITY;
    CUTLASS_PRAGMA_UNROLL
    for (int step = 0; step < kSteps; ++step)
      if (16 * step + 2 * g < columns) row_max = fmaxf(row_max, fmaxf(logit(step, 0), logit(step, 1)));
    CUTLASS_PRAGMA_UNROLL
    for (int lanes = 1; lanes < 8; lanes *= 2) row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, lanes));

    float sum_exp = 0.0f, sum = 0.0f;
    float* out = logits != nullptr ? logits + static_cast<std::int64_t>(row) * ld_logits + n0 + 2 * g : nullptr;
    const std::int64_t t_local = t - n0;  // the target's column in this tile, when it is one
    CUTLASS_PRAGMA_UNROLL
    for (int step = 0; step < kSteps; ++step) {
      const int column = 16 * step + 2 * g;
      if (column < columns) {
        if (out != nullptr && active)
          __stcs(reinterpret_cast<float2*>(out + 16 * step),
                 *reinterpret_cast<const float2*>(values + 16 * step));
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) {
          const float z = logit(step, c);
          sum_exp += fast_exp(z - row_max);
          sum += z;
          if (t_local == column + c && t != stats.ignore_index && active) stats.z_target[row] = z;
        }
      }
    }
    double total = sum;
    CUTLASS_PRAGMA_UNROLL
    for (int lanes = 1; lanes < 8; lanes *= 2) {
      sum_exp += __shfl_xor_sync(0xffffffffu, sum_exp, lanes);
      total += __shfl_xor_sync(0xffffffffu, total, lanes);
    }
    if (g == 0 && active) {
      const std::int64_t i = static_cast<std::int64_t>(n_tile) * stats.ld + row;
      stats.tile_max[i] = row_max;
      stats.tile_sum_exp[i] = sum_exp;
      stats.tile_sum[i] = total;
    }
  }
}

// The statistics GEMM: a persistent warp-specialized kernel of its own. Warp 0 issues CUTLASS's TMA loads; two
// consumer warpgroups compute one 128x192 tile (as CUTLASS's cooperative kernel) with StaggeredMainloop's
// promotion (a fresh block every `interval` k tiles, warpgroup 1 half an interval out of step), then leave the
// tile in shared memory and go on to the next tile; warps 1-3, idle in CUTLASS's kernels, reduce it there (and
// store the fp32 logits) while the tensor cores work on the next one. In CUTLASS's kernel the consumers ran the
// epilogue between two tiles' mainloops, so every cycle of it (the statistics, the fp32 store) left the tensor
// cores idle: 0.4-0.9 ms per 2048-row chunk (BENCHMARKS.md, fifth round). The price is shared memory: the
// 100 KiB buffer leaves three mainloop stages (120 KiB of loads in flight) where there were five. Tiles go M
// fastest, so the CTAs in flight share each W tile in L2.
// What the kernel gets (by value, in the parameter space: the TMA descriptors must be there).
template <class Collective>
struct StatsGemmParams {
  typename Collective::Params mainloop;
  int M = 0, N = 0, K = 0;
  LogitTileStats stats;
  float* logits = nullptr;  // nullptr: statistics only
  std::int64_t ld_logits = 0;
};

template <class Collective, class TileShape, bool kBias>
struct HandoffStatsKernel {
  using MainloopPipeline = typename Collective::MainloopPipeline;
  using PipelineState = typename Collective::PipelineState;
  using TiledMma = typename Collective::TiledMma;
  static constexpr int kTileM = decltype(size<0>(TileShape{}))::value;
  static constexpr int kTileN = decltype(size<1>(TileShape{}))::value;
  static constexpr int kTileK = decltype(size<2>(TileShape{}))::value;
  static constexpr std::uint32_t MaxThreadsPerBlock = 384;  // a producer warpgroup, two consumer warpgroups
  static constexpr std::uint32_t MinBlocksPerMultiprocessor = 1;
  static constexpr int kEpilogueWarps = 3;  // the producer warpgroup's warps 1-3
  static constexpr std::uint32_t kHandoffThreads = 256 + 32 * kEpilogueWarps;
  static_assert(size(TiledMma{}) == 256, "two consumer warpgroups");
  using Buffer = TileBuffer<kTileM, kTileN>;

  struct SharedStorage {
    typename Collective::TensorStorage tensors;
    alignas(16) typename Collective::PipelineStorage pipeline;
    Buffer tile;
  };
  static_assert(sizeof(SharedStorage) <= 227 * 1024, "the mainloop stages and the tile buffer must fit");

  using Params = StatsGemmParams<Collective>;

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    auto& shared = *reinterpret_cast<SharedStorage*>(smem);
    const int thread_idx = static_cast<int>(threadIdx.x);
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const int warp_group = cutlass::canonical_warp_group_idx();
    const int lane_predicate = cute::elect_one_sync();
    if (warp_idx == 0 && lane_predicate) Collective::prefetch_tma_descriptors(params.mainloop);

    typename MainloopPipeline::Params pipeline_params;
    if (warp_idx == 0) pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    if (warp_group > 0) pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    pipeline_params.is_leader = thread_idx % cutlass::NumThreadsPerWarpGroup == 0;
    pipeline_params.num_consumers = size(TiledMma{});
    pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline pipeline(shared.pipeline, pipeline_params, cute::Shape<_1, _1, _1>{});
    __syncthreads();  // the barriers are initialized before anyone waits on them

    const int tiles_m = (params.M + kTileM - 1) / kTileM;
    const int tiles = tiles_m * ((params.N + kTileN - 1) / kTileN);
    const int k_tiles = (params.K + kTileK - 1) / kTileK;
    // The handoff: the consumers arrive on `full` once a tile is in the buffer, the epilogue warps on `empty`
    // once they are done reading it (bar.arrive / bar.sync, PTX's producer-consumer pattern; both order the
    // shared-memory accesses around them).
    const cutlass::arch::NamedBarrier full(kHandoffThreads, 0), empty(kHandoffThreads, 1);
    const cutlass::arch::NamedBarrier epilogue(32 * kEpilogueWarps, 2);  // the epilogue warps alone
    Collective collective;

    if (warp_group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<40>();
      if (warp_idx == 0) {
        auto load_inputs = collective.load_init(make_shape(params.M, params.N, params.K, 1), params.mainloop);
        auto k_shape = shape<3>(get<0>(load_inputs));
        PipelineState write = cutlass::make_producer_start_state<MainloopPipeline>();
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
          collective.load(params.mainloop, pipeline, write, load_inputs,
                          make_coord(tile % tiles_m, tile / tiles_m, _, 0),
                          make_coord_iterator(idx2crd(0, k_shape), k_shape), k_tiles, cutlass::canonical_lane_idx(),
                          0u, shared.tensors);
          write.advance(k_tiles);
        }
        collective.load_tail(pipeline, write);
        return;
      }
      const int lane = cutlass::canonical_lane_idx();
      const int epilogue_thread = thread_idx - 32;
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        full.arrive_and_wait();
        const int m_tile = tile % tiles_m, n_tile = tile / tiles_m;
        if constexpr (kBias) {
          for (int c = epilogue_thread; c < kTileN; c += 32 * kEpilogueWarps) {
            const int column = n_tile * kTileN + c;
            shared.tile.bias[c] = column < params.N ? __bfloat162float(params.stats.bias[column]) : 0.0f;
          }
          epilogue.arrive_and_wait();
        }
        reduce_tile<kTileM, kTileN, kBias>(shared.tile, 4 * (warp_idx - 1), 4 * kEpilogueWarps, lane, m_tile,
                                           n_tile, params.M, params.N, params.stats, params.logits,
                                           params.ld_logits);
        if (tile + static_cast<int>(gridDim.x) < tiles) empty.arrive();
      }
      return;
    }

    cutlass::arch::warpgroup_reg_alloc<232>();
    const int mma_thread = thread_idx - cutlass::NumThreadsPerWarpGroup;
    TiledMma tiled_mma;
    auto fragments = consumer_fragments<Collective>(shared.tensors, mma_thread);
    const int consumer = get<0>(fragments);
    auto& tCrA = get<1>(fragments);  // (MMA, MMA_M, MMA_K, PIPE)
    auto& tCrB = get<2>(fragments);  // (MMA, MMA_N, MMA_K, PIPE)
    auto accum = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));  // the running sum
    auto block = make_fragment_like(accum);                                 // the block of k in flight
    // (row, column) in the tile of each accumulator.
    const auto coords = tiled_mma.get_thread_slice(mma_thread)
                            .partition_C(make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
    constexpr int kMmasPerKTile = decltype(size<2>(tCrA))::value;
    const int interval = cute::max(1, static_cast<int>(params.mainloop.mma_promotion_interval / kMmasPerKTile));
    // Warpgroup 0 promotes after every multiple of `interval` k tiles, warpgroup 1 half an interval later; the
    // k tiles until the next such point after `done` of them (never more than one interval: the block's bound).
    const int offset = consumer == 0 ? 0 : interval / 2;
    auto next_block = [&](int done) {
      const int left = ((offset - done) % interval + interval) % interval;
      return left == 0 ? interval : left;
    };

    PipelineState read, release;
    int released = 0, issued = 0;  // k tiles of this tile
    // Stages go back in order once their wgmmas are known done; never more than two are outstanding, so the
    // release is straight-line code (a loop here would make ptxas wait for the wgmmas in flight).
    auto release_to = [&](int count) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 2; ++i)
        if (released < count) {
          pipeline.consumer_release(release);
          ++release;
          ++released;
        }
    };

    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      int left = next_block(0);
      bool fresh = true;  // accum holds nothing of this tile yet
      released = issued = 0;
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTLASS_PRAGMA_NO_UNROLL
      for (int k_tile = 0; k_tile < k_tiles; ++k_tile) {
        auto token = pipeline.consumer_try_wait(read);
        pipeline.consumer_wait(read, token);
        warpgroup_fence_operand(block);
        warpgroup_arrive();
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < kMmasPerKTile; ++k) {
          cute::gemm(tiled_mma, tCrA(_, _, k, read.index()), tCrB(_, _, k, read.index()), block);
          tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        ++read;
        ++issued;
        if (--left == 0 || k_tile == k_tiles - 1) {  // the block closes: into the running sum
          warpgroup_wait<0>();
          warpgroup_fence_operand(block);
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(block); ++i) accum(i) = fresh ? block(i) : accum(i) + block(i);
          fresh = false;
          left = next_block(issued);
          tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
          release_to(issued);
        } else {
          warpgroup_wait<1>();  // all but this k tile's batch are done
          warpgroup_fence_operand(block);
          release_to(issued - 1);
        }
      }
      // Every path out of the loop promoted already; this says so to ptxas, which otherwise waits for all
      // wgmmas at the loop's exit and at each of its branches.
      warpgroup_wait<0>();
      if (tile != static_cast<int>(blockIdx.x)) empty.arrive_and_wait();  // the previous tile has been read
      stash_tile<Buffer::kStride>(accum, coords, shared.tile.values);
      full.arrive();
    }
#endif
  }
};

struct StatsGemm {
  using TileShape = cute::Shape<_128, _192, _64>;  // promoted_gemm.cu's variant 0
  using ClusterShape = cute::Shape<_1, _1, _1>;
  using Element = cutlass::bfloat16_t;
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  // The bf16 builder's tile layouts, TMA copies and wgmma atoms; shared memory but the tile buffer (and 1 KiB for
  // the barriers) goes to the mainloop stages.
  static constexpr int kCarveout = static_cast<int>(sizeof(TileBuffer<128, 192>)) + 1024;
  using Plain = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<kCarveout>, Schedule>::CollectiveOp;
  using Collective = PromotingCollective<Plain, TileShape, ClusterShape, Schedule>;
  template <bool kBias>
  using Kernel = HandoffStatsKernel<Collective, TileShape, kBias>;
  static constexpr int kMmaK = 16;
  static_assert(size<2>(TileShape{}) == promoted_k_granule, "promoted_k_granule is the k tile");

  template <bool kBias>
  static void launch(typename Kernel<kBias>::Params const& params, cudaStream_t stream) {
    using K = Kernel<kBias>;
    constexpr int smem = static_cast<int>(sizeof(typename K::SharedStorage));
    static const int sm_count = [] {
      SIMPO_CUDA_CHECK(cudaFuncSetAttribute(cutlass::device_kernel<K>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            smem));
      return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    }();
    const int tiles = ((params.M + K::kTileM - 1) / K::kTileM) * ((params.N + K::kTileN - 1) / K::kTileN);
    cutlass::device_kernel<K><<<std::min(tiles, sm_count), K::MaxThreadsPerBlock, smem, stream>>>(params);
    SIMPO_CUDA_CHECK_LAUNCH();
  }

  static void run(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                  const __nv_bfloat16* weight, float* logits, std::int64_t ld_logits, std::int64_t promotion_k,
                  const LogitTileStats& stats, cudaStream_t stream) {
    StatsGemmParams<Collective> params;
    params.M = static_cast<int>(rows);
    params.N = static_cast<int>(V);
    params.K = static_cast<int>(ld_h);
    params.stats = stats;
    params.logits = logits;
    params.ld_logits = ld_logits;
    const std::uint32_t interval =
        promotion_k > 0 ? static_cast<std::uint32_t>(promotion_k / kMmaK) : (std::uint32_t{1} << 30);
    typename Plain::StrideA stride_a{ld_h, Int<1>{}, 0};
    typename Plain::StrideB stride_b{ld_h, Int<1>{}, 0};
    const typename Collective::Arguments mainloop{reinterpret_cast<const Element*>(x), stride_a,
                                                  reinterpret_cast<const Element*>(weight), stride_b, interval};
    const auto problem = make_shape(params.M, params.N, params.K, 1);
    if (!Collective::can_implement(problem, mainloop))
      throw CudaError("promoted logits GEMM with statistics cannot run rows=" + std::to_string(rows) +
                      " V=" + std::to_string(V) + " ld_h=" + std::to_string(ld_h) + " (TMA alignment)");
    params.mainloop = Collective::to_underlying_arguments(problem, mainloop, nullptr);
    if (stats.bias != nullptr)
      launch<true>(params, stream);
    else
      launch<false>(params, stream);
  }
};

}  // namespace

bool promoted_stats_available() { return promoted_logits_available(); }
std::int64_t promoted_stats_tiles(std::int64_t V) { return (V + 191) / 192; }

void promoted_logits_stats(std::int64_t rows, std::int64_t V, std::int64_t ld_h, const __nv_bfloat16* x,
                           const __nv_bfloat16* weight, float* logits, std::int64_t ld_logits,
                           std::int64_t promotion_k, const LogitTileStats& stats, cudaStream_t stream,
                           void* workspace, std::size_t workspace_bytes) {
  if (rows == 0 || V == 0) return;
  if (promotion_k < 0 || promotion_k % promoted_k_granule != 0)
    throw CudaError("promoted logits GEMM: promotion_k " + std::to_string(promotion_k) + " is not a multiple of " +
                    std::to_string(promoted_k_granule));
  if (V % 4 != 0)
    throw CudaError("promoted logits GEMM with statistics: V = " + std::to_string(V) + " is not a multiple of 4");
  if (stats.ld < rows)
    throw CudaError("promoted logits GEMM with statistics: ld " + std::to_string(stats.ld) + " < rows " +
                    std::to_string(rows));
  if (logits != nullptr && ld_logits % 2 != 0)
    throw CudaError("promoted logits GEMM with statistics: ld_logits " + std::to_string(ld_logits) + " is odd");
  (void)workspace, (void)workspace_bytes;  // the kernel needs no scratch
  StatsGemm::run(rows, V, ld_h, x, weight, logits, ld_logits, promotion_k, stats, stream);
}

#else  // without CUTLASS or an sm_90a target: the runner keeps the separate statistics pass

bool promoted_stats_available() { return false; }
std::int64_t promoted_stats_tiles(std::int64_t V) { return (V + 191) / 192; }
void promoted_logits_stats(std::int64_t, std::int64_t, std::int64_t, const __nv_bfloat16*, const __nv_bfloat16*,
                           float*, std::int64_t, std::int64_t, const LogitTileStats&, cudaStream_t, void*,
                           std::size_t) {
  throw CudaError("promoted logits GEMM with statistics: not built (needs CUTLASS and an sm_90a target)");
}

#endif

}  // namespace simpo::fused::cuda
