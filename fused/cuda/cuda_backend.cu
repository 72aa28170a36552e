// compute_on_device: validate, choose the buffers, order the streams, run the plan (cuda_backend.h says what each
// part does). compute: a host problem through the same entry. The forward scalars come from
// fused/forward_outputs.h on the copied-back row statistics, so they are bit-identical to the cpu backend's for
// identical statistics.
#include "fused/cuda/cuda_backend.h"

#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_buffer.h"
#include "fused/cuda/device_fused.h"
#include "fused/cuda/kernels.h"
#include "fused/cuda/plan.h"
#include "fused/cuda/promoted_gemm.h"

#include <climits>
#include <cmath>
#include <map>
#include <optional>
#include <memory>
#include <sstream>

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

std::string describe_device() {
  if (!device_present()) return "no CUDA device";
  int device = 0;
  cudaDeviceProp prop{};
  SIMPO_CUDA_CHECK(cudaGetDevice(&device));
  SIMPO_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  const GradientOutputs outputs{.grad_x = true, .grad_weight_16bit = true};
  const StepPlan plan = plan_step(Shape{.B = 2, .T = 1024, .H = 4096, .V = 128256}, DType::BF16, Options{},
                                  device_features(), &outputs);
  std::string why;
  if (!plan.logits.promoted)
    why = !promoted_kernels_built() ? " (this build has no CUTLASS sm_90a kernels: fused/cuda/fetch_cutlass.sh, then rebuild)"
          : prop.major != 9         ? " (the sm_90a kernels need compute capability 9.0)"
                                    : "";
  return std::string(prop.name) + " (compute capability " + std::to_string(prop.major) + "." +
         std::to_string(prop.minor) + "); bf16 at the published shape: logits by " + plan.logits_form() +
         ", grad_W in the " + plan.grad_weight_form() + why;
}

namespace {

// This thread's runner for a device, kept between calls: its stream and cuBLAS handles cost milliseconds to make,
// a sweep calls thousands of times from each of its threads, and a training loop once per step. Destroyed when the
// thread ends.
FusedRunner& runner_for(int device) {
  thread_local std::map<int, std::unique_ptr<FusedRunner>> runners;
  auto& runner = runners[device];
  if (!runner) runner = std::make_unique<FusedRunner>();
  return *runner;
}

// Lowest flat index of a NaN or Inf (exponent all ones: `exponent` is the dtype's exponent mask on its bits U) in
// p[0, n), by atomicMin into *first. The scan is bound by memory bandwidth, so the aligned middle is read 16 bytes
// per load (one 2-byte load per thread reaches a fraction of it); the unaligned head and the tail element by element.
template <class U>
__global__ void first_nonfinite(const U* p, std::int64_t n, U exponent, unsigned long long* first) {
  constexpr int kPerLoad = 16 / sizeof(U);
  const std::int64_t thread = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x,
                     threads = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const int misaligned = static_cast<int>(reinterpret_cast<std::uintptr_t>(p) % 16 / sizeof(U));
  const std::int64_t head = std::min<std::int64_t>(n, misaligned ? kPerLoad - misaligned : 0),
                     loads = (n - head) / kPerLoad, tail = head + loads * kPerLoad;
  auto check = [&](std::int64_t i, U bits) {
    if ((bits & exponent) == exponent) atomicMin(first, static_cast<unsigned long long>(i));
  };
  for (std::int64_t i = thread; i < head; i += threads) check(i, p[i]);
  const uint4* aligned = reinterpret_cast<const uint4*>(p + head);
  for (std::int64_t j = thread; j < loads; j += threads) {
    const uint4 v = aligned[j];
    U e[kPerLoad];
    memcpy(e, &v, sizeof(v));
    for (int k = 0; k < kPerLoad; ++k)
      if ((e[k] & exponent) == exponent) {  // the lowest index of this load is enough
        atomicMin(first, static_cast<unsigned long long>(head + j * kPerLoad + k));
        break;
      }
  }
  for (std::int64_t i = tail + thread; i < n; i += threads) check(i, p[i]);
}

// Element i of device array p of dtype `dtype`, widened to double (for a message).
double device_value(std::uintptr_t p, DType dtype, std::int64_t i) {
  const std::size_t size = dtype_size(dtype);
  unsigned char bytes[4] = {};
  SIMPO_CUDA_CHECK(cudaMemcpy(bytes, reinterpret_cast<const unsigned char*>(p) + i * size, size,
                              cudaMemcpyDeviceToHost));
  if (dtype == DType::F32) return static_cast<double>(*reinterpret_cast<const float*>(bytes));
  if (dtype == DType::F16) return static_cast<double>(static_cast<float>(*reinterpret_cast<const f16*>(bytes)));
  return static_cast<double>(static_cast<float>(*reinterpret_cast<const bf16*>(bytes)));
}

// A stream of the calling thread's own beside each runner's, for the NaN/Inf scan.
cudaStream_t side_stream_for(int device) {
  struct Side {
    cudaStream_t s = nullptr;
    Side() { SIMPO_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
    ~Side() { cudaStreamDestroy(s); }
  };
  thread_local std::map<int, std::unique_ptr<Side>> sides;
  auto& side = sides[device];
  if (!side) side = std::make_unique<Side>();
  return side->s;
}

// SPEC's NaN/Inf rule on the device, in validate()'s order (x, weight, bias) and with its message: the scan that
// names the first non-finite element, run only for a call whose row statistics are not all finite
// (finite_statistics below). Launched on a side stream once `ready` has happened; join() makes `main` wait for it;
// check(), after `main` is synchronized, throws for a non-finite input, whose outputs are then discarded (the
// kernels do not index by value: NaN flows through them).
class ValueScan {
 public:
  ValueScan(const DeviceCall& c, cudaEvent_t ready) : c_(c), side_(side_stream_for(c.device)) {
    const Shape& s = c.shape;
    scans_ = {{"x", c.x, {s.B, s.T, s.H}}, {"weight", c.weight, {s.V, s.H}}};
    if (c.bias) scans_.push_back({"bias", c.bias, {s.V}});
    int sms = 0;
    SIMPO_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c.device));
    SIMPO_CUDA_CHECK(cudaStreamWaitEvent(side_, ready, 0));
    first_ = DeviceBuffer(scans_.size() * sizeof(unsigned long long), "the NaN/Inf scan's result", side_);
    SIMPO_CUDA_CHECK(cudaMemsetAsync(first_.get(), 0xff, first_.bytes(), side_));
    for (std::size_t i = 0; i < scans_.size(); ++i) {
      std::int64_t n = 1;
      for (auto d : scans_[i].shape) n *= d;
      const int blocks = static_cast<int>(std::min<std::int64_t>((n + 255) / 256, std::int64_t{sms} * 16));
      unsigned long long* result = first_.as<unsigned long long>() + i;
      if (c.input_dtype == DType::F32)
        first_nonfinite<<<blocks, 256, 0, side_>>>(reinterpret_cast<const std::uint32_t*>(scans_[i].p), n,
                                                   std::uint32_t{0x7f800000u}, result);
      else
        first_nonfinite<<<blocks, 256, 0, side_>>>(reinterpret_cast<const std::uint16_t*>(scans_[i].p), n,
                                                   static_cast<std::uint16_t>(c.input_dtype == DType::F16 ? 0x7c00u : 0x7f80u),
                                                   result);
      SIMPO_CUDA_CHECK_LAUNCH();
    }
    SIMPO_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    SIMPO_CUDA_CHECK(cudaEventRecord(done_, side_));
  }
  // Waits for the scan before the call returns, however it returns: the caller may free the inputs right after.
  ~ValueScan() {
    cudaEventSynchronize(done_);
    cudaEventDestroy(done_);
  }
  ValueScan(const ValueScan&) = delete;
  ValueScan& operator=(const ValueScan&) = delete;

  void join(cudaStream_t main) const { SIMPO_CUDA_CHECK(cudaStreamWaitEvent(main, done_, 0)); }

  void check() const {
    std::vector<unsigned long long> host(scans_.size());
    SIMPO_CUDA_CHECK(cudaEventSynchronize(done_));
    SIMPO_CUDA_CHECK(cudaMemcpy(host.data(), first_.get(), first_.bytes(), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < scans_.size(); ++i) {
      if (host[i] == ULLONG_MAX) continue;
      const double value = device_value(scans_[i].p, c_.input_dtype, static_cast<std::int64_t>(host[i]));
      std::ostringstream os;
      os << "non-finite input: " << scans_[i].name << index_string(static_cast<std::int64_t>(host[i]), scans_[i].shape)
         << " = " << static_cast<float>(value);
      throw InputError(os.str());
    }
  }

 private:
  struct Scan {
    const char* name;
    std::uintptr_t p;
    std::vector<std::int64_t> shape;
  };
  const DeviceCall& c_;
  cudaStream_t side_;
  std::vector<Scan> scans_;
  DeviceBuffer first_;
  cudaEvent_t done_ = nullptr;
};

// SPEC's rules but the values, on a problem with the call's shape, hyperparameters and targets (copied to the host)
// and zero x and weight of one hidden unit: what the forward outputs' host math reads of a problem.
Problem targets_problem(const DeviceCall& c, cudaStream_t stream) {
  const Shape& s = c.shape;
  Problem p;
  p.shape = {s.B, s.T, 1, s.V};
  p.hp = c.hp;
  // (bf16 whatever the inputs' dtype: no value of these is read)
  p.x = std::vector<bf16>(static_cast<std::size_t>(s.N()), bf16(0.f));
  p.weight = std::vector<bf16>(static_cast<std::size_t>(s.V), bf16(0.f));
  if (c.bias) p.bias = InputValues(std::vector<bf16>(static_cast<std::size_t>(s.V), bf16(0.f)));
  p.target.resize(static_cast<std::size_t>(s.N()));
  SIMPO_CUDA_CHECK(cudaMemcpyAsync(p.target.data(), reinterpret_cast<const void*>(c.target), s.N() * 8,
                                   cudaMemcpyDeviceToHost, stream));
  SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
  validate(p, {.scan_values = false});
  return p;
}

bool aligned16(std::uintptr_t p) { return p % 16 == 0; }

// Whether a step's row statistics prove its inputs finite. Every logit z[r, v] = x_r . w_v (+ b_v) of every row r
// enters rowsum[r] (the *_logits_mean outputs read all N rows, ignored ones included), and a NaN or Inf anywhere in
// x, weight or bias makes a logit non-finite: NaN times anything and Inf times 0 are NaN, Inf times anything else
// is an infinity, and a sum with a NaN or infinite term is not finite. So all-finite statistics need no scan of
// the inputs (W alone is V H elements, 1 GB at the published shape, read once per call), and a call whose
// statistics are not finite scans them to name the first non-finite element. Finite inputs whose logits overflow
// fp32 are named by no scan: their outputs stand, as SPEC's rule asks nothing of them.
bool finite_statistics(const RowStats& stats) {
  for (std::size_t r = 0; r < stats.rowsum.size(); ++r)
    if (!std::isfinite(stats.rowsum[r]) || !std::isfinite(stats.lse[r]) || !std::isfinite(stats.z_target[r]))
      return false;
  return true;
}

// x or weight as the runner needs them: [rows, padded(cols)] with zero padding, 16-byte aligned. In place when
// already so; otherwise a padded device copy held in `copy`.
template <class T>
const T* rows_for_runner(std::uintptr_t p, std::int64_t rows, std::int64_t cols, DeviceBuffer& copy, const char* name,
                         cudaStream_t stream, std::int64_t& extra) {
  const std::int64_t ld = padded(cols), e = sizeof(T);
  if (ld == cols && aligned16(p)) return reinterpret_cast<const T*>(p);
  copy = DeviceBuffer(static_cast<std::size_t>(rows * ld * e), std::string("a padded copy of ") + name, stream);
  extra += rows * ld * e;
  SIMPO_CUDA_CHECK(cudaMemsetAsync(copy.get(), 0, rows * ld * e, stream));
  SIMPO_CUDA_CHECK(cudaMemcpy2DAsync(copy.get(), ld * e, reinterpret_cast<const void*>(p), cols * e, cols * e, rows,
                                     cudaMemcpyDeviceToDevice, stream));
  return copy.as<T>();
}

// f(T()) with T the device element type of an input dtype.
template <class F> decltype(auto) with_element_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F16: return f(__half());
    case DType::F32: return f(0.0f);
    default: return f(__nv_bfloat16());
  }
}

// The gradient outputs compute_on_device gives the runner for a call (the DeviceGradients it builds), for its plan.
GradientOutputs gradient_outputs(const DeviceCall& c) {
  const Options& o = c.options;
  const bool f32 = o.grad_weight_f32 || c.input_dtype == DType::F32, want_weight = o.gradients && o.grad_weight;
  return GradientOutputs{.grad_x = o.gradients && o.grad_x,
                         .grad_weight_f32 = want_weight && f32,
                         .grad_weight_16bit = want_weight && !f32,
                         .grad_weight_lo = want_weight && c.grad_weight_lo != 0};
}

}  // namespace

DeviceResult compute_on_device(const DeviceCall& c) { return compute_on_device(c, Tuning{}); }

DeviceResult compute_on_device(const DeviceCall& c, const Tuning& tuning) {
  const Shape& s = c.shape;
  const Options& options = c.options;
  validate_shape(s);
  validate_hyperparameters(c.hp);
  if (!device_present()) throw InputError("the cuda backend was asked for, but no CUDA device is present");
  const std::int64_t N = s.N(), V = s.V, H = s.H, ld_h = padded(H);
  if (!is_input_dtype(c.input_dtype)) throw InputError("compute_on_device: inputs must be bf16, f16 or f32");
  // grad_weight and grad_bias are F32 for f32 inputs (SPEC: the inputs' dtype) or when asked for.
  const bool gradients = options.gradients, f32 = options.grad_weight_f32 || c.input_dtype == DType::F32;
  if (!c.x || !c.weight || !c.target) throw InputError("compute_on_device: x, weight and target must be device pointers");
  const bool want_x = gradients && options.grad_x, want_weight = gradients && options.grad_weight;
  if (gradients && !want_x && !want_weight)
    throw InputError("compute_on_device: gradients asked for with neither grad_x nor grad_weight (the forward alone is "
                     "options.gradients = false)");
  if ((want_x && !c.grad_x) || (want_weight && (!c.grad_weight || (c.bias && !c.grad_bias))))
    throw InputError("compute_on_device: gradients asked for, but no output buffer for one of them");
  for (std::uintptr_t p : {c.grad_x, c.grad_weight, c.grad_bias, c.grad_x_lo, c.grad_weight_lo, c.grad_bias_lo})
    if (!aligned16(p)) throw InputError("compute_on_device: output buffers must be 16-byte aligned");
  if ((c.grad_x_lo && c.input_dtype == DType::F32) || ((c.grad_weight_lo || c.grad_bias_lo) && f32))
    throw InputError("compute_on_device: rounding residues (grad_*_lo) are for bf16 and f16 outputs; an f32 output "
                     "has none to keep");
  if (c.workspace_size < 0 || (c.workspace && c.workspace % 256 != 0) || (c.workspace_size > 0 && !c.workspace))
    throw InputError("compute_on_device: the caller's workspace must be a 256-byte aligned device pointer with "
                     "workspace_size >= 0 bytes (device_workspace says how many)");
  if (c.forward_on_device) {
    if (c.input_dtype == DType::F16)
      throw InputError("compute_on_device: f16 inputs cannot take forward_on_device (their dz scale is planned from "
                       "the targets on the host)");
    for (std::uintptr_t p : c.forward_out)
      if (p == 0 || p % 4 != 0)
        throw InputError("compute_on_device: forward_on_device needs eight 4-byte aligned device buffers in "
                         "forward_out");
  }
  if (c.defer_weight_finish && !c.workspace)
    throw InputError("compute_on_device: defer_weight_finish needs DeviceCall::workspace: the deferred GEMM's operands "
                     "stay there until finish_weight_gradient_on_device (device_workspace says how many bytes)");

  SIMPO_CUDA_CHECK(cudaSetDevice(c.device));
  FusedRunner& runner = runner_for(c.device);
  const cudaStream_t stream = runner.stream();
  const auto caller = reinterpret_cast<cudaStream_t>(c.stream);
  // Every buffer below is stream-ordered on the runner's stream (device_buffer.h); without keep_workspace the
  // runner's scratch goes back to the pool when this call ends, however it ends.
  struct ReleaseWorkspace {
    FusedRunner& runner;
    bool keep;
    ~ReleaseWorkspace() {
      if (!keep) runner.release_workspace();
    }
  } release_workspace{runner, c.keep_workspace};

  // Everything below reads the inputs only after the caller's stream has produced them.
  runner.follow(caller);
  // The targets: read and checked by the host (SPEC's errors), or counted and checked on the device.
  const Problem targets = c.forward_on_device ? Problem{} : targets_problem(c, stream);
  DeviceTargets on_device;
  if (c.forward_on_device) {
    on_device = runner.device_targets(N, s.B);
    launch_device_targets(reinterpret_cast<const std::int64_t*>(c.target), s.B, s.T, V, c.hp.ignore_index,
                          c.hp.empty_sequence == EmptySequence::error, on_device, stream);
  }

  DeviceResult result;
  DeviceBuffer x_copy, weight_copy, weight_acc, bias_acc;
  const CallerMemory memory{reinterpret_cast<char*>(c.workspace), c.workspace_size};
  HiLoChunk deferred;
  bool finite = true;
  with_element_type(c.input_dtype, [&]<class T>(T) {
    DeviceProblemOf<T> dp;
    dp.shape = s;
    dp.hp = c.hp;
    dp.ld_h = ld_h;
    dp.x = rows_for_runner<T>(c.x, N, H, x_copy, "x", stream, result.extra_device_bytes);
    dp.weight = rows_for_runner<T>(c.weight, V, H, weight_copy, "weight", stream, result.extra_device_bytes);
    dp.bias = reinterpret_cast<const T*>(c.bias);
    dp.target = c.forward_on_device ? on_device.checked : reinterpret_cast<const std::int64_t*>(c.target);
    if (c.forward_on_device)
      dp.on_device = on_device;
    else
      dp.targets = read_targets(targets);

    // grad_weight: an F32 output (f32 inputs, or grad_weight_f32) is its own fp32 [V, padded(H)] accumulator (a
    // padded one when H % 8 != 0); a 16-bit output is all the runner needs (the hi/lo pair over it, or an fp32
    // accumulator of its own: the plan says which). grad_bias accumulates in fp32, rounded into a 16-bit output.
    DeviceGradientsOf<T> g;
    if (want_x) {
      g.grad_x = reinterpret_cast<T*>(c.grad_x);
      g.grad_x_lo = reinterpret_cast<T*>(c.grad_x_lo);
    }
    if (want_weight) {
      g.grad_weight_lo = reinterpret_cast<T*>(c.grad_weight_lo);
      g.grad_bias_lo = reinterpret_cast<T*>(c.grad_bias_lo);
      if (f32 && ld_h == H) {
        g.grad_weight = reinterpret_cast<float*>(c.grad_weight);
      } else if (f32) {
        weight_acc = DeviceBuffer(static_cast<std::size_t>(V * ld_h * 4), "the fp32 grad_weight accumulator", stream);
        result.extra_device_bytes += V * ld_h * 4;
        g.grad_weight = weight_acc.as<float>();
      } else {
        g.grad_weight_16bit = reinterpret_cast<T*>(c.grad_weight);
      }
      if (c.bias && f32) {
        g.grad_bias = reinterpret_cast<float*>(c.grad_bias);
      } else if (c.bias) {
        bias_acc = DeviceBuffer(static_cast<std::size_t>(V * 4), "the fp32 grad_bias accumulator", stream);
        result.extra_device_bytes += V * 4;
        g.grad_bias = bias_acc.as<float>();
        g.grad_bias_16bit = reinterpret_cast<T*>(c.grad_bias);
      }
    }
    float* forward_out[8];
    for (int i = 0; i < 8; ++i) forward_out[i] = reinterpret_cast<float*>(c.forward_out[i]);
    const RowStats stats = runner.run(dp, gradients ? &g : nullptr, options, tuning, c.workspace ? &memory : nullptr,
                                      c.defer_weight_finish ? &deferred : nullptr,
                                      c.forward_on_device ? forward_out : nullptr);
    if (want_weight && f32 && ld_h != H)
      SIMPO_CUDA_CHECK(cudaMemcpy2DAsync(reinterpret_cast<void*>(c.grad_weight), H * 4, weight_acc.get(), ld_h * 4,
                                         H * 4, V, cudaMemcpyDeviceToDevice, stream));
    if (!c.forward_on_device) {
      result.forward = forward_outputs(targets, dp.targets, stats);
      finite = finite_statistics(stats);
    }
  });
  if (c.forward_on_device && options.validate) {
    // The call's one synchronization: the device's verdict, which exists once the forward's statistics do (the
    // gradient work may still run). Invalid targets are read by the host only now, for SPEC's message (the copy
    // waits for the whole step); the outputs are discarded.
    const FusedRunner::Verdict verdict = runner.verdict();
    if (verdict.invalid_targets) {
      targets_problem(c, stream);
      throw InputError("compute_on_device: the device found an invalid target that the host's check did not (a bug: "
                       "please report it)");
    }
    finite = !verdict.nonfinite_statistics;
  }
  // What the backend held beside the caller's buffers: nothing of the plan's when the call ran in its workspace.
  if (!c.workspace) {
    result.workspace_bytes = runner.last_report().workspace_bytes;
    result.extra_device_bytes += runner.last_report().accumulator_bytes;
  }
  result.plan = runner.last_report().to_string();
  const bool deferred_weight = runner.last_report().deferred_weight;
  if (deferred_weight) result.plan += ", the last weight GEMM deferred";

  // SPEC's NaN/Inf rule: the scan that names the element, only where the statistics are not finite.
  if (options.validate && !finite) {
    ValueScan scan(c, runner.caller_ready());
    scan.join(stream);
    SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
    scan.check();
  }
  // The caller's later work waits for the outputs; the temporaries are freed only after the runner's stream is done
  // with them.
  runner.precede(caller);
  if (!c.forward_on_device) SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (deferred_weight)
    result.pending.state = std::make_shared<PendingWeightGradient::State>(
        PendingWeightGradient::State{.device = c.device, .chunk = deferred});
  return result;
}

DeviceWorkspace device_workspace(const DeviceCall& c) { return device_workspace(c, Tuning{}); }

DeviceWorkspace device_workspace(const DeviceCall& c, const Tuning& tuning) {
  if (!is_input_dtype(c.input_dtype) || !device_present()) return {};
  const GradientOutputs outputs = gradient_outputs(c);
  try {
    validate_shape(c.shape);
    SIMPO_CUDA_CHECK(cudaSetDevice(c.device));
    const StepPlan plan = plan_step(c.shape, c.input_dtype, c.options, device_features(),
                                    c.options.gradients ? &outputs : nullptr, tuning);
    return {plan.caller_workspace_bytes(), plan.defers_weight_finish()};
  } catch (const InputError&) {
    return {};  // compute_on_device refuses the call, with the message
  }
}

bool waiting(const PendingWeightGradient& pending) { return pending.state && !pending.state->finished; }

namespace {

// The deferred GEMM's state, checked as both finishes need: something deferred, not finished yet.
PendingWeightGradient::State& unfinished(const PendingWeightGradient& pending) {
  if (!pending.state)
    throw InputError("finish_weight_gradient_on_device: nothing was deferred (the call ran its whole step: it did not "
                     "ask for defer_weight_finish, or its plan keeps no bf16 hi/lo pair)");
  PendingWeightGradient::State& state = *pending.state;
  if (state.finished)
    throw InputError("finish_weight_gradient_on_device: this grad_weight was finished already (a deferred GEMM takes "
                     "its scale once; its operands are spent)");
  return state;
}

// The deferred GEMM, once, with `scale`.
void run_deferred(PendingWeightGradient::State& state, Scale scale, std::uintptr_t stream) {
  SIMPO_CUDA_CHECK(cudaSetDevice(state.device));
  state.finished = true;  // a failed launch leaves the pair half written: never run twice
  accumulate_hilo_chunk(state.chunk, scale, reinterpret_cast<cudaStream_t>(stream));
}

// A DeviceScalar's float, checked: set and 4-byte aligned. `what` names the caller in the error.
const float* device_scale(DeviceScalar scale, const char* what) {
  if (!scale.address || scale.address % 4 != 0)
    throw InputError(std::string(what) + ": the scale must be a 4-byte aligned float on the device");
  return reinterpret_cast<const float*>(scale.address);
}

// The scale as launch_scale takes it, checked: a finite double, or a DeviceScalar's float.
double checked_scale(double scale) {
  if (!std::isfinite(scale)) throw InputError("scale_gradient_on_device: the scale must be finite");
  return scale;
}
const float* checked_scale(DeviceScalar scale) { return device_scale(scale, "scale_gradient_on_device"); }

// Both scale_gradient_on_device forms: the checks, then launch_scale over the dtype's element type.
template <class S>
void scale_gradient(DType dtype, std::uintptr_t hi, std::uintptr_t lo, std::int64_t n, S scale, std::uintptr_t out,
                    int device, std::uintptr_t stream) {
  if (!is_input_dtype(dtype)) throw InputError("scale_gradient_on_device: the dtype must be bf16, f16 or f32");
  if (!hi || !out || n < 0) throw InputError("scale_gradient_on_device: hi and out must be device pointers, n >= 0");
  const auto factor = checked_scale(scale);
  SIMPO_CUDA_CHECK(cudaSetDevice(device));
  with_element_type(dtype, [&]<class T>(T) {
    launch_scale(reinterpret_cast<const T*>(hi), reinterpret_cast<const T*>(lo), n, factor,
                 reinterpret_cast<T*>(out), reinterpret_cast<cudaStream_t>(stream));
  });
}

}  // namespace

void finish_weight_gradient_on_device(const PendingWeightGradient& pending, double scale, std::uintptr_t stream) {
  PendingWeightGradient::State& state = unfinished(pending);
  const float s = static_cast<float>(scale);
  if (!std::isfinite(scale) || !std::isfinite(s))
    throw InputError("finish_weight_gradient_on_device: the scale must be finite in fp32, got " +
                     std::to_string(scale));
  run_deferred(state, Scale{.value = s}, stream);
}

void finish_weight_gradient_on_device(const PendingWeightGradient& pending, DeviceScalar scale, std::uintptr_t stream) {
  PendingWeightGradient::State& state = unfinished(pending);
  run_deferred(state, Scale{.device = device_scale(scale, "finish_weight_gradient_on_device")}, stream);
}

void scale_gradient_on_device(DType dtype, std::uintptr_t hi, std::uintptr_t lo, std::int64_t n, double scale,
                              std::uintptr_t out, int device, std::uintptr_t stream) {
  scale_gradient(dtype, hi, lo, n, scale, out, device, stream);
}

void scale_gradient_on_device(DType dtype, std::uintptr_t hi, std::uintptr_t lo, std::int64_t n, DeviceScalar scale,
                              std::uintptr_t out, int device, std::uintptr_t stream) {
  scale_gradient(dtype, hi, lo, n, scale, out, device, stream);
}

DeviceInputs upload_inputs(const Problem& problem, cudaStream_t stream) {
  const Shape& s = problem.shape;
  const std::int64_t N = s.N(), V = s.V, H = s.H, ld_h = padded(H);
  auto upload_rows = [&](const std::vector<bf16>& host, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                         const std::string& name) {
    DeviceBuffer device(static_cast<std::size_t>(rows * ld * 2), name, stream);
    if (ld != cols) SIMPO_CUDA_CHECK(cudaMemsetAsync(device.get(), 0, rows * ld * 2, stream));
    SIMPO_CUDA_CHECK(cudaMemcpy2DAsync(device.get(), ld * 2, host.data(), cols * 2, cols * 2, rows,
                                       cudaMemcpyHostToDevice, stream));
    return device;
  };
  DeviceInputs in;
  in.x = upload_rows(problem.x.as<bf16>(), N, H, ld_h, "x");
  in.weight = upload_rows(problem.weight.as<bf16>(), V, H, ld_h, "weight");
  if (problem.has_bias()) in.bias = upload_rows(problem.bias->as<bf16>(), 1, V, V, "bias");
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

TensorMap compute(const Problem& problem, const Options& options) { return compute(problem, options, Tuning{}); }

// The host problem's tensors to dense device buffers, compute_on_device on them (which scans the values there),
// the outputs back.
TensorMap compute(const Problem& problem, const Options& options, const Tuning& tuning) {
  const Shape& s = problem.shape;
  // SPEC's rules but the value scan, which compute_on_device runs on the device (the copies read the host vectors).
  validate(problem, {.scan_values = false});
  if (!device_present()) throw InputError("the cuda backend was asked for, but no CUDA device is present");
  const std::int64_t N = s.N(), V = s.V, H = s.H;

  int device = 0;
  SIMPO_CUDA_CHECK(cudaGetDevice(&device));
  const cudaStream_t stream = runner_for(device).stream();
  auto upload = [&](const void* host, std::size_t bytes, const char* name) {
    DeviceBuffer buffer(bytes, name, stream);
    SIMPO_CUDA_CHECK(cudaMemcpyAsync(buffer.get(), host, bytes, cudaMemcpyHostToDevice, stream));
    return buffer;
  };
  auto upload_values = [&](const InputValues& values, const char* name) {
    return values.visit([&](const auto& v) { return upload(v.data(), v.size() * sizeof(v[0]), name); });
  };
  const DeviceBuffer x = upload_values(problem.x, "x"), weight = upload_values(problem.weight, "weight"),
                     target = upload(problem.target.data(), N * 8, "target"),
                     bias = problem.has_bias() ? upload_values(*problem.bias, "bias") : DeviceBuffer();
  const DType input = problem.input_dtype();
  const std::int64_t input_element = static_cast<std::int64_t>(dtype_size(input));
  const bool f32 = options.grad_weight_f32 || input == DType::F32;
  const DType weight_dtype = f32 ? DType::F32 : input;
  const std::int64_t weight_element = f32 ? 4 : input_element;
  DeviceBuffer grad_x, grad_weight, grad_bias;
  const bool want_x = options.gradients && options.grad_x, want_weight = options.gradients && options.grad_weight;
  if (want_x) grad_x = DeviceBuffer(static_cast<std::size_t>(N * H * input_element), "grad_x", stream);
  if (want_weight) {
    grad_weight = DeviceBuffer(static_cast<std::size_t>(V * H * weight_element), "grad_weight", stream);
    if (problem.has_bias()) grad_bias = DeviceBuffer(static_cast<std::size_t>(V * weight_element), "grad_bias", stream);
  }

  DeviceCall call;
  call.shape = s;
  call.hp = problem.hp;
  call.input_dtype = input;
  call.device = device;
  call.stream = reinterpret_cast<std::uintptr_t>(stream);
  call.x = reinterpret_cast<std::uintptr_t>(x.get());
  call.weight = reinterpret_cast<std::uintptr_t>(weight.get());
  call.bias = reinterpret_cast<std::uintptr_t>(bias.get());
  call.target = reinterpret_cast<std::uintptr_t>(target.get());
  call.grad_x = reinterpret_cast<std::uintptr_t>(grad_x.get());
  call.grad_weight = reinterpret_cast<std::uintptr_t>(grad_weight.get());
  call.grad_bias = reinterpret_cast<std::uintptr_t>(grad_bias.get());
  call.options = options;
  DeviceResult result = compute_on_device(call, tuning);

  TensorMap out = std::move(result.forward);
  auto download = [&](const DeviceBuffer& device_buffer, DType dtype, const std::string& name) {
    Tensor t(dtype, output_shape(s, name));
    SIMPO_CUDA_CHECK(cudaMemcpyAsync(t.bytes.data(), device_buffer.get(), t.bytes.size(), cudaMemcpyDeviceToHost, stream));
    out[name] = std::move(t);
  };
  if (want_x) download(grad_x, input, output_name::grad_x);
  if (want_weight) {
    download(grad_weight, weight_dtype, output_name::grad_weight);
    if (problem.has_bias()) download(grad_bias, weight_dtype, output_name::grad_bias);
  }
  SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

}  // namespace simpo::fused::cuda
