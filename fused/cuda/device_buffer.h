// One cudaMalloc'd block, freed on scope exit. Running out of device memory is reported as an InputError
// (the caller asked for a problem or budget too large for this device) naming the bytes and their purpose.
#pragma once

#include <cstddef>
#include <string>

namespace simpo::fused::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(std::size_t bytes, const std::string& purpose);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return data_; }
  template <class T> T* as() const { return static_cast<T*>(data_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace simpo::fused::cuda
