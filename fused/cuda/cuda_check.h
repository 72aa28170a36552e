// Every CUDA runtime, cuBLAS and cuBLASLt status goes through these and becomes an exception carrying the
// library's own name and message and the call that failed, so a failure is never a silent wrong result.
#pragma once

#include "problem/problem.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace simpo::fused::cuda {

// A CUDA or cuBLAS failure that is not the caller's fault (driver, launch, library).
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line);

inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess) throw_cuda_error(status, call, file, line);
}
inline void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) throw_cublas_error(status, call, file, line);
}

}  // namespace simpo::fused::cuda

#define SIMPO_CUDA_CHECK(call) ::simpo::fused::cuda::check_cuda((call), #call, __FILE__, __LINE__)
#define SIMPO_CUBLAS_CHECK(call) ::simpo::fused::cuda::check_cublas((call), #call, __FILE__, __LINE__)
// After a kernel launch: a bad configuration shows up here, not at the next unrelated call.
#define SIMPO_CUDA_CHECK_LAUNCH() SIMPO_CUDA_CHECK(cudaGetLastError())
