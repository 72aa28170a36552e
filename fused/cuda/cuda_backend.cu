// cuda::compute: validate, upload the inputs (rows padded to 8 elements), run the fused algorithm on the
// device, download the outputs. The forward scalars come from fused/forward_outputs.h on the copied-back row
// statistics, so they are bit-identical to the cpu backend's for identical statistics.
#include "fused/cuda/cuda_backend.h"

#include <algorithm>

#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_fused.h"
#include "fused/cuda/promoted_gemm.h"

#include <cstring>

namespace simpo::fused::cuda {

// Asked once per process: probing the driver costs milliseconds and the answer does not change.
bool device_present() {
  static const bool present = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();  // no driver or no device: not an error for this question
      return false;
    }
    return count > 0;
  }();
  return present;
}

namespace {

// A [rows, cols] bf16 host matrix into a device [rows, ld] one whose extra columns are zero.
DeviceBuffer upload_rows(const std::vector<bf16>& host, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                         const std::string& name, cudaStream_t stream) {
  DeviceBuffer device(static_cast<std::size_t>(rows * ld * 2), name, stream);
  if (ld != cols) SIMPO_CUDA_CHECK(cudaMemsetAsync(device.get(), 0, rows * ld * 2, stream));
  SIMPO_CUDA_CHECK(cudaMemcpy2DAsync(device.get(), ld * 2, host.data(), cols * 2, cols * 2, rows,
                                     cudaMemcpyHostToDevice, stream));
  return device;
}

// A dense device buffer into a new host tensor of `dtype` and `shape`.
Tensor download(const void* device, DType dtype, std::vector<std::int64_t> shape, cudaStream_t stream) {
  Tensor t(dtype, std::move(shape));
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(t.bytes.data(), device, t.bytes.size(), cudaMemcpyDeviceToHost, stream));
  return t;
}

// This thread's runner, kept between calls: its stream and cuBLAS handles cost milliseconds to make, and a
// sweep calls compute() thousands of times from each of its threads. Destroyed when the thread ends.
FusedRunner& thread_runner() {
  thread_local FusedRunner runner;
  return runner;
}

}  // namespace

DeviceInputs upload_inputs(const Problem& problem, cudaStream_t stream) {
  const Shape& s = problem.shape;
  const std::int64_t N = s.N(), V = s.V, H = s.H, ld_h = padded(H);
  DeviceInputs in;
  in.x = upload_rows(problem.x.as<bf16>(), N, H, ld_h, "x", stream);
  in.weight = upload_rows(problem.weight.as<bf16>(), V, H, ld_h, "weight", stream);
  if (problem.has_bias()) in.bias = upload_rows(problem.bias->as<bf16>(), 1, V, V, "bias", stream);
  in.target = DeviceBuffer(static_cast<std::size_t>(N * 8), "target", stream);
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(in.target.get(), problem.target.data(), N * 8, cudaMemcpyHostToDevice, stream));
  DeviceProblem& d = in.problem;
  d.shape = s;
  d.hp = problem.hp;
  d.ld_h = ld_h;
  d.x = in.x.as<__nv_bfloat16>();
  d.weight = in.weight.as<__nv_bfloat16>();
  d.bias = problem.has_bias() ? in.bias.as<__nv_bfloat16>() : nullptr;
  d.target = in.target.as<std::int64_t>();
  d.targets = read_targets(problem);
  return in;
}

Tuning tuning_for(std::int64_t H, const Options& options) {
  Tuning tuning;
  if (options.logits_k_slice <= 0) return tuning;  // one cuBLAS GEMM
  if (promoted_logits_available()) {
    tuning.logits = Tuning::Logits::promoted;
    tuning.promotion_k = std::max(promoted_k_granule, options.logits_k_slice / promoted_k_granule * promoted_k_granule);
    tuning.forward_chunk_rows = 2048;
    // Up to 4096 rows while the chunk's x stays within 32 MiB (H = 4096: 4096 rows), so it stays in L2 while W
    // streams past it.
    const std::int64_t x_rows_in_32_mib = (std::int64_t{32} << 20) / (2 * std::max<std::int64_t>(H, 1));
    tuning.forward_stats_chunk_rows = std::clamp<std::int64_t>(x_rows_in_32_mib / 128 * 128, 128, 4096);
    // With logit distances (off by default), the full step's chunks by the same rule: 4096 rows of distances are
    // the bytes of 2048 rows of fp32 logits, which keeps the default's memory at B = 16 within issue 8's 2.2 GiB.
    tuning.distance_chunk_rows = tuning.forward_stats_chunk_rows;
    tuning.logit_distances = options.logit_distances;
    return tuning;
  }
  tuning.logits_k_splits = static_cast<int>(std::max<std::int64_t>(1, (H + options.logits_k_slice - 1) / options.logits_k_slice));
  return tuning;
}

TensorMap compute(const Problem& problem, const Options& options) {
  return compute(problem, options, tuning_for(problem.shape.H, options));
}

TensorMap compute(const Problem& problem, const Options& options, const Tuning& tuning) {
  if (options.mutant != Mutant::none)
    throw InputError("mutants are implemented by the cpu backend (the cuda backend was asked for mutant " +
                     mutant_name(options.mutant) + ")");
  validate(problem, {.scan_values = options.validate});
  if (problem.input_dtype() != DType::BF16)
    throw InputError("the cuda backend takes bf16 inputs; these are " + input_dtype_name(problem.input_dtype()) +
                     " (the cpu backend and the reference take f16 and f32)");
  if (!device_present()) throw InputError("the cuda backend was asked for, but no CUDA device is present");

  const Shape& s = problem.shape;
  const std::int64_t N = s.N(), V = s.V, H = s.H, ld_h = padded(H);
  FusedRunner& runner = thread_runner();
  const cudaStream_t stream = runner.stream();
  // Every buffer below is stream-ordered on the runner's stream (device_buffer.h); the runner's workspace goes
  // back to the pool when this call ends, however it ends.
  struct ReleaseWorkspace {
    FusedRunner& runner;
    ~ReleaseWorkspace() { runner.release_workspace(); }
  } release_workspace{runner};

  const DeviceInputs inputs = upload_inputs(problem, stream);
  const DeviceProblem& device = inputs.problem;

  if (!options.gradients) {
    const RowStats stats = runner.run(device, nullptr, options, tuning);
    return forward_outputs(problem, device.targets, stats);
  }

  // Gradients. grad_weight: an F32 output is its own fp32 accumulator; a bf16 one is all the runner needs (it
  // accumulates in the hi/lo pair over it, or in an fp32 accumulator of its own where the pair cannot run:
  // device_fused.h), so no fp32 [V, H] buffer is made here for it. grad_bias: fp32, rounded into bf16 unless F32.
  const bool f32 = options.grad_weight_f32;
  DeviceBuffer grad_x(static_cast<std::size_t>(N * H * 2), "grad_x", stream);
  DeviceBuffer grad_weight, grad_bias, grad_weight_bf16, grad_bias_bf16;
  if (f32) grad_weight = DeviceBuffer(static_cast<std::size_t>(V * ld_h * 4), "grad_weight (fp32)", stream);
  if (problem.has_bias())
    grad_bias = DeviceBuffer(static_cast<std::size_t>(V * 4), "the fp32 grad_bias accumulator", stream);
  if (!f32) {
    grad_weight_bf16 = DeviceBuffer(static_cast<std::size_t>(V * H * 2), "grad_weight", stream);
    if (problem.has_bias()) grad_bias_bf16 = DeviceBuffer(static_cast<std::size_t>(V * 2), "grad_bias", stream);
  }
  DeviceGradients gradients;
  gradients.grad_x = grad_x.as<__nv_bfloat16>();
  gradients.grad_weight = grad_weight.as<float>();
  gradients.grad_bias = grad_bias.as<float>();
  gradients.grad_weight_bf16 = grad_weight_bf16.as<__nv_bfloat16>();
  gradients.grad_bias_bf16 = grad_bias_bf16.as<__nv_bfloat16>();

  const RowStats stats = runner.run(device, &gradients, options, tuning);
  TensorMap out = forward_outputs(problem, device.targets, stats);

  out[output_name::grad_x] = download(grad_x.get(), DType::BF16, output_shape(s, output_name::grad_x), stream);
  const auto weight_shape = output_shape(s, output_name::grad_weight);
  if (f32) {
    Tensor t(DType::F32, weight_shape);  // the accumulator itself, without its padding columns
    SIMPO_CUDA_CHECK(cudaMemcpy2DAsync(t.bytes.data(), H * 4, grad_weight.get(), ld_h * 4, H * 4, V,
                                       cudaMemcpyDeviceToHost, stream));
    out[output_name::grad_weight] = std::move(t);
  } else {
    out[output_name::grad_weight] = download(grad_weight_bf16.get(), DType::BF16, weight_shape, stream);
  }
  if (problem.has_bias()) {
    const auto bias_shape = output_shape(s, output_name::grad_bias);
    out[output_name::grad_bias] = f32 ? download(grad_bias.get(), DType::F32, bias_shape, stream)
                                      : download(grad_bias_bf16.get(), DType::BF16, bias_shape, stream);
  }
  SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

}  // namespace simpo::fused::cuda
