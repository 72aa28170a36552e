// How close reference-cuda runs to its floor: the three float64 GEMMs any forward+backward of a linear layer must
// do, through the same cuBLAS calls, on device-resident operands of the same shapes, timed with CUDA events in the
// same process (median of --reps), against reference-cuda on the same inputs:
//   - device part: its blocks (GEMMs, row kernels, per-pair terms), inputs already widened on the device;
//   - with transfers: + bf16 inputs to the device and widening, + float64 gradients back to the host;
//   - compute(): reference::compute end to end (validation, host output tensors, all of the above).
// One problem of the largest B is generated; each smaller B takes its first pairs (chosen rows 0..p-1, rejected
// rows P..P+p-1), so the generator runs once.
#include "problem/generate.h"
#include "reference/cuda/reference_cuda.h"
#include "reference/reference.h"

#include <CLI/CLI.hpp>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace simpo;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + ": " + cublasGetStatusString(s));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The first `pairs` pairs of p.
Problem first_pairs(const Problem& p, std::int64_t pairs) {
  const Shape& s = p.shape;
  if (pairs == s.P()) return p;
  Problem q = p;
  q.shape.B = 2 * pairs;
  std::vector<bf16> x;
  q.target.clear();
  for (std::int64_t side = 0; side < 2; ++side) {
    const std::int64_t b0 = side * s.P();
    const std::vector<bf16>& px = p.x.as<bf16>();
    x.insert(x.end(), px.begin() + b0 * s.T * s.H, px.begin() + (b0 + pairs) * s.T * s.H);
    q.target.insert(q.target.end(), p.target.begin() + b0 * s.T, p.target.begin() + (b0 + pairs) * s.T);
  }
  q.x = std::move(x);
  return q;
}

// The floor: Z = X W^T, dX = Z W, dW += Z^T X, as reference_cuda.cpp calls them; ms per GEMM (median).
std::vector<double> gemm_floor(const Problem& p, int reps) {
  const Shape& s = p.shape;
  const std::int64_t N = s.N(), H = s.H, V = s.V;
  auto upload = [](const std::vector<bf16>& values) {
    std::vector<double> wide(values.size());
#pragma omp parallel for
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(values.size()); ++i) wide[i] = static_cast<double>(static_cast<float>(values[i]));
    double* d = nullptr;
    check(cudaMalloc(reinterpret_cast<void**>(&d), wide.size() * sizeof(double)), "cudaMalloc");
    check(cudaMemcpy(d, wide.data(), wide.size() * sizeof(double), cudaMemcpyHostToDevice), "upload");
    return d;
  };
  double* X = upload(p.x.as<bf16>());
  double* W = upload(p.weight.as<bf16>());
  double *Z = nullptr, *dX = nullptr, *dW = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&Z), N * V * sizeof(double)), "cudaMalloc Z");
  check(cudaMalloc(reinterpret_cast<void**>(&dX), N * H * sizeof(double)), "cudaMalloc dX");
  check(cudaMalloc(reinterpret_cast<void**>(&dW), V * H * sizeof(double)), "cudaMalloc dW");
  check(cudaMemset(dW, 0, V * H * sizeof(double)), "memset");
  cublasHandle_t blas;
  check(cublasCreate(&blas), "cublasCreate");
  const double one = 1.0, zero = 0.0;
  const int n = static_cast<int>(N), h = static_cast<int>(H), v = static_cast<int>(V);
  auto logits = [&] { check(cublasDgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, v, n, h, &one, W, h, X, h, &zero, Z, v), "gemm Z"); };
  auto grad_x = [&] { check(cublasDgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, h, n, v, &one, W, h, Z, v, &zero, dX, h), "gemm dX"); };
  auto grad_w = [&] { check(cublasDgemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, h, v, n, &one, X, h, Z, v, &one, dW, h), "gemm dW"); };
  // Z must hold real logits scaled like dz before the other two run on it: the first logits GEMM gives that.
  std::vector<std::vector<double>> times(3);
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  int which = 0;
  for (const std::function<void()>& gemm : {std::function<void()>(logits), std::function<void()>(grad_x), std::function<void()>(grad_w)}) {
    gemm();  // warm-up
    for (int r = 0; r < reps; ++r) {
      check(cudaEventRecord(start), "event");
      gemm();
      check(cudaEventRecord(stop), "event");
      check(cudaEventSynchronize(stop), "gemm");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start, stop), "event");
      times[which].push_back(ms);
    }
    ++which;
  }
  cublasDestroy(blas);
  for (double* d : {X, W, Z, dX, dW}) cudaFree(d);
  return {median(times[0]), median(times[1]), median(times[2])};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Times reference-cuda against three cuBLAS float64 GEMMs of the same shapes"};
  std::vector<std::int64_t> Bs{2, 16};
  Shape shape{16, 1024, 4096, 128256};  // the published workload
  int reps = 3;
  std::uint64_t seed = 1;
  bool bias = false;
  app.add_option("--B", Bs, "sequences (even), one or more; default 2 16");
  app.add_option("--T", shape.T, "tokens per sequence");
  app.add_option("--H", shape.H, "hidden size");
  app.add_option("--V", shape.V, "vocabulary size");
  app.add_option("--reps", reps, "timed repetitions (median)");
  app.add_option("--seed", seed, "case seed");
  app.add_flag("--bias", bias, "give the LM head a bias");
  CLI11_PARSE(app, argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);

  try {
    if (!reference::cuda_available()) {
      std::fprintf(stderr, "error: %s\n", reference::cuda_unavailable_reason().c_str());
      return 2;
    }
    shape.B = *std::max_element(Bs.begin(), Bs.end());
    std::printf("device %s\n", reference::cuda::device_description().c_str());
    CaseSpec spec;
    spec.shape = shape;
    spec.seed = seed;
    spec.bias = bias;
    auto t = std::chrono::steady_clock::now();
    const Problem all = generate(spec);
    std::printf("generate %s: %.1f s\n", shape.to_string().c_str(), seconds_since(t));

    std::printf("%-4s | %-30s | %-25s | %-26s | %-18s | %s\n", "B", "three DGEMMs ms (TFLOP/s)", "device part ms (ratio)",
                "with transfers ms (ratio)", "compute() ms (ratio)", "upload / download ms, loss");
    for (const std::int64_t B : Bs) {
      const Problem p = first_pairs(all, B / 2);
      const std::vector<double> floor = gemm_floor(p, reps);
      const double floor_ms = floor[0] + floor[1] + floor[2];
      const double flops = 6.0 * static_cast<double>(p.shape.N()) * static_cast<double>(shape.H) * static_cast<double>(shape.V);

      reference::Options options;
      options.device = reference::Device::cuda;
      std::vector<double> device_ms, transfer_ms, upload_ms, download_ms, total_ms;
      double loss = 0;
      for (int r = 0; r < reps + 1; ++r) {  // the first is a warm-up
        std::vector<double> gx(p.shape.N() * shape.H), gw(shape.V * shape.H), gb(bias ? shape.V : 0);
        reference::cuda::Timings timings;
        reference::cuda::compute_core(p, options, {gx, gw, gb}, &timings);
        t = std::chrono::steady_clock::now();
        const TensorMap out = reference::compute(p, options);
        const double total = seconds_since(t);
        loss = out.at("loss").value(0);
        if (r == 0) continue;
        device_ms.push_back(1e3 * timings.compute);
        transfer_ms.push_back(1e3 * (timings.upload + timings.compute + timings.download));
        upload_ms.push_back(1e3 * timings.upload);
        download_ms.push_back(1e3 * timings.download);
        total_ms.push_back(1e3 * total);
      }
      const double d = median(device_ms), w = median(transfer_ms), c = median(total_ms);
      std::printf("%-4lld | %6.1f+%6.1f+%6.1f=%6.1f (%4.1f) | %8.1f (%5.2f)          | %8.1f (%5.2f)           | %7.1f (%5.2f)    | %.0f / %.0f, %.17g\n",
                  static_cast<long long>(B), floor[0], floor[1], floor[2], floor_ms, flops / (floor_ms * 1e-3) * 1e-12, d,
                  d / floor_ms, w, w / floor_ms, c, c / floor_ms, median(upload_ms), median(download_ms), loss);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return 0;
}
