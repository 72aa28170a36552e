// The CUDA backend of the fused linear + SimPO loss: cuBLASLt and CUTLASS GEMMs (bf16 operands, fp32
// accumulation) and our row kernels, running the plan of fused/cuda/plan.h. fused::compute and
// fused::compute_on_device dispatch here; the per-token and per-pair math is fused/simpo_math.h, shared with the
// cpu backend.
#pragma once

#include "fused/fused.h"
#include "problem/problem.h"

namespace simpo::fused::cuda {

struct Tuning;  // plan.h

// True when the CUDA runtime sees at least one device. Never throws (a missing driver reads as false).
bool device_present();
// The current device and the kernels the step runs there, in one line for reports: its name and compute
// capability, then how the logits GEMM runs and where grad_W accumulates for bf16 at the published shape (and why
// the promoted kernel does not run, where it does not).
std::string describe_device();

// The one entry to the device step: validation (SPEC's rules on the targets and hyperparameters; the NaN/Inf rule
// from the step's row statistics, which every input element reaches), the buffers the runner needs beyond the caller's (padded copies where H % 8 != 0 or a pointer is
// not 16-byte aligned, fp32 accumulators), the runner (one per thread and device, kept between calls), and stream
// order: the runner's stream waits for the caller's before reading, and the caller's waits for the runner's before
// anything reads the outputs, so the call is ordered as if it ran on the caller's stream. Row statistics that are not all
// finite send the call to a scan of x, weight and bias on the device: a non-finite input is the InputError it
// names, thrown after the step ran (the output buffers then hold unspecified values). Throws
// InputError for bad input, a budget too small for one row, or device memory exhausted (naming the bytes);
// CudaError for any other CUDA, cuBLAS or cuBLASLt failure, with the library's message.
DeviceResult compute_on_device(const DeviceCall&);
DeviceResult compute_on_device(const DeviceCall&, const Tuning&);
// fused.h's device_workspace, PendingWeightGradient::waiting and finish_weight_gradient_on_device.
DeviceWorkspace device_workspace(const DeviceCall&);
DeviceWorkspace device_workspace(const DeviceCall&, const Tuning&);
bool waiting(const PendingWeightGradient&);
void finish_weight_gradient_on_device(const PendingWeightGradient&, double scale, std::uintptr_t stream);
void finish_weight_gradient_on_device(const PendingWeightGradient&, DeviceScalar scale, std::uintptr_t stream);
void scale_gradient_on_device(DType dtype, std::uintptr_t hi, std::uintptr_t lo, std::int64_t n, double scale,
                              std::uintptr_t out, int device, std::uintptr_t stream);
void scale_gradient_on_device(DType dtype, std::uintptr_t hi, std::uintptr_t lo, std::int64_t n, DeviceScalar scale,
                              std::uintptr_t out, int device, std::uintptr_t stream);

// SPEC's outputs for a host problem: its inputs copied to the device, compute_on_device, the outputs copied back.
TensorMap compute(const Problem& problem, const Options& options);
TensorMap compute(const Problem& problem, const Options& options, const Tuning&);

}  // namespace simpo::fused::cuda
