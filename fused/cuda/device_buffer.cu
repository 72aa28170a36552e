#include "fused/cuda/device_buffer.h"

#include "fused/cuda/cuda_check.h"

#include <mutex>
#include <set>
#include <utility>

namespace simpo::fused::cuda {

namespace {

[[noreturn]] void throw_out_of_memory(std::size_t bytes, const std::string& purpose) {
  std::size_t free_bytes = 0, total_bytes = 0;
  cudaMemGetInfo(&free_bytes, &total_bytes);
  throw InputError("cuda backend: out of device memory allocating " + std::to_string(bytes) + " bytes for " +
                   purpose + " (" + std::to_string(free_bytes) + " of " + std::to_string(total_bytes) +
                   " bytes free); use a smaller problem or Options::workspace_bytes");
}

// The current device's default pool, its release threshold raised to pool_retained_bytes once per device (the
// default, 0, returns every freed byte to the driver at each synchronization). Raised, never lowered: the pool is
// the process's, and another library in it (torch's cudaMallocAsync allocator) may keep more.
cudaMemPool_t default_pool() {
  int device = 0;
  SIMPO_CUDA_CHECK(cudaGetDevice(&device));
  cudaMemPool_t pool = nullptr;
  SIMPO_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  static std::mutex mutex;
  static std::set<int> configured;
  const std::lock_guard lock(mutex);
  if (!configured.count(device)) {
    std::uint64_t threshold = 0;
    SIMPO_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    if (threshold < pool_retained_bytes) {
      threshold = pool_retained_bytes;
      SIMPO_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    }
    configured.insert(device);  // only once it is set: a failed call is tried again next time
  }
  return pool;
}

}  // namespace

void trim_device_pool() {
  SIMPO_CUDA_CHECK(cudaDeviceSynchronize());
  SIMPO_CUDA_CHECK(cudaMemPoolTrimTo(default_pool(), 0));
}

DeviceBuffer::DeviceBuffer(std::size_t bytes, const std::string& purpose) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t status = cudaMalloc(&data_, bytes);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // reset the (non-sticky) error so the next launch check does not report it
    data_ = nullptr;
    throw_out_of_memory(bytes, purpose);
  }
  check_cuda(status, ("cudaMalloc for " + purpose).c_str(), __FILE__, __LINE__);
}

DeviceBuffer::DeviceBuffer(std::size_t bytes, const std::string& purpose, cudaStream_t stream)
    : bytes_(bytes), stream_ordered_(true), stream_(stream) {
  if (bytes == 0) return;
  cudaMemPool_t pool = default_pool();
  cudaError_t status = cudaMallocFromPoolAsync(&data_, bytes, pool, stream);
  if (status == cudaErrorMemoryAllocation) {
    // What the pool keeps may be what is missing: hand it back to the driver and try once more.
    cudaGetLastError();
    SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
    SIMPO_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
    status = cudaMallocFromPoolAsync(&data_, bytes, pool, stream);
  }
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    data_ = nullptr;
    throw_out_of_memory(bytes, purpose);
  }
  check_cuda(status, ("cudaMallocFromPoolAsync for " + purpose).c_str(), __FILE__, __LINE__);
}

// A destructor must not throw; a failing free leaks at worst.
void DeviceBuffer::release() noexcept {
  if (!data_) return;
  if (stream_ordered_) cudaFreeAsync(data_, stream_);
  else cudaFree(data_);
  data_ = nullptr;
  bytes_ = 0;
}

DeviceBuffer::~DeviceBuffer() { release(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      stream_ordered_(other.stream_ordered_),
      stream_(other.stream_) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    stream_ordered_ = other.stream_ordered_;
    stream_ = other.stream_;
  }
  return *this;
}

HostStaging::~HostStaging() {
  if (data_) cudaFreeHost(data_);
}

char* HostStaging::reserve(std::size_t bytes) {
  if (bytes <= bytes_) return data_;
  if (data_) SIMPO_CUDA_CHECK(cudaFreeHost(data_));
  data_ = nullptr;
  bytes_ = 0;
  void* p = nullptr;
  SIMPO_CUDA_CHECK(cudaMallocHost(&p, bytes));
  data_ = static_cast<char*>(p);
  bytes_ = bytes;
  return data_;
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
