// The weight-gradient GEMM into a bf16 hi/lo pair (hilo_gemm.h) as a template of its tile and schedules (hilo_gemm.cu
// instantiates the product's; dev/ harnesses try others), after CUTLASS's example 49 (Hopper GEMM with an epilogue
// visitor tree). Mainloop: the CollectiveBuilder's bf16 one (both operands MN-major: dz^T is M-major,
// x is N-major; wgmma reads them transposed from shared memory), plain fp32 tensor-core accumulation over the
// chunk's rows (the truncation bias of a 2048-long accumulation, ~1e-6 relative, is far under the bf16 output's
// 2^-9). Epilogue, stock visitor nodes only:
//
//   t  = beta * C + (acc + aux_load(hi))        Sm90EVT<multiply_add, ScalarBroadcast, SrcFetch, EVT<plus, Acc, AuxLoad>>
//   s  = scale * t                              Sm90EVT<multiplies, ScalarBroadcast, ...> (scale 1: s = t exactly)
//   hi = aux_store(bf16(s))                     Sm90AuxStore (round to nearest), passes s on unchanged
//   D  = bf16(s - float(bf16(s)))               Sm90Compute<Residual>, D's store rounds to nearest
//
// with C = D = lo and the aux load and store both on hi: each tile is read (C and aux loads, TMA into shared
// memory) before the same CTA writes it, and tiles are disjoint, so in place is safe. The step's last GEMM
// (PairOutput::hi) stops at s: D = hi = bf16(s), C = lo read only. Why lo is C and hi the aux
// and not the other way round: the tree has one output that its parent can see, and both stores need s; with
// hi as the aux store (which passes its input through) the residual can still be formed from s above it.
//
// The first chunk (`overwrite`): beta = 0, which CUTLASS's multiply_add tree specialization reads as "C not
// needed" (no C load), and a null aux pointer, which Sm90AuxLoad reads as zeros (no load): nothing is cleared.
//
// `scale` is 1 for every chunk of a step but the last one of a deferred finish (fused.h:
// finish_weight_gradient_on_device), where it is the loss scale: one kernel for both, its product exact at 1, so a
// finish at scale 1 writes the bits the step without deferral writes.
//
// Included only where CUTLASS is (SIMPO_HAVE_CUTLASS_SM90).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_store_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/numeric_conversion.h"

#include "fused/cuda/cuda_check.h"
#include "fused/cuda/hilo_gemm.h"

#include <cstdint>
#include <string>
#include <type_traits>

namespace simpo::fused::cuda::hilo {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// s - float(bf16(s)), elementwise, with the same conversion (round to nearest even) as the aux store's, so
// hi + lo is s to within lo's own rounding.
template <class T>
struct Residual {
  CUTLASS_HOST_DEVICE T operator()(T const& s) const {
    constexpr int N = T::kElements;
    cutlass::NumericArrayConverter<cutlass::bfloat16_t, float, N, kRound> to_bf16;
    cutlass::NumericArrayConverter<float, cutlass::bfloat16_t, N, kRound> to_float;
    const T rounded = to_float(to_bf16(s));
    T r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) r[i] = s[i] - rounded[i];
    return r;
  }
};

// A cooperative kernel's MMAs stop while its consumers run a tile's epilogue, and the epilogue's producer warp can
// hold only StagesC subtiles of the pair in shared memory ahead of it: it loads those as the tile's MMAs begin, the
// rest while the consumers wait in the epilogue. So when the producer turns to a tile it first asks L2 for the later
// subtiles' rows of hi and lo (cp.async.bulk.prefetch: no registers, no shared memory, nothing to wait for), which
// then arrive while the MMAs run. (Prefetching the whole tile instead measured no better: BENCHMARKS.md.)
template <class Base, class TileShape>
class L2PrefetchingEpilogue : public Base {
  static constexpr int kTileM = cute::size<0>(TileShape{}), kTileN = cute::size<1>(TileShape{});
  using EpilogueTile = typename Base::EpilogueTile;
  // The first column the producer cannot hold ahead: StagesC subtiles of the tile's columns, where the subtiles go
  // along N only (a cooperative kernel's epilogue tile spans the tile's rows, so the producer's order is by column).
  // Other epilogue tiles (a ping-pong kernel's) get no prefetch: kFromColumn = kTileN.
  static constexpr bool kColumnsInOrder = cute::size<0>(EpilogueTile{}) == kTileM;
  static constexpr int kFromColumn =
      kColumnsInOrder ? int(Base::LoadPipelineState::Stages) * int(cute::size<1>(EpilogueTile{})) : kTileN;

 public:
  struct Arguments : Base::Arguments {
    const void* prefetch[2];  // hi and lo, null where they are not read (the first chunk)
    std::int64_t ld;          // elements per row of both
  };
  struct Params : Base::Params {
    const void* prefetch[2];
    std::int64_t ld, M, N;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void* workspace) {
    auto [M, N, K, L] = cute::append<4>(shape, 1);
    return {Base::to_underlying_arguments(shape, args, workspace), {args.prefetch[0], args.prefetch[1]}, args.ld,
            M, N};
  }

  CUTLASS_HOST_DEVICE L2PrefetchingEpilogue(Params const& params, typename Base::TensorStorage& shared)
      : Base(params, shared), prefetch_(params) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class TiledMma>
  CUTLASS_DEVICE auto load(typename Base::LoadPipeline pipeline, typename Base::LoadPipelineState state,
                           ProblemShapeMNKL problem_shape, TileShapeMNK tile_shape, TileCoordMNKL tile_coord,
                           TiledMma tiled_mma, int lane, typename Base::TensorStorage& shared, int subtile_idx = -1) {
    if (kFromColumn < kTileN && prefetch_.prefetch[0] != nullptr) {
      const std::int64_t row0 = std::int64_t(cute::get<0>(tile_coord)) * kTileM;
      const std::int64_t column0 = std::int64_t(cute::get<1>(tile_coord)) * kTileN + kFromColumn;
      const std::int64_t rows = cute::min(std::int64_t(kTileM), prefetch_.M - row0);
      const std::int64_t columns = cute::min(std::int64_t(kTileN - kFromColumn), prefetch_.N - column0);
      if (rows > 0 && columns > 0) {
        // N and ld are multiples of 8 (hilo_accumulate_grad_weight): 16-byte aligned runs of whole 16-byte units
        const auto bytes = static_cast<std::uint32_t>(columns * sizeof(cutlass::bfloat16_t));
        for (std::int64_t i = lane; i < 2 * rows; i += 32) {  // the producer warp's 32 lanes
          const auto* p = static_cast<const cutlass::bfloat16_t*>(prefetch_.prefetch[i / rows]) +
                          (row0 + i % rows) * prefetch_.ld + column0;
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
        }
      }
    }
    return Base::load(pipeline, state, problem_shape, tile_shape, tile_coord, tiled_mma, lane, shared, subtile_idx);
  }

 private:
  Params const& prefetch_;
};

template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule, PairOutput kOutput>
struct HiLoGemm {
  using Element = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::ColumnMajor;  // dz^T [M = V, K = rows]: m contiguous (a row of dz)
  using LayoutB = cutlass::layout::RowMajor;     // x [K = rows, N = H]: n contiguous
  using LayoutW = cutlass::layout::RowMajor;     // hi, lo [V, ld_w]
  using StrideW = cutlass::detail::TagToStrideC_t<LayoutW>;

  using Descriptor = cutlass::epilogue::collective::detail::EpilogueDescriptor<
      TileShape, cutlass::epilogue::collective::EpilogueTileAuto, Element, Element, EpilogueSchedule>;
  using HiLoadDescriptor = cutlass::epilogue::collective::detail::AuxLoadDescriptor<Descriptor, LayoutW, Element>;
  using HiStoreDescriptor = cutlass::epilogue::collective::detail::AuxStoreDescriptor<Descriptor, LayoutW, Element>;
  using HiLoad = fusion::Sm90AuxLoad<HiLoadDescriptor::Stages, typename Descriptor::EpilogueTile, Element,
                                     typename HiLoadDescriptor::Stride, typename HiLoadDescriptor::SmemLayoutAtom,
                                     typename HiLoadDescriptor::CopyOpS2R>;
  using HiStore = fusion::Sm90AuxStore<HiStoreDescriptor::Stages, typename Descriptor::EpilogueTile, Element, kRound,
                                       typename HiStoreDescriptor::Stride, typename HiStoreDescriptor::SmemLayoutAtom,
                                       typename HiStoreDescriptor::CopyOpR2S>;
  using AccPlusHi = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::plus, float, float, kRound>, fusion::Sm90AccFetch,
                                    HiLoad>;
  using Sum = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::homogeneous_multiply_add, float, float, kRound>,
                              fusion::Sm90ScalarBroadcast<float>, fusion::Sm90SrcFetch<Element>, AccPlusHi>;
  using Scaled = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                                 fusion::Sm90ScalarBroadcast<float>, Sum>;
  static constexpr bool kPair = kOutput == PairOutput::hi_and_lo;
  using Callbacks = std::conditional_t<kPair,
                                       fusion::Sm90EVT<fusion::Sm90Compute<Residual, Element, float, kRound>,
                                                       fusion::Sm90EVT<HiStore, Scaled>>,
                                       Scaled>;

  using Epilogue = L2PrefetchingEpilogue<
      typename cutlass::epilogue::collective::CollectiveBuilder<
          cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
          cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutW, 8, Element, LayoutW, 8,
          EpilogueSchedule, Callbacks>::CollectiveOp,
      TileShape>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static_assert(cute::is_same_v<typename Mainloop::StrideA, cute::Stride<cute::Int<1>, int64_t, int64_t>>);
  static_assert(cute::is_same_v<typename Mainloop::StrideB, cute::Stride<cute::Int<1>, int64_t, int64_t>>);
  static_assert(cute::is_same_v<StrideW, cute::Stride<int64_t, cute::Int<1>, int64_t>>);

  static typename Gemm::Arguments arguments(std::int64_t rows, std::int64_t M, std::int64_t N,
                                            const __nv_bfloat16* dz, std::int64_t ld_dz, const __nv_bfloat16* x,
                                            std::int64_t ld_x, __nv_bfloat16* hi, __nv_bfloat16* lo,
                                            std::int64_t ld_w, bool overwrite, Scale scale) {
    typename Mainloop::StrideA stride_a{Int<1>{}, ld_dz, 0};
    typename Mainloop::StrideB stride_b{Int<1>{}, ld_x, 0};
    StrideW stride_w{ld_w, Int<1>{}, 0};
    static const int device_sms = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    cutlass::KernelHardwareInfo hw{0, device_sms};
    cudaGetDevice(&hw.device_id);
    auto* hi_e = reinterpret_cast<Element*>(hi);
    auto* lo_e = reinterpret_cast<Element*>(lo);

    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {static_cast<int>(M), static_cast<int>(N), static_cast<int>(rows), 1};
    args.mainloop = {reinterpret_cast<const Element*>(dz), stride_a, reinterpret_cast<const Element*>(x), stride_b};
    // Callbacks' arguments nest as the tree: {children..., node}.
    typename Scaled::Arguments scaled{
        {{scale.value}, {scale.device}},                         // scale (from the device where it is there)
        {                                                        // Sum
         {{overwrite ? 0.0f : 1.0f}},                            //   beta
         {},                                                     //   C = lo
         {{}, {overwrite ? nullptr : hi_e, Element(0), stride_w}, {}},  // acc + hi (a null hi reads as 0)
         {}},                                                    //   multiply_add
        {}};                                                     // multiplies
    if constexpr (kPair)
      args.epilogue.thread = typename Callbacks::Arguments{{scaled, {hi_e, stride_w}},  // hi = bf16(s)
                                                           {}};                         // D = lo = s - hi
    else
      args.epilogue.thread = scaled;  // D = hi = bf16(s)
    args.epilogue.prefetch[0] = overwrite ? nullptr : hi;
    args.epilogue.prefetch[1] = overwrite ? nullptr : lo;
    args.epilogue.ld = ld_w;
    args.epilogue.ptr_C = lo_e;
    args.epilogue.dC = stride_w;
    args.epilogue.ptr_D = kPair ? lo_e : hi_e;
    args.epilogue.dD = stride_w;
    args.hw_info = hw;
    return args;
  }

  static void run(std::int64_t rows, std::int64_t M, std::int64_t N, const __nv_bfloat16* dz, std::int64_t ld_dz,
                  const __nv_bfloat16* x, std::int64_t ld_x, __nv_bfloat16* hi, __nv_bfloat16* lo, std::int64_t ld_w,
                  bool overwrite, Scale scale, cudaStream_t stream, void* workspace, std::size_t workspace_bytes) {
    const auto args = arguments(rows, M, N, dz, ld_dz, x, ld_x, hi, lo, ld_w, overwrite, scale);
    Gemm gemm;
    if (Gemm::get_workspace_size(args) > workspace_bytes)
      throw CudaError("hi/lo weight GEMM: needs " + std::to_string(Gemm::get_workspace_size(args)) +
                      " bytes of scratch, has " + std::to_string(workspace_bytes));
    cutlass::Status status = gemm.can_implement(args);
    if (status != cutlass::Status::kSuccess)
      throw CudaError(std::string("hi/lo weight GEMM cannot run rows=") + std::to_string(rows) + " M=" +
                      std::to_string(M) + " N=" + std::to_string(N) + " ld_dz=" + std::to_string(ld_dz) + " ld_x=" +
                      std::to_string(ld_x) + " ld_w=" + std::to_string(ld_w) + ": " +
                      cutlass::cutlassGetStatusString(status));
    status = gemm.initialize(args, workspace, stream);
    if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
    if (status != cutlass::Status::kSuccess)
      throw CudaError(std::string("hi/lo weight GEMM: ") + cutlass::cutlassGetStatusString(status));
    SIMPO_CUDA_CHECK_LAUNCH();
  }
};

}  // namespace simpo::fused::cuda::hilo
