// reference-cuda: SPEC's function in float64 on a CUDA device, the same schedule and per-pair arithmetic as the
// CPU reference (reference_core.h) with the three products in cuBLAS DGEMM and the per-row passes in float64
// kernels (kernels.h). Built only when CUDA is found (SIMPO_HAVE_CUDA); reference::compute calls it for
// Options::device = cuda (or auto with a device). Plain C++ header: no CUDA types.
#pragma once

#include "reference/reference_core.h"

#include <cstdint>
#include <memory>
#include <string>

namespace simpo::reference::cuda {

// "" when a CUDA device can run reference-cuda here, else why not (the CUDA runtime's words). Asked once.
const std::string& unavailable_reason();
// "NVIDIA H200 (139.8 GiB, cuBLAS 13.0.2)" for reports.
std::string device_description();

// Where a call's wall time went (host clock, the device synchronized at each boundary), for the bench.
struct Timings {
  double upload = 0;    // device allocation, inputs to the device (bf16), widened to double
  double compute = 0;   // the blocks: GEMMs, row kernels, per-pair terms on the host
  double download = 0;  // gradients back to the host
};

// Device memory a call takes for this shape (inputs and gradients in double, one chunk of logits, per-row
// numbers, and the bf16 staging of the inputs while they are widened).
std::int64_t required_device_bytes(const Shape&, bool bias, const Options&);

// The gradients' device buffers, handed to the caller instead of downloaded (reference::compute_on_device).
struct KeptGradients {
  std::shared_ptr<const double> x, weight, bias;
  int device = 0;
};

// As reference::compute_core (reference_core.h), on the device. The Problem overload uploads bf16 inputs as they are
// (a quarter of the bytes of doubles) and widens them there, f16 and f32 inputs widened on the host; the problem
// must have passed validate().
ForwardOutputs compute_core(const DoubleInputs&, const Options&, GradientOutputs = {}, Timings* = nullptr);
ForwardOutputs compute_core(const Problem&, const Options&, GradientOutputs = {}, Timings* = nullptr);
// The bf16 overload with the gradients left on the device (Options::gradients on; no GradientOutputs).
ForwardOutputs compute_core(const Problem&, const Options&, KeptGradients&, Timings* = nullptr);

}  // namespace simpo::reference::cuda
