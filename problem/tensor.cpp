#include "problem/tensor.h"

#include <algorithm>

#include "problem/problem.h"

namespace simpo {

std::string dtype_name(DType d) {
  switch (d) {
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::I64: return "I64";
  }
  return "?";
}

DType dtype_from_name(const std::string& name) {
  if (name == "BF16") return DType::BF16;
  if (name == "F16") return DType::F16;
  if (name == "F32") return DType::F32;
  if (name == "F64") return DType::F64;
  if (name == "I64") return DType::I64;
  throw InputError("unsupported dtype \"" + name + "\" (expected BF16, F16, F32, F64 or I64)");
}

std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::I64: return 8;
  }
  return 0;
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string index_string(std::int64_t i, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> idx(shape.size());
  for (std::size_t k = shape.size(); k-- > 0;) {
    idx[k] = i % shape[k];
    i /= shape[k];
  }
  std::string s = "(";
  for (std::size_t k = 0; k < idx.size(); ++k) s += (k ? ", " : "") + std::to_string(idx[k]);
  return s + ")";
}

std::int64_t checked_numel(const std::vector<std::int64_t>& shape, std::size_t element_bytes) {
  std::int64_t n = 1, nonzero = static_cast<std::int64_t>(element_bytes);
  for (const auto d : shape) {
    if (d < 0) throw InputError("shape " + shape_string(shape) + " has a negative dimension");
    if (d != 0 && __builtin_mul_overflow(nonzero, d, &nonzero))
      throw InputError("shape " + shape_string(shape) + " has more elements than 64-bit sizes can count");
    n *= d;  // cannot overflow: |n| <= nonzero, checked just above
  }
  return n;
}

Tensor Tensor::uninitialized(DType dtype, std::vector<std::int64_t> shape) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.resize(static_cast<std::size_t>(checked_numel(t.shape, dtype_size(dtype))) * dtype_size(dtype));
  return t;
}

Tensor::Tensor(DType dtype_, std::vector<std::int64_t> shape_) : Tensor(uninitialized(dtype_, std::move(shape_))) {
  const auto n = static_cast<std::int64_t>(bytes.size());
  constexpr std::int64_t block = std::int64_t{1} << 22;
#pragma omp parallel for schedule(static) if (n > 4 * block)
  for (std::int64_t b0 = 0; b0 < n; b0 += block)
    std::memset(bytes.data() + b0, 0, static_cast<std::size_t>(std::min(block, n - b0)));
}

std::int64_t Tensor::numel() const { return checked_numel(shape); }

void check_dtype(const Tensor& t, DType wanted) {
  if (t.dtype != wanted)
    throw InputError("tensor holds " + dtype_name(t.dtype) + ", read as " + dtype_name(wanted));
}

double Tensor::value(std::int64_t i) const {
  const auto* p = bytes.data() + static_cast<std::size_t>(i) * dtype_size(dtype);
  switch (dtype) {
    case DType::BF16: { bf16 v; std::memcpy(&v, p, 2); return static_cast<double>(static_cast<float>(v)); }
    case DType::F16: { f16 v; std::memcpy(&v, p, 2); return static_cast<double>(static_cast<float>(v)); }
    case DType::F32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::F64: { double v; std::memcpy(&v, p, 8); return v; }
    case DType::I64: { std::int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
  }
  return 0;
}

std::vector<double> Tensor::to_double() const {
  std::vector<double> out(static_cast<std::size_t>(numel()));
  for (std::int64_t i = 0; i < numel(); ++i) out[static_cast<std::size_t>(i)] = value(i);
  return out;
}

}  // namespace simpo
