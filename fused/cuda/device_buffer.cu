#include "fused/cuda/device_buffer.h"

#include "fused/cuda/cuda_check.h"

#include <utility>

namespace simpo::fused::cuda {

DeviceBuffer::DeviceBuffer(std::size_t bytes, const std::string& purpose) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t status = cudaMalloc(&data_, bytes);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // reset the (non-sticky) error so the next launch check does not report it
    std::size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    data_ = nullptr;
    throw InputError("cuda backend: out of device memory allocating " + std::to_string(bytes) + " bytes for " +
                     purpose + " (" + std::to_string(free_bytes) + " of " + std::to_string(total_bytes) +
                     " bytes free); use a smaller problem or Options::workspace_bytes");
  }
  check_cuda(status, ("cudaMalloc for " + purpose).c_str(), __FILE__, __LINE__);
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFree(data_);  // a destructor must not throw; a failing free leaks at worst
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_) cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  throw CudaError(std::string("CUDA error ") + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) +
                  ") in " + call + " at " + file + ":" + std::to_string(line));
}

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  throw CudaError(std::string("cuBLAS error ") + cublasGetStatusName(status) + " (" +
                  cublasGetStatusString(status) + ") in " + call + " at " + file + ":" + std::to_string(line));
}

}  // namespace simpo::fused::cuda
