// The CUDA backend of the fused linear + SimPO loss: cuBLASLt GEMMs (bf16 operands, fp32 accumulation and
// output) and our row kernels, following the chunk plan of fused/schedule.h. fused::compute dispatches here;
// the per-token and per-pair math is fused/simpo_math.h, shared with the cpu backend.
#pragma once

#include "fused/fused.h"
#include "problem/problem.h"

namespace simpo::fused::cuda {

// True when the CUDA runtime sees at least one device. Never throws (a missing driver reads as false).
bool device_present();

// SPEC's outputs for `problem` computed on the current CUDA device: uploads the inputs, runs the fused
// algorithm, downloads the outputs. Throws InputError for bad input (simpo::validate), a mutant (those live in
// the cpu backend), a workspace budget too small for one row, or device memory exhausted (naming the bytes);
// CudaError for any other CUDA, cuBLAS or cuBLASLt failure, with the library's message.
TensorMap compute(const Problem& problem, const Options& options);

}  // namespace simpo::fused::cuda
