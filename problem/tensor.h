// A named, typed, shaped block of little-endian bytes: the one currency that implementations, files and the
// verifier exchange. It maps one-to-one onto a safetensors entry, so any candidate's outputs can be judged
// without knowing which implementation wrote them.
#pragma once

#include <Eigen/Core>  // Eigen::bfloat16 and Eigen::half: the project's one bf16 and f16 types on the host

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace simpo {

using bf16 = Eigen::bfloat16;
using f16 = Eigen::half;

enum class DType { BF16, F16, F32, F64, I64 };

std::string dtype_name(DType);                  // "BF16", "F16", "F32", "F64", "I64" (safetensors spelling)
DType dtype_from_name(const std::string& name); // throws InputError on an unknown name
std::size_t dtype_size(DType);

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<bf16>() { return DType::BF16; }
template <> constexpr DType dtype_of<f16>() { return DType::F16; }
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<std::int64_t>() { return DType::I64; }

std::string shape_string(const std::vector<std::int64_t>& shape);  // "[2, 3, 4]"
// The element count of a shape, checked: a negative dimension, or a product (of the non-zero dimensions too, so
// that [2^32, 2^31, 0] is refused) whose bytes would not fit in 63 bits, is an InputError naming the shape.
std::int64_t checked_numel(const std::vector<std::int64_t>& shape, std::size_t element_bytes = 1);
// Row-major multi-index of flat index i: "(0, 1, 3)"; "()" for a scalar. How errors name an element.
std::string index_string(std::int64_t i, const std::vector<std::int64_t>& shape);

// std::allocator, except that resize() leaves new bytes as they are (default-initialized) instead of writing
// zeros: a gradient of 4.2 GB that is about to be overwritten is not first zeroed on one core (page faults and
// all, ~1 s).
template <class T> struct DefaultInitAllocator : std::allocator<T> {
  template <class U> struct rebind { using other = DefaultInitAllocator<U>; };
  DefaultInitAllocator() = default;
  template <class U> DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <class U> void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) { ::new (static_cast<void*>(p)) U; }
  template <class U, class... Args> void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

struct Tensor {
  using Bytes = std::vector<std::byte, DefaultInitAllocator<std::byte>>;
  DType dtype = DType::F64;
  std::vector<std::int64_t> shape;  // empty: a scalar of one element
  Bytes bytes;

  Tensor() = default;
  Tensor(DType dtype, std::vector<std::int64_t> shape);  // zero-filled (in parallel when large)
  // For a writer that overwrites every byte (a GEMM's output, a copy from the device): no zeroing pass. Its
  // pages are touched first by that writer, on as many threads as it uses.
  static Tensor uninitialized(DType dtype, std::vector<std::int64_t> shape);

  template <class T> static Tensor from(std::vector<std::int64_t> shape, std::span<const T> values);
  template <class T> static Tensor scalar(T value) { return from<T>({}, std::span<const T>(&value, 1)); }

  std::int64_t numel() const;

  // Typed views; throw InputError when T is not this tensor's dtype.
  template <class T> std::span<T> as();
  template <class T> std::span<const T> as() const;

  // Element i converted to double, whatever the dtype (exact for every dtype but I64 beyond 2^53).
  double value(std::int64_t i) const;
  std::vector<double> to_double() const;
};

// Outputs, inputs and files are all named tensors; std::map keeps a stable order for tables and files.
using TensorMap = std::map<std::string, Tensor>;

// ---- template definitions ----
void check_dtype(const Tensor&, DType wanted);

template <class T> Tensor Tensor::from(std::vector<std::int64_t> shape, std::span<const T> values) {
  Tensor t = uninitialized(dtype_of<T>(), std::move(shape));
  if (static_cast<std::size_t>(t.numel()) != values.size())
    throw std::logic_error("Tensor::from: " + std::to_string(values.size()) + " values for shape " + shape_string(t.shape));
  std::memcpy(t.bytes.data(), values.data(), values.size_bytes());
  return t;
}
template <class T> std::span<T> Tensor::as() {
  check_dtype(*this, dtype_of<T>());
  return {reinterpret_cast<T*>(bytes.data()), bytes.size() / sizeof(T)};
}
template <class T> std::span<const T> Tensor::as() const {
  check_dtype(*this, dtype_of<T>());
  return {reinterpret_cast<const T*>(bytes.data()), bytes.size() / sizeof(T)};
}

}  // namespace simpo
