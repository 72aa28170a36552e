// One device allocation, freed on scope exit. Running out of device memory is reported as an InputError
// (the caller asked for a problem or budget too large for this device) naming the bytes and their purpose.
//
// Given a stream, the allocation is stream-ordered (cudaMallocAsync / cudaFreeAsync from the device's default
// pool, which keeps up to pool_retained_bytes of freed memory for the next allocation): cudaFree waits for the
// whole device, so a sweep calling the backend from 16 threads ran them one at a time at every free. Use the
// memory only on that stream, or after synchronizing with it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace simpo::fused::cuda {

// Freed stream-ordered memory the default pool keeps for reuse: a sweep's cases (a few MiB to a few GiB)
// allocate without going back to the driver; beyond it memory is returned at the next synchronization.
inline constexpr std::uint64_t pool_retained_bytes = std::uint64_t{4} << 30;

// Hands the current device's pooled free memory back to the driver, after waiting for the device (so every
// stream-ordered free has happened): what a measurement of free memory (cudaMemGetInfo) needs first.
void trim_device_pool();

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(std::size_t bytes, const std::string& purpose);
  DeviceBuffer(std::size_t bytes, const std::string& purpose, cudaStream_t stream);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return data_; }
  template <class T> T* as() const { return static_cast<T*>(data_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void release() noexcept;

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool stream_ordered_ = false;
  cudaStream_t stream_ = nullptr;
};

// Page-locked host memory for a runner's small per-call transfers (the completion-token counts up, the row
// statistics down). A copy from or into pageable memory makes the host wait for it (and the device waits in turn
// for the host's next launch); from pinned memory it is queued like a kernel. Grows, never shrinks; the caller
// orders its reuse against copies still queued.
class HostStaging {
 public:
  HostStaging() = default;
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // At least `bytes`, 256-byte aligned; the contents are not kept when it grows.
  char* reserve(std::size_t bytes);

 private:
  char* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace simpo::fused::cuda
