// Diagnostic: how exact are the fp32 logits that cuBLAS's bf16 GEMM returns? The fused scalars (loss, nll,
// logps) inherit the logits' error, so this measures, against fp64 on the host, the mean signed relative
// error (a bias: rounding toward zero in the tensor cores' fp32 accumulation would make it negative and grow
// with K) and the RMS relative error, for CUBLAS_COMPUTE_32F (tensor cores, what the backend uses) and
// CUBLAS_COMPUTE_32F_PEDANTIC (IEEE fp32 throughout), with the time of each at a larger shape.
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_buffer.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <vector>

using namespace simpo::fused::cuda;

namespace {

std::uint64_t state = 12345;
double uniform_pm1() {  // splitmix64
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0;
}

// Row-major Z[M, N] = X[M, K] W[N, K]^T as column-major Z^T = W X^T.
void logits(cublasHandle_t h, cublasComputeType_t compute, int M, int N, int K, const __nv_bfloat16* x,
            const __nv_bfloat16* w, float* z) {
  const float one = 1.0f, zero = 0.0f;
  SIMPO_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K, x, CUDA_R_16BF, K,
                                  &zero, z, CUDA_R_32F, N, compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

int main() {
  try {
    cublasHandle_t h;
    SIMPO_CUBLAS_CHECK(cublasCreate(&h));
    std::printf("%6s %-9s | %12s %12s | rows x cols checked\n", "K", "compute", "mean signed", "RMS rel");
    for (int K : {256, 1024, 4096}) {
      const int M = 64, N = 8192;
      std::vector<__nv_bfloat16> x(static_cast<std::size_t>(M) * K), w(static_cast<std::size_t>(N) * K);
      std::vector<double> xd(x.size()), wd(w.size());
      const double wscale = std::sqrt(3.0 * 900.0 / K);  // logits of standard deviation ~30
      for (std::size_t i = 0; i < x.size(); ++i) {
        x[i] = __float2bfloat16_rn(static_cast<float>(1.7320508 * uniform_pm1()));
        xd[i] = __bfloat162float(x[i]);
      }
      for (std::size_t i = 0; i < w.size(); ++i) {
        w[i] = __float2bfloat16_rn(static_cast<float>(wscale * uniform_pm1()));
        wd[i] = __bfloat162float(w[i]);
      }
      std::vector<double> exact(static_cast<std::size_t>(M) * N);
      for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c) {
          double s = 0;
          for (int k = 0; k < K; ++k) s += xd[static_cast<std::size_t>(r) * K + k] * wd[static_cast<std::size_t>(c) * K + k];
          exact[static_cast<std::size_t>(r) * N + c] = s;
        }
      DeviceBuffer dx(x.size() * 2, "x"), dw(w.size() * 2, "w"), dz(exact.size() * 4, "z");
      SIMPO_CUDA_CHECK(cudaMemcpy(dx.get(), x.data(), x.size() * 2, cudaMemcpyHostToDevice));
      SIMPO_CUDA_CHECK(cudaMemcpy(dw.get(), w.data(), w.size() * 2, cudaMemcpyHostToDevice));
      for (auto [compute, name] : {std::pair{CUBLAS_COMPUTE_32F, "32F"}, std::pair{CUBLAS_COMPUTE_32F_PEDANTIC, "PEDANTIC"}}) {
        logits(h, compute, M, N, K, dx.as<__nv_bfloat16>(), dw.as<__nv_bfloat16>(), dz.as<float>());
        std::vector<float> z(exact.size());
        SIMPO_CUDA_CHECK(cudaMemcpy(z.data(), dz.get(), z.size() * 4, cudaMemcpyDeviceToHost));
        double signed_sum = 0, square_sum = 0;
        std::size_t count = 0;
        for (std::size_t i = 0; i < z.size(); ++i) {
          if (std::abs(exact[i]) < 1.0) continue;  // relative error of near-zero logits says nothing
          const double rel = (z[i] - exact[i]) / std::abs(exact[i]);
          signed_sum += (exact[i] > 0 ? rel : -rel);  // > 0: magnitude too large, < 0: toward zero
          square_sum += rel * rel;
          ++count;
        }
        std::printf("%6d %-9s | %12.3e %12.3e | %zu\n", K, name, signed_sum / count, std::sqrt(square_sum / count), count);
      }
    }
    // Speed of both at a workload-like shape: 2048 rows, 32000 columns, K = 4096.
    const int M = 2048, N = 32000, K = 4096;
    DeviceBuffer dx(static_cast<std::size_t>(M) * K * 2, "x"), dw(static_cast<std::size_t>(N) * K * 2, "w"),
        dz(static_cast<std::size_t>(M) * N * 4, "z");
    SIMPO_CUDA_CHECK(cudaMemset(dx.get(), 0x3f, dx.bytes()));  // 0x3f3f bf16 ~ 0.75: not zeros
    SIMPO_CUDA_CHECK(cudaMemset(dw.get(), 0x3c, dw.bytes()));
    for (auto [compute, name] : {std::pair{CUBLAS_COMPUTE_32F, "32F"}, std::pair{CUBLAS_COMPUTE_32F_PEDANTIC, "PEDANTIC"}}) {
      cudaEvent_t a, b;
      SIMPO_CUDA_CHECK(cudaEventCreate(&a));
      SIMPO_CUDA_CHECK(cudaEventCreate(&b));
      logits(h, compute, M, N, K, dx.as<__nv_bfloat16>(), dw.as<__nv_bfloat16>(), dz.as<float>());
      SIMPO_CUDA_CHECK(cudaEventRecord(a));
      for (int i = 0; i < 5; ++i) logits(h, compute, M, N, K, dx.as<__nv_bfloat16>(), dw.as<__nv_bfloat16>(), dz.as<float>());
      SIMPO_CUDA_CHECK(cudaEventRecord(b));
      SIMPO_CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      SIMPO_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      std::printf("%-9s %dx%dx%d: %.3f ms (%.0f TFLOP/s)\n", name, M, N, K, ms / 5, 2.0 * M * N * K / (ms / 5) / 1e9);
    }
    cublasDestroy(h);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gemm_accuracy: %s\n", e.what());
    return 1;
  }
  return 0;
}
