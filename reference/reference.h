// The exact function of SPEC in float64 on the CPU: the oracle every other implementation is judged against.
// Reads the inputs (bf16, f16 or f32) exactly, computes in double, never holds more logits than one chunk.
#pragma once

#include "problem/problem.h"

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace simpo::reference {

// Which float64 reference computes (SPEC's `--reference cpu|cuda|auto`). automatic: the GPU one where a device
// is present and this build has it, else the CPU one.
enum class Device { cpu, cuda, automatic };
std::string device_name(Device);             // "cpu", "cuda", "auto"
Device device_from_name(const std::string&);  // throws InputError naming the choices
bool cuda_available();                         // reference-cuda was built and a device is present
std::string cuda_unavailable_reason();         // "" when cuda_available(), else why not (no build, no device)
Device resolve(Device);                        // automatic -> cuda or cpu; cuda unavailable: InputError naming why
// For one problem: automatic is cuda only where it is available and the problem is large enough for the GPU to
// win (N V H >= 2^28 multiply-adds in the logits; below that the CPU finishes in tens of milliseconds, less than
// the device's allocations and launches cost, and a parallel sweep's threads would serialize on cudaFree).
Device resolve(Device, const Shape&);
// The device an Options{} starts with: cpu unless a program says otherwise (simpo-verify's --reference sets it once,
// so every reference run of that command, wherever the verifier makes its Options, follows it).
Device default_device();
void set_default_device(Device);

// What the verifier's error model needs from the exact softmax of each row (verifier/error_bounds.cpp), which
// would otherwise recompute every row's logits (O(N H V), the cost of a third of the reference). The reference has
// them in hand in its dz pass. Rows whose dz is zero (ignored tokens, k = 0) are left 0.
struct OffTargetSoftmax {
  std::vector<double> norm;  // [N] sqrt(sum over v != target of p_v^2)
  std::vector<double> max;   // [N] max over v != target of p_v
};

struct Options {
  bool gradients = true;  // false: loss and auxiliary outputs only
  // cpu: OpenBLAS products on every core. cuda: reference-cuda (reference/cuda), the same schedule with cuBLAS
  // DGEMM and float64 kernels, chunks in device memory; its progress is reported once per block.
  Device device = default_device();
  // The matrix products in one fixed summation order (plain loops, no BLAS, no threads, no FMA contraction):
  // the outputs are then the same bits on every x86-64 CPU, vector width and thread count. For the golden
  // fixtures, which are small; far slower than the BLAS products. CPU only (device is ignored).
  bool reproducible = false;
  // Rows of logits held at once (memory: rows * V * 8 bytes). With gradients, a chunk of at least 2T rows holds
  // whole pairs and each row's logits are computed once (3 GEMMs in all); a smaller chunk splits a pair, so the
  // logits are computed twice, once for the pair's statistics and once for its gradient (4 GEMMs).
  // 0: whole pairs when one pair's logits fit in 4 GiB (the published workload: 2.1 GB), else ~256 MiB chunks.
  std::int64_t chunk_rows = 0;
  // Called with the fraction done; the CLI prints it on stderr for long runs. May be empty.
  std::function<void(double)> progress;
  // With gradients on: where to put the rows' off-target softmax (resized to N), or null.
  OffTargetSoftmax* off_target = nullptr;
};

// Threads the CPU reference gives each of its products (OpenBLAS's, process-wide; default: every core); returns the
// previous count. A parallel sweep sets 1 while it runs: its cases already occupy every core, and small products
// lose more to BLAS threading than they gain (measured: 300 sweep cases in 4.8 s with 2 BLAS threads, 2.8 s with 1).
int set_cpu_product_threads(int);

// Host memory compute() takes for this shape beyond the problem itself. CPU: the inputs widened to float64, the
// float64 gradients, one chunk of float64 logits and a few numbers per row (about 16 (N H + V H) + 8 chunk V bytes:
// 10.6 GB at the published B = 2, 11.6 GB at B = 16). Options::device = cuda: the float64 gradients and a few
// numbers per row (8 (N H + V H): 4.3 GB at B = 2); its device memory is cuda::required_device_bytes (the CPU's
// host figure, the bf16 inputs staged within it). compute() refuses (InputError naming the bytes) a run that
// needs more than the machine (or the device) has, before allocating.
std::int64_t required_bytes(const Shape&, bool bias, const Options& = {});

// The float64 gradients left in device memory by reference-cuda, for the verifier's device comparison
// (verifier/device_compare.h): at the published B = 2 grad_weight alone is 4.2 GB, which would otherwise cross to
// the host to be compared there. The memory is freed with the last copy of `data`.
struct DeviceArray {
  std::shared_ptr<const double> data;  // a device pointer
  std::vector<std::int64_t> shape;
  int device = 0;  // the CUDA device ordinal that holds it
  std::int64_t numel() const;
};
struct DeviceOutputs {
  TensorMap host;                                // every output but the gradients, F64 (as compute() gives them)
  std::map<std::string, DeviceArray> gradients;  // grad_x, grad_weight, and grad_bias with a bias
};
// compute() on reference-cuda with Options::gradients on and the gradients kept on the device (options.device is
// ignored). InputError where reference-cuda cannot run here (naming why) or the inputs are not bf16.
DeviceOutputs compute_on_device(const Problem&, const Options& = {});

// Validates (simpo::validate) and computes SPEC's outputs: every tensor F64, grad_bias only with a bias.
// When compute_nll_loss is on but there is no chosen completion token (allowed only with alpha = 0), nll_loss
// is reported as 0 rather than 0/0.
TensorMap compute(const Problem&, const Options& = {});

}  // namespace simpo::reference
