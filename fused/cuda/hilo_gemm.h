// The weight-gradient GEMM into a bf16 hi/lo pair instead of an fp32 accumulator:
//
//   s = scale (acc + float(hi) + float(lo)),  hi = bf16(s),  lo = bf16(s - float(hi)),  acc = dz[rows, M]^T x[rows, N]
//
// (scale 1 but for a deferred finish's last chunk, fused.h: finish_weight_gradient_on_device: the loss scale s of
// autograd's grad_output, applied to the whole sum with one rounding to bf16, where a pass over the output after the
// step would read and write it once more.)
// hi is the bf16 grad_weight output itself and lo a second bf16 [M, N] buffer, so the pair costs half the
// bytes of an fp32 accumulator (1 GiB instead of 2 at V=128256, H=4096) for the same read+write traffic per
// chunk, and carries ~16 significant bits: hi + lo is s to within 2^-16 |s| (README.md, "Memory: dz in place,
// grad_W as a bf16 hi/lo pair", derives the bound). After the last chunk hi is bf16(s) rounded to nearest: the output, with no
// final rounding pass.
//
// sm_90a only (CUTLASS 3, TMA warp-specialized, epilogue visitor tree of stock nodes: hi through an aux load
// and an aux store, lo as the GEMM's C and D, in place); built when CMake finds CUTLASS. Elsewhere
// hilo_gemm_available() is false and the runner keeps the fp32 accumulator (gemm.h).
#pragma once

#include "fused/cuda/kernels.h"  // Scale

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace simpo::fused::cuda {

// Built with the sm_90a kernels and the current device runs them (compute capability 9.0).
bool hilo_gemm_available();


// What the GEMM writes: the pair (hi and lo: sums go on), or hi alone (the step's last GEMM into the pair, where
// nothing reads lo afterwards: lo is read, not written, 2 bytes a weight less to store).
enum class PairOutput { hi_and_lo, hi };

// hi, lo [M, ld_w] (bf16, row-major, first N columns) = scale (hi + lo + dz[rows, M]^T x[rows, N]); `overwrite`: the
// first term (hi and lo are written, never read: no clearing beforehand); PairOutput::hi: hi = bf16(that sum) alone. At
// scale 1 the pair's sum is the GEMM's bit for bit (the product by 1 is exact). dz is [rows, ld_dz] (row-major; the
// fused runner's in-place dz has ld_dz = 2 * ld_logits), x is [rows, ld_x]. Requirements (TMA): M, N, ld_dz, ld_x and
// ld_w multiples of 8, every pointer 16-byte aligned. `scale` may be a float on the device (read when the kernel runs).
// `workspace` is the kernel's scratch (the persistent scheduler takes none: a null one of 0 bytes is fine). Throws
// CudaError when it cannot run the shape or was not built.
void hilo_accumulate_grad_weight(std::int64_t rows, std::int64_t M, std::int64_t N, const __nv_bfloat16* dz,
                                 std::int64_t ld_dz, const __nv_bfloat16* x, std::int64_t ld_x, __nv_bfloat16* hi,
                                 __nv_bfloat16* lo, std::int64_t ld_w, bool overwrite, Scale scale, cudaStream_t stream,
                                 void* workspace, std::size_t workspace_bytes,
                                 PairOutput output = PairOutput::hi_and_lo);

}  // namespace simpo::fused::cuda
