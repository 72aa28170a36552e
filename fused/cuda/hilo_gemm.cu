// hilo_gemm.h's entry: the product's instantiation of hilo_gemm_kernel.cuh's template (which explains the kernel).
#include "fused/cuda/hilo_gemm.h"

#include "fused/cuda/cuda_check.h"
#include "fused/cuda/promoted_gemm.h"

#include <string>

#if defined(SIMPO_HAVE_CUTLASS_SM90)
#include "fused/cuda/hilo_gemm_kernel.cuh"
#endif

namespace simpo::fused::cuda {

#if defined(SIMPO_HAVE_CUTLASS_SM90)
namespace {

using namespace cute;

template <PairOutput kOutput>
using Cooperative128x256 =
    hilo::HiLoGemm<cute::Shape<_128, _256, _64>, cute::Shape<_1, _1, _1>,
                   cutlass::gemm::KernelTmaWarpSpecializedCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                   kOutput>;
// The ping-pong tiles (64x256, 128x128) measured level with or behind it, and 128x16 epilogue tiles with four
// mainloop stages, with or without a 2x1 cluster, slower (fused/cuda/BENCHMARKS.md).

}  // namespace

// The same library, built for sm_90a with CUTLASS or not at all: what holds for the promoted GEMM holds here.
bool hilo_gemm_available() { return promoted_logits_available(); }

void hilo_accumulate_grad_weight(std::int64_t rows, std::int64_t M, std::int64_t N, const __nv_bfloat16* dz,
                                 std::int64_t ld_dz, const __nv_bfloat16* x, std::int64_t ld_x, __nv_bfloat16* hi,
                                 __nv_bfloat16* lo, std::int64_t ld_w, bool overwrite, Scale scale, cudaStream_t stream,
                                 void* workspace, std::size_t workspace_bytes, PairOutput output) {
  if (rows == 0 || M == 0 || N == 0) return;
  if (M % 8 != 0 || N % 8 != 0 || ld_dz % 8 != 0 || ld_x % 8 != 0 || ld_w % 8 != 0)
    throw CudaError("hi/lo weight GEMM: M=" + std::to_string(M) + " N=" + std::to_string(N) + " ld_dz=" +
                    std::to_string(ld_dz) + " ld_x=" + std::to_string(ld_x) + " ld_w=" + std::to_string(ld_w) +
                    " must all be multiples of 8 (16-byte TMA rows)");
  (output == PairOutput::hi ? Cooperative128x256<PairOutput::hi>::run : Cooperative128x256<PairOutput::hi_and_lo>::run)(
      rows, M, N, dz, ld_dz, x, ld_x, hi, lo, ld_w, overwrite, scale, stream, workspace, workspace_bytes);
}

#else  // built without CUTLASS or without an sm_90a target: the runner keeps the fp32 accumulator

bool hilo_gemm_available() { return false; }
void hilo_accumulate_grad_weight(std::int64_t, std::int64_t, std::int64_t, const __nv_bfloat16*, std::int64_t,
                                 const __nv_bfloat16*, std::int64_t, __nv_bfloat16*, __nv_bfloat16*, std::int64_t, bool,
                                 Scale, cudaStream_t, void*, std::size_t, PairOutput) {
  throw CudaError("hi/lo weight GEMM: not built (needs CUTLASS and an sm_90a target)");
}

#endif

}  // namespace simpo::fused::cuda
