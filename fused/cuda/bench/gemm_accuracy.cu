// Diagnostic for the logits GEMM: how exact are its fp32 logits, and how fast is it. The fused scalars (loss,
// nll, logps) inherit the logits' error, so this measures, against fp64 on the host, the mean signed relative
// error (a bias: rounding toward zero in the tensor cores' fp32 accumulation makes it negative and grow with K)
// and the RMS relative error, for
//   cuBLAS CUBLAS_COMPUTE_32F        (tensor cores; the backend's sliced path),
//   cuBLAS CUBLAS_COMPUTE_32F_PEDANTIC (IEEE fp32 throughout, slow),
//   the promoted GEMM (promoted_gemm.h; sm_90 with CUTLASS), promoting every 64 / 128 / 256 / 512 k (the
//   interval trades the drains of the wgmma queue against the bias of a longer tensor-core accumulation),
// then checks the promoted GEMM at odd shapes (every element written, against fp64), then times each at the
// published workload's shapes next to the bf16-output cuBLAS GEMM (the floor torch runs).
//   gemm_accuracy [--quick]   (--quick: accuracy and odd shapes only)
#include "fused/cuda/bench/random_fill.cuh"
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_buffer.h"
#include "fused/cuda/promoted_gemm.h"

#include <CLI/CLI.hpp>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

using namespace simpo::fused::cuda;

namespace {

// The host cases' draws, one after another from one seed.
std::uint64_t draws = 0;
double uniform_pm1() { return bench::uniform_pm1(12345, draws++); }

// Row-major Z[M, N] (ldz) = X[M, K] W[N, K]^T as column-major Z^T = W X^T; fp32 or bf16 output.
void cublas_logits(cublasHandle_t h, cublasComputeType_t compute, int M, int N, int K, const __nv_bfloat16* x,
                   const __nv_bfloat16* w, void* z, int ldz, cudaDataType out_type = CUDA_R_32F) {
  const float one = 1.0f, zero = 0.0f;
  SIMPO_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K, x, CUDA_R_16BF, K,
                                  &zero, z, out_type, ldz, compute, CUBLAS_GEMM_DEFAULT));
}

struct HostCase {
  int M, N, K, ldz;
  std::vector<__nv_bfloat16> x, w;
  std::vector<double> exact;
};

// x ~ U(-sqrt3, sqrt3), w scaled for logits of standard deviation `sd`; K may exceed the `filled` columns
// (padding zeros, as the backend's ld_h padding).
HostCase make_case(int M, int N, int K, int filled, int ldz, double sd) {
  HostCase c{M, N, K, ldz, {}, {}, {}};
  c.x.resize(static_cast<std::size_t>(M) * K);
  c.w.resize(static_cast<std::size_t>(N) * K);
  std::vector<double> xd(c.x.size()), wd(c.w.size());
  const double wscale = std::sqrt(3.0 * sd * sd / filled);
  for (std::size_t i = 0; i < c.x.size(); ++i) {
    c.x[i] = __float2bfloat16_rn(static_cast<int>(i % K) < filled ? static_cast<float>(1.7320508 * uniform_pm1()) : 0.f);
    xd[i] = __bfloat162float(c.x[i]);
  }
  for (std::size_t i = 0; i < c.w.size(); ++i) {
    c.w[i] = __float2bfloat16_rn(static_cast<int>(i % K) < filled ? static_cast<float>(wscale * uniform_pm1()) : 0.f);
    wd[i] = __bfloat162float(c.w[i]);
  }
  c.exact.assign(static_cast<std::size_t>(M) * N, 0.0);
  for (int r = 0; r < M; ++r)
    for (int n = 0; n < N; ++n) {
      double s = 0;
      const double* xr = &xd[static_cast<std::size_t>(r) * K];
      const double* wr = &wd[static_cast<std::size_t>(n) * K];
      for (int k = 0; k < K; ++k) s += xr[k] * wr[k];
      c.exact[static_cast<std::size_t>(r) * N + n] = s;
    }
  return c;
}

struct Errors {
  double mean_signed = 0, rms = 0, max_abs_over_max = 0;
  std::size_t count = 0, bad = 0;  // bad: non-finite (unwritten: the output was poisoned with NaN)
};

Errors compare(const HostCase& c, const std::vector<float>& z) {
  Errors e;
  double signed_sum = 0, square_sum = 0, max_abs = 0, max_exact = 0;
  for (int r = 0; r < c.M; ++r)
    for (int n = 0; n < c.N; ++n) {
      const double got = z[static_cast<std::size_t>(r) * c.ldz + n], exact = c.exact[static_cast<std::size_t>(r) * c.N + n];
      if (!std::isfinite(got)) {
        ++e.bad;
        continue;
      }
      max_abs = std::max(max_abs, std::abs(got - exact));
      max_exact = std::max(max_exact, std::abs(exact));
      if (std::abs(exact) < 1.0) continue;  // relative error of near-zero logits says nothing
      const double rel = (got - exact) / std::abs(exact);
      signed_sum += (exact > 0 ? rel : -rel);  // > 0: magnitude too large, < 0: toward zero
      square_sum += rel * rel;
      ++e.count;
    }
  e.mean_signed = e.count ? signed_sum / e.count : 0;
  e.rms = e.count ? std::sqrt(square_sum / e.count) : 0;
  e.max_abs_over_max = max_exact > 0 ? max_abs / max_exact : max_abs;
  return e;
}

// Median of `reps` event-timed calls after `warmup`.
double median_ms(int warmup, int reps, const std::function<void()>& body) {
  for (int i = 0; i < warmup; ++i) body();
  SIMPO_CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  SIMPO_CUDA_CHECK(cudaEventCreate(&a));
  SIMPO_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    SIMPO_CUDA_CHECK(cudaEventRecord(a));
    body();
    SIMPO_CUDA_CHECK(cudaEventRecord(b));
    SIMPO_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    SIMPO_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  SIMPO_CUDA_CHECK(cudaEventDestroy(a));
  SIMPO_CUDA_CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  CLI::App app{"The logits GEMM's error against fp64 and its speed beside cuBLAS's"};
  app.add_flag("--quick", quick, "accuracy and odd shapes only (no timing)");
  CLI11_PARSE(app, argc, argv);
  try {
    cublasHandle_t h;
    SIMPO_CUBLAS_CHECK(cublasCreate(&h));
    const bool promoted = promoted_logits_available();
    DeviceBuffer scratch(std::size_t{32} << 20, "GEMM scratch");
    std::printf("promoted GEMM: %s\n", promoted ? "available" : "not available (no CUTLASS build or not sm_90)");

    // Each candidate: a name and a call writing fp32 Z (ldz) for the case.
    struct Candidate {
      std::string name;
      std::function<void(const HostCase&, const __nv_bfloat16*, const __nv_bfloat16*, float*)> run;
    };
    std::vector<Candidate> candidates = {
        {"cuBLAS 32F", [&](const HostCase& c, auto x, auto w, float* z) { cublas_logits(h, CUBLAS_COMPUTE_32F, c.M, c.N, c.K, x, w, z, c.ldz); }},
        {"cuBLAS PEDANTIC", [&](const HostCase& c, auto x, auto w, float* z) { cublas_logits(h, CUBLAS_COMPUTE_32F_PEDANTIC, c.M, c.N, c.K, x, w, z, c.ldz); }},
    };
    for (std::int64_t pk : {std::int64_t{512}, std::int64_t{256}, std::int64_t{128}, std::int64_t{64}})
      if (promoted)
        candidates.push_back({"promoted every " + std::to_string(pk), [&, pk](const HostCase& c, auto x, auto w, float* z) {
                                promoted_logits(c.M, c.N, c.K, x, w, z, c.ldz, pk, nullptr, scratch.get(), scratch.bytes());
                              }});

    auto check = [&](const HostCase& c, const char* label) {
      DeviceBuffer dx(c.x.size() * 2, "x"), dw(c.w.size() * 2, "w"), dz(static_cast<std::size_t>(c.M) * c.ldz * 4, "z");
      SIMPO_CUDA_CHECK(cudaMemcpy(dx.get(), c.x.data(), c.x.size() * 2, cudaMemcpyHostToDevice));
      SIMPO_CUDA_CHECK(cudaMemcpy(dw.get(), c.w.data(), c.w.size() * 2, cudaMemcpyHostToDevice));
      for (const Candidate& cand : candidates) {
        SIMPO_CUDA_CHECK(cudaMemset(dz.get(), 0xff, dz.bytes()));  // NaN: unwritten elements show
        cand.run(c, dx.as<__nv_bfloat16>(), dw.as<__nv_bfloat16>(), dz.as<float>());
        SIMPO_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> z(static_cast<std::size_t>(c.M) * c.ldz);
        SIMPO_CUDA_CHECK(cudaMemcpy(z.data(), dz.get(), z.size() * 4, cudaMemcpyDeviceToHost));
        const Errors e = compare(c, z);
        std::printf("%-22s %-42s | %12.3e %12.3e | %10.2e | %zu checked, %zu unwritten%s\n", label, cand.name.c_str(),
                    e.mean_signed, e.rms, e.max_abs_over_max, e.count, e.bad, e.bad || e.max_abs_over_max > 1e-3 ? "  <-- WRONG" : "");
      }
    };

    std::printf("%-22s %-42s | %12s %12s | %10s |\n", "case", "GEMM", "mean signed", "RMS rel", "max|err|/max");
    for (int K : {1024, 4096}) {
      const HostCase c = make_case(64, 8192, K, K, 8192, 30.0);
      check(c, ("M64 N8192 K" + std::to_string(K) + " sd30").c_str());
    }
    // Odd shapes: rows and columns not multiples of any tile, padded k, several tiles in each direction.
    // (N a multiple of 4: the promoted GEMM's fp32 TMA store needs it; the fused runner sends the last V % 4
    // columns through cuBLAS.)
    check(make_case(37, 1004, 136, 130, 1008, 2.0), "M37 N1004 K136(130)");
    check(make_case(300, 516, 1032, 1030, 520, 2.0), "M300 N516 K1032(1030)");
    if (quick) return 0;

    // Speed at the workload's shapes: a 2048-row chunk and all 16384 rows of B=16 (T=1024), V=128256, H=4096.
    const int N = 128256, K = 4096;
    std::printf("\n%-44s | %9s %9s | %s\n", "GEMM (M x 128256 x 4096)", "M=2048", "M=16384", "TFLOP/s at 16384");
    const int Mmax = 16384;
    DeviceBuffer dx(std::size_t{Mmax} * K * 2, "x"), dw(std::size_t{N} * K * 2, "w"), dz(std::size_t{Mmax} * N * 4, "z");
    bench::fill_uniform<<<4096, 256>>>(dx.as<__nv_bfloat16>(), 1, std::int64_t{Mmax} * K, std::int64_t{Mmax} * K, 1.7320508f, 1);
    bench::fill_uniform<<<4096, 256>>>(dw.as<__nv_bfloat16>(), 1, std::int64_t{N} * K, std::int64_t{N} * K, std::sqrt(3.0f * 4.0f / K), 2);
    SIMPO_CUDA_CHECK_LAUNCH();
    auto time_both = [&](const std::string& name, const std::function<void(int)>& run) {
      const double a = median_ms(3, 10, [&] { run(2048); });
      const double b = median_ms(2, 7, [&] { run(Mmax); });
      std::printf("%-56s | %9.3f %9.3f | %.0f\n", name.c_str(), a, b, 2.0 * Mmax * N * K / b / 1e9);
      std::fflush(stdout);
    };
    time_both("cuBLAS 32F, bf16 out (the floor)", [&](int M) {
      cublas_logits(h, CUBLAS_COMPUTE_32F, M, N, K, dx.as<__nv_bfloat16>(), dw.as<__nv_bfloat16>(), dz.get(), N, CUDA_R_16BF);
    });
    time_both("cuBLAS 32F, fp32 out", [&](int M) {
      cublas_logits(h, CUBLAS_COMPUTE_32F, M, N, K, dx.as<__nv_bfloat16>(), dw.as<__nv_bfloat16>(), dz.get(), N);
    });
    for (std::int64_t pk : {std::int64_t{512}, std::int64_t{256}, std::int64_t{128}})
      if (promoted)
        time_both("promoted every " + std::to_string(pk), [&](int M) {
          promoted_logits(M, N, K, dx.as<__nv_bfloat16>(), dw.as<__nv_bfloat16>(), dz.as<float>(), N, pk, nullptr,
                          scratch.get(), scratch.bytes());
        });
    cublasDestroy(h);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gemm_accuracy: %s\n", e.what());
    return 1;
  }
  return 0;
}
