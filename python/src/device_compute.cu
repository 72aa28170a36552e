// compute_device: fused::cuda::FusedRunner on caller-owned device pointers (device_compute.h says why and how).
#include "device_compute.h"

#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_buffer.h"
#include "fused/cuda/device_fused.h"
#include "fused/forward_outputs.h"
#include "problem/problem_io.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

namespace simpo::python {

using fused::cuda::DeviceBuffer;
using fused::cuda::FusedRunner;
using fused::cuda::padded;

bool device_entry_built() { return true; }

namespace {

// Lowest flat index of a NaN or Inf (bf16 exponent all ones) in p[0, n), by atomicMin into *first.
__global__ void first_nonfinite(const std::uint16_t* p, std::int64_t n, unsigned long long* first) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    if ((p[i] & 0x7f80u) == 0x7f80u) atomicMin(first, static_cast<unsigned long long>(i));
}

// One runner per device, kept: its workspace and cuBLASLt handles are reused by every later call of the same or
// smaller size (the torch module calls once per step).
FusedRunner& runner_for(int device, std::unique_lock<std::mutex>& lock) {
  static std::mutex mutex;
  static std::map<int, std::unique_ptr<FusedRunner>> runners;
  lock = std::unique_lock<std::mutex>(mutex);
  auto& r = runners[device];
  if (!r) r = std::make_unique<FusedRunner>();
  return *r;
}

bool aligned16(std::uintptr_t p) { return p % 16 == 0; }

// x or weight as the runner needs them: [rows, padded(cols)] with zero padding, 16-byte aligned. In place when
// already so; otherwise a padded device copy held in `copy`.
const __nv_bfloat16* rows_for_runner(std::uintptr_t p, std::int64_t rows, std::int64_t cols, DeviceBuffer& copy,
                                     const char* name, cudaStream_t stream, std::int64_t& extra) {
  const std::int64_t ld = padded(cols);
  if (ld == cols && aligned16(p)) return reinterpret_cast<const __nv_bfloat16*>(p);
  copy = DeviceBuffer(static_cast<std::size_t>(rows * ld * 2), std::string("a padded copy of ") + name);
  extra += rows * ld * 2;
  SIMPO_CUDA_CHECK(cudaMemsetAsync(copy.get(), 0, rows * ld * 2, stream));
  SIMPO_CUDA_CHECK(cudaMemcpy2DAsync(copy.get(), ld * 2, reinterpret_cast<const void*>(p), cols * 2, cols * 2, rows,
                                     cudaMemcpyDeviceToDevice, stream));
  return copy.as<__nv_bfloat16>();
}

// SPEC's NaN/Inf rule on the device, in validate()'s order (x, weight, bias) and with its message.
void scan_values(const DeviceCall& c, cudaStream_t stream) {
  const Shape& s = c.shape;
  struct Scan {
    const char* name;
    std::uintptr_t p;
    std::vector<std::int64_t> shape;
  };
  std::vector<Scan> scans = {{"x", c.x, {s.B, s.T, s.H}}, {"weight", c.weight, {s.V, s.H}}};
  if (c.bias) scans.push_back({"bias", c.bias, {s.V}});
  DeviceBuffer first(scans.size() * sizeof(unsigned long long), "the NaN/Inf scan's result");
  SIMPO_CUDA_CHECK(cudaMemsetAsync(first.get(), 0xff, first.bytes(), stream));
  for (std::size_t i = 0; i < scans.size(); ++i) {
    std::int64_t n = 1;
    for (auto d : scans[i].shape) n *= d;
    const int blocks = static_cast<int>(std::min<std::int64_t>((n + 255) / 256, 132 * 16));
    first_nonfinite<<<blocks, 256, 0, stream>>>(reinterpret_cast<const std::uint16_t*>(scans[i].p), n,
                                                first.as<unsigned long long>() + i);
    SIMPO_CUDA_CHECK_LAUNCH();
  }
  std::vector<unsigned long long> host(scans.size());
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(host.data(), first.get(), first.bytes(), cudaMemcpyDeviceToHost, stream));
  SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (std::size_t i = 0; i < scans.size(); ++i) {
    if (host[i] == ULLONG_MAX) continue;
    bf16 value;
    SIMPO_CUDA_CHECK(cudaMemcpy(&value, reinterpret_cast<const std::uint16_t*>(scans[i].p) + host[i], 2,
                                cudaMemcpyDeviceToHost));
    std::ostringstream os;
    os << "non-finite input: " << scans[i].name << index_string(static_cast<std::int64_t>(host[i]), scans[i].shape)
       << " = " << static_cast<float>(value);
    throw InputError(os.str());
  }
}

}  // namespace

DeviceResult compute_device(const DeviceCall& c) {
  const Shape& s = c.shape;
  validate_shape(s);
  const std::int64_t N = s.N(), V = s.V, H = s.H, ld_h = padded(H);
  const bool gradients = c.options.gradients, f32 = c.options.grad_weight_f32;
  if (!c.x || !c.weight || !c.target) throw InputError("compute_device: x, weight and target must be device pointers");
  if (gradients && (!c.grad_x || !c.grad_weight || (c.bias && !c.grad_bias)))
    throw InputError("compute_device: gradients asked for, but no output buffer for one of them");
  for (std::uintptr_t p : {c.grad_x, c.grad_weight, c.grad_bias})
    if (!aligned16(p)) throw InputError("compute_device: output buffers must be 16-byte aligned");

  SIMPO_CUDA_CHECK(cudaSetDevice(c.device));
  std::unique_lock<std::mutex> lock;
  FusedRunner& runner = runner_for(c.device, lock);
  const cudaStream_t stream = runner.stream();
  const auto caller = reinterpret_cast<cudaStream_t>(c.stream);

  // Everything below reads the inputs only after the caller's stream has produced them.
  cudaEvent_t ready, done;
  SIMPO_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  SIMPO_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  struct Events {
    cudaEvent_t a, b;
    ~Events() {
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    }
  } events{ready, done};
  SIMPO_CUDA_CHECK(cudaEventRecord(ready, caller));
  SIMPO_CUDA_CHECK(cudaStreamWaitEvent(stream, ready, 0));

  // Validation: SPEC's rules on a proxy with the real targets and H = 1 (device_compute.h), then the value scan.
  SafetensorsFile proxy_file;
  proxy_file.tensors["x"] = Tensor(DType::BF16, {s.B, s.T, 1});
  proxy_file.tensors["weight"] = Tensor(DType::BF16, {V, 1});
  if (c.bias) proxy_file.tensors["bias"] = Tensor(DType::BF16, {V});
  Tensor target(DType::I64, {s.B, s.T});
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(target.bytes.data(), reinterpret_cast<const void*>(c.target), N * 8,
                                   cudaMemcpyDeviceToHost, stream));
  SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
  proxy_file.tensors["target"] = std::move(target);
  proxy_file.metadata = c.metadata;
  const Problem proxy = problem_from_file(proxy_file, "inputs");
  validate(proxy, {.scan_values = false});
  if (c.options.validate) scan_values(c, stream);

  DeviceResult result;
  DeviceBuffer x_copy, weight_copy, weight_acc, bias_acc;
  fused::cuda::DeviceProblem dp;
  dp.shape = s;
  dp.hp = proxy.hp;
  dp.ld_h = ld_h;
  dp.x = rows_for_runner(c.x, N, H, x_copy, "x", stream, result.extra_device_bytes);
  dp.weight = rows_for_runner(c.weight, V, H, weight_copy, "weight", stream, result.extra_device_bytes);
  dp.bias = reinterpret_cast<const __nv_bfloat16*>(c.bias);
  dp.target = reinterpret_cast<const std::int64_t*>(c.target);
  dp.targets = fused::read_targets(proxy);

  fused::cuda::DeviceGradients g;
  if (gradients) {
    g.grad_x = reinterpret_cast<__nv_bfloat16*>(c.grad_x);
    // An F32 output is its own fp32 [V, padded(H)] accumulator (a padded copy when H % 8 != 0); a bf16 output is
    // all the runner needs: it accumulates in the hi/lo pair over it, or in an fp32 buffer of its own (its report
    // says how many bytes, counted below).
    if (f32 && ld_h == H) {
      g.grad_weight = reinterpret_cast<float*>(c.grad_weight);
    } else if (f32) {
      weight_acc = DeviceBuffer(static_cast<std::size_t>(V * ld_h * 4), "the fp32 grad_weight accumulator");
      result.extra_device_bytes += V * ld_h * 4;
      g.grad_weight = weight_acc.as<float>();
    } else {
      g.grad_weight_bf16 = reinterpret_cast<__nv_bfloat16*>(c.grad_weight);
    }
    if (c.bias) {
      if (f32) {
        g.grad_bias = reinterpret_cast<float*>(c.grad_bias);
      } else {
        bias_acc = DeviceBuffer(static_cast<std::size_t>(V * 4), "the fp32 grad_bias accumulator");
        result.extra_device_bytes += V * 4;
        g.grad_bias = bias_acc.as<float>();
        g.grad_bias_bf16 = reinterpret_cast<__nv_bfloat16*>(c.grad_bias);
      }
    }
  }
  const fused::RowStats stats =
      runner.run(dp, gradients ? &g : nullptr, c.options, fused::cuda::tuning_for(H, c.options));
  if (gradients && f32 && ld_h != H)
    SIMPO_CUDA_CHECK(cudaMemcpy2DAsync(reinterpret_cast<void*>(c.grad_weight), H * 4, weight_acc.get(), ld_h * 4, H * 4,
                                       V, cudaMemcpyDeviceToDevice, stream));
  result.forward = fused::forward_outputs(proxy, dp.targets, stats);
  result.workspace_bytes = runner.last_report().workspace_bytes;
  result.extra_device_bytes += runner.last_report().accumulator_bytes;

  // The caller's later work waits for the outputs; the temporaries are freed only after the runner's stream is
  // done with them.
  SIMPO_CUDA_CHECK(cudaEventRecord(done, stream));
  SIMPO_CUDA_CHECK(cudaStreamWaitEvent(caller, done, 0));
  SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
  return result;
}

}  // namespace simpo::python
