// accumulate_gemm.h. CUTLASS's collective builders alone: a bf16 mainloop (dz K-major, w N-major) and the default
// epilogue D = alpha acc + beta C with C = D = the fp32 accumulator (in place: each tile's C is loaded before the same
// CTA stores that tile's D, and tiles are disjoint). beta = 0 is CUTLASS's "source not needed": nothing is read.
#include "fused/cuda/accumulate_gemm.h"

#include "fused/cuda/cuda_check.h"
#include "fused/cuda/promoted_gemm.h"

#include <string>

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

namespace simpo::fused::cuda {

bool accumulate_gemm_fits(std::int64_t K, std::int64_t N, std::int64_t ld_dz, std::int64_t ld_w, std::int64_t ld_acc,
                          const void* dz, const void* w, const void* acc) {
  auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  return K % 8 == 0 && N % 8 == 0 && ld_dz % 8 == 0 && ld_w % 8 == 0 && ld_acc % 4 == 0 && aligned(dz) &&
         aligned(w) && aligned(acc);
}

#if defined(SIMPO_HAVE_CUTLASS_SM90)
namespace {

struct AccumulateGemm {
  using Element = cutlass::bfloat16_t;
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, cutlass::layout::RowMajor, 4, float,
      cutlass::layout::RowMajor, 4, cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::RowMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  // dz [M, K] k contiguous, w [K, N] n contiguous, acc [M, N] n contiguous: the dynamic stride of each is its rows'.
  static_assert(cute::is_same_v<typename Kernel::StrideA, cute::Stride<std::int64_t, cute::Int<1>, std::int64_t>>);
  static_assert(cute::is_same_v<typename Kernel::StrideB, cute::Stride<cute::Int<1>, std::int64_t, std::int64_t>>);
  static_assert(cute::is_same_v<typename Kernel::StrideD, cute::Stride<std::int64_t, cute::Int<1>, std::int64_t>>);
};

}  // namespace

bool accumulate_gemm_available() { return promoted_logits_available(); }

void accumulate_grad_x(std::int64_t rows, std::int64_t K, std::int64_t N, const __nv_bfloat16* dz, std::int64_t ld_dz,
                       const __nv_bfloat16* w, std::int64_t ld_w, float* acc, std::int64_t ld_acc, bool overwrite,
                       cudaStream_t stream) {
  if (rows == 0 || N == 0) return;
  if (!accumulate_gemm_fits(K, N, ld_dz, ld_w, ld_acc, dz, w, acc))
    throw CudaError("grad_x accumulate GEMM: K=" + std::to_string(K) + " N=" + std::to_string(N) + " ld_dz=" +
                    std::to_string(ld_dz) + " ld_w=" + std::to_string(ld_w) + " ld_acc=" + std::to_string(ld_acc) +
                    " or a pointer is not in whole 16-byte groups (TMA)");
  using G = AccumulateGemm;
  using Element = G::Element;
  typename G::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {static_cast<int>(rows), static_cast<int>(N), static_cast<int>(K), 1};
  args.mainloop.ptr_A = reinterpret_cast<const Element*>(dz);
  args.mainloop.dA = {ld_dz, cute::Int<1>{}, 0};
  args.mainloop.ptr_B = reinterpret_cast<const Element*>(w);
  args.mainloop.dB = {cute::Int<1>{}, ld_w, 0};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = overwrite ? 0.0f : 1.0f;
  args.epilogue.ptr_C = acc;
  args.epilogue.dC = {ld_acc, cute::Int<1>{}, 0};
  args.epilogue.ptr_D = acc;
  args.epilogue.dD = {ld_acc, cute::Int<1>{}, 0};
  static const int device_sms = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
  args.hw_info = {0, device_sms};
  SIMPO_CUDA_CHECK(cudaGetDevice(&args.hw_info.device_id));
  typename G::Gemm gemm;
  // The persistent scheduler without split-k takes no scratch.
  cutlass::Status status = gemm.can_implement(args);
  if (status == cutlass::Status::kSuccess) status = gemm.initialize(args, nullptr, stream);
  if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess)
    throw CudaError(std::string("grad_x accumulate GEMM rows=") + std::to_string(rows) + " K=" + std::to_string(K) +
                    " N=" + std::to_string(N) + ": " + cutlass::cutlassGetStatusString(status));
  SIMPO_CUDA_CHECK_LAUNCH();
}

#else  // built without CUTLASS or without an sm_90a target: the runner keeps cuBLASLt

bool accumulate_gemm_available() { return false; }
void accumulate_grad_x(std::int64_t, std::int64_t, std::int64_t, const __nv_bfloat16*, std::int64_t,
                       const __nv_bfloat16*, std::int64_t, float*, std::int64_t, bool, cudaStream_t) {
  throw CudaError("grad_x accumulate GEMM: not built (needs CUTLASS and an sm_90a target)");
}

#endif

}  // namespace simpo::fused::cuda
