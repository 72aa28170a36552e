// The fused entry point: validation, backend choice, dispatch. The algorithm itself is in cpu/ and cuda/.
#include "fused/fused.h"

#include "fused/cpu/cpu_backend.h"
#if SIMPO_HAVE_CUDA
#include "fused/cuda/cuda_backend.h"
#endif

namespace simpo::fused {

bool cuda_built() {
#if SIMPO_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

bool cuda_available() {
#if SIMPO_HAVE_CUDA
  // Asked once: probing the driver costs milliseconds and the answer does not change within a process.
  static const bool present = cuda::device_present();
  return present;
#else
  return false;
#endif
}

Backend resolve(Backend backend) {
  switch (backend) {
    case Backend::automatic: return cuda_available() ? Backend::cuda : Backend::cpu;
    case Backend::cpu: return Backend::cpu;
    case Backend::cuda:
      if (!cuda_available())
#if SIMPO_HAVE_CUDA
        throw InputError("the cuda backend was asked for, but no CUDA device is present");
#else
        throw InputError("the cuda backend was asked for, but this build has no CUDA support (no nvcc at configure time)");
#endif
      return Backend::cuda;
  }
  throw InputError("unknown backend value " + std::to_string(static_cast<int>(backend)));
}

std::string describe(Backend backend) {
  if (resolve(backend) == Backend::cuda) {
#if SIMPO_HAVE_CUDA
    return "cuda on " + cuda::describe_device();
#endif
  }
  return "cpu: the chunked step in portable C++ (Eigen GEMMs, OpenMP)";
}

// Each backend validates the problem itself (both are entry points too), so the O(inputs) scan runs once.
TensorMap compute(const Problem& problem, const Options& options) {
  if (options.gradients && !options.grad_x && !options.grad_weight)
    throw InputError("gradients asked for with neither grad_x nor grad_weight (the forward alone is gradients = false)");
  switch (resolve(options.backend)) {
    case Backend::cuda:
#if SIMPO_HAVE_CUDA
      return cuda::compute(problem, options);
#endif
    case Backend::cpu:
    case Backend::automatic: break;
  }
  return cpu::compute(problem, options);
}

DeviceResult compute_on_device(const DeviceCall& call) {
#if SIMPO_HAVE_CUDA
  return cuda::compute_on_device(call);
#else
  (void)call;
  throw InputError("inputs on a CUDA device, but this build has no cuda backend (no nvcc at build time): move them "
                   "to the host, or rebuild where nvcc is installed");
#endif
}

DeviceWorkspace device_workspace(const DeviceCall& call) {
#if SIMPO_HAVE_CUDA
  return cuda::device_workspace(call);
#else
  (void)call;
  return {};
#endif
}

bool PendingWeightGradient::waiting() const {
#if SIMPO_HAVE_CUDA
  return cuda::waiting(*this);
#else
  return false;  // no backend to defer anything
#endif
}

namespace {

// The two scale forms (a host double, a float on the device) take the same path to the cuda backend.
template <class Scale>
void finish_weight_gradient_with(const PendingWeightGradient& pending, Scale scale, std::uintptr_t stream) {
#if SIMPO_HAVE_CUDA
  cuda::finish_weight_gradient_on_device(pending, scale, stream);
#else
  (void)pending, (void)scale, (void)stream;
  throw InputError("finish_weight_gradient_on_device: this build has no cuda backend (no nvcc at build time), so "
                   "nothing was deferred");
#endif
}

template <class Scale>
void scale_gradient_with(DType dtype, std::uintptr_t hi, std::uintptr_t lo, std::int64_t n, Scale scale,
                         std::uintptr_t out, int device, std::uintptr_t stream) {
#if SIMPO_HAVE_CUDA
  cuda::scale_gradient_on_device(dtype, hi, lo, n, scale, out, device, stream);
#else
  (void)dtype, (void)hi, (void)lo, (void)n, (void)scale, (void)out, (void)device, (void)stream;
  throw InputError("a gradient on a CUDA device, but this build has no cuda backend (no nvcc at build time)");
#endif
}

}  // namespace

void finish_weight_gradient_on_device(const PendingWeightGradient& pending, double scale, std::uintptr_t stream) {
  finish_weight_gradient_with(pending, scale, stream);
}

void finish_weight_gradient_on_device(const PendingWeightGradient& pending, DeviceScalar scale,
                                      std::uintptr_t stream) {
  finish_weight_gradient_with(pending, scale, stream);
}

void scale_gradient_on_device(DType dtype, std::uintptr_t hi, std::uintptr_t lo, std::int64_t n, DeviceScalar scale,
                              std::uintptr_t out, int device, std::uintptr_t stream) {
  scale_gradient_with(dtype, hi, lo, n, scale, out, device, stream);
}

void scale_gradient_on_device(DType dtype, std::uintptr_t hi, std::uintptr_t lo, std::int64_t n, double scale,
                              std::uintptr_t out, int device, std::uintptr_t stream) {
  scale_gradient_with(dtype, hi, lo, n, scale, out, device, stream);
}

}  // namespace simpo::fused
