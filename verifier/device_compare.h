// Judging on the device: where the float64 reference ran on the GPU (reference::compute_on_device), its gradients
// stay there and the comparison's reductions run there too (device_reductions.h); only the per-tensor sums, two
// elements per tensor and grad_x's per-row sums come back. The verdict is compare()'s: the same bounds
// (error_bounds.cpp), the same per-element arithmetic (element_error.h), the same judge_tensor.
#pragma once

#include "reference/reference.h"
#include "verifier/error_model.h"

#include <map>
#include <string>
#include <vector>

namespace simpo::verifier {

// A candidate's tensor in device memory, not owned (DLPack's view of a torch or JAX array), C-contiguous.
struct DeviceTensorView {
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  const void* data = nullptr;
  int device = 0;
};

// A candidate whose tensors may each be on the host or on the device.
struct MixedOutputs {
  TensorMap host;
  std::map<std::string, DeviceTensorView> device;
};

// "" where this build can compare on the device (it has CUDA), else why not.
std::string device_compare_unavailable_reason();

// compare() against exact outputs whose gradients are on the device: the small tensors are judged on the host (a
// device candidate's are downloaded: a few numbers), the gradients by kernels (a device candidate read in place,
// after waiting for its device; a host one uploaded). InputError for a candidate on another device than the
// reference's. `scales` as compare() needs them (ProblemScales::of_forward, prepare_for).
Report compare(const ProblemScales&, const reference::DeviceOutputs& exact, const MixedOutputs& candidate, const Profile&);

// Every exact output on the host, the gradients downloaded (for a caller that asks for them as arrays).
TensorMap to_host(const reference::DeviceOutputs&);

}  // namespace simpo::verifier
