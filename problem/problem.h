// The problem: shape + hyperparameters + inputs, exactly as ../shared/SPEC.md defines them, and the one
// validation every entry point (reference, fused backends, files, CLI) goes through.
#pragma once

#include "problem/tensor.h"

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace simpo {

// Bad input of any kind (shape, value, file, option). Its message names the problem; the CLI maps it to exit 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Shape {
  std::int64_t B = 0, T = 0, H = 0, V = 0;
  std::int64_t P() const { return B / 2; }  // pairs
  std::int64_t N() const { return B * T; }  // token rows
  std::string to_string() const;            // "B=2 T=4 H=8 V=16"
  bool operator==(const Shape&) const = default;
};

// What to do with a sequence that has no completion token (n[b] = 0).
enum class EmptySequence { error, zero };

struct Hyperparameters {
  double beta = 0.1;
  double gamma = 0.5;
  double alpha = 1.0;
  double label_smoothing = 0.0;
  bool compute_nll_loss = true;
  std::int64_t ignore_index = -100;
  double grad_scale = 1.0;
  EmptySequence empty_sequence = EmptySequence::error;
  bool operator==(const Hyperparameters&) const = default;
};

// The values of one input tensor (x, weight or bias) in one of SPEC's input dtypes: BF16, F16 or F32. A
// vector of bf16, f16 or float converts to it, so a problem is built as before; code that needs the values
// asks for them typed (as<bf16>() is the bf16 vector itself: a device upload takes it as it is) or visits
// them whatever their dtype.
class InputValues {
 public:
  InputValues() = default;  // no values, bf16
  InputValues(std::vector<bf16> v) : values_(std::move(v)) {}
  InputValues(std::vector<f16> v) : values_(std::move(v)) {}
  InputValues(std::vector<float> v) : values_(std::move(v)) {}

  DType dtype() const;
  std::size_t size() const;
  bool empty() const { return size() == 0; }
  // The values as T; InputError naming both dtypes when T is not theirs.
  template <class T> std::vector<T>& as();
  template <class T> const std::vector<T>& as() const;
  // Value i widened to double: exact for every input dtype.
  double value(std::size_t i) const;
  // f(const std::vector<T>&) with T the values' type.
  template <class F> decltype(auto) visit(F&& f) const { return std::visit(std::forward<F>(f), values_); }
  template <class F> decltype(auto) visit(F&& f) { return std::visit(std::forward<F>(f), values_); }
  bool operator==(const InputValues&) const = default;

 private:
  [[noreturn]] void wrong_dtype(DType wanted) const;
  std::variant<std::vector<bf16>, std::vector<f16>, std::vector<float>> values_;
};

// SPEC's input dtypes, and their names on the command line and in messages ("bf16", "f16", "f32").
bool is_input_dtype(DType);
std::string input_dtype_name(DType);
DType input_dtype_from_name(const std::string&);  // InputError naming the choices

struct Problem {
  Shape shape;
  Hyperparameters hp;
  InputValues x;                           // [B, T, H] row-major
  InputValues weight;                      // [V, H], x's dtype
  std::optional<InputValues> bias;         // [V], x's dtype
  std::vector<std::int64_t> target;        // [B, T]
  std::string seed;                        // free-form provenance, carried into files
  std::string description;

  bool has_bias() const { return bias.has_value(); }
  // The one dtype of x, weight and bias (validate refuses a problem that mixes them).
  DType input_dtype() const { return x.dtype(); }
  bool is_completion(std::int64_t b, std::int64_t t) const {
    return target[static_cast<std::size_t>(b * shape.T + t)] != hp.ignore_index;
  }
};

// Which checks to run. The scan of x/weight/bias for NaN/Inf is O(inputs); SPEC lets a fused backend skip it
// only when the caller turns it off.
struct ValidationOptions {
  bool scan_values = true;
};

// Throws InputError with SPEC's message for the first violated rule of SPEC's edge-case table: shape, input
// dtypes (one of BF16, F16, F32, the same for x, weight and bias), tensor sizes, hyperparameter ranges, targets out of range, empty sequences (unless empty_sequence = zero), no chosen
// completion token with compute_nll_loss and alpha != 0, non-finite inputs.
void validate(const Problem&, const ValidationOptions& = {});

// Parts of the above, for callers that build a problem piece by piece.
void validate_shape(const Shape&);
// Bytes of a problem's inputs (x, weight, optional bias in `dtype`, target); validates the shape first.
std::int64_t input_bytes(const Shape&, bool bias, DType dtype = DType::BF16);
void validate_hyperparameters(const Hyperparameters&);

// "chosen sequence of pair 3" / "rejected sequence of pair 0": how errors name sequence b.
std::string sequence_name(const Shape&, std::int64_t b);

// The names of SPEC's output tensors, in SPEC's order.
namespace output_name {
inline constexpr const char* loss = "loss";
inline constexpr const char* nll_loss = "nll_loss";
inline constexpr const char* chosen_logps = "chosen_logps";
inline constexpr const char* rejected_logps = "rejected_logps";
inline constexpr const char* chosen_logits_mean = "chosen_logits_mean";
inline constexpr const char* rejected_logits_mean = "rejected_logits_mean";
inline constexpr const char* chosen_rewards = "chosen_rewards";
inline constexpr const char* rejected_rewards = "rejected_rewards";
inline constexpr const char* grad_x = "grad_x";
inline constexpr const char* grad_weight = "grad_weight";
inline constexpr const char* grad_bias = "grad_bias";
}  // namespace output_name
const std::vector<std::string>& all_output_names();
bool is_gradient_output(const std::string& name);

// The shape SPEC gives output `name` for this problem ({} for scalars).
std::vector<std::int64_t> output_shape(const Shape&, const std::string& name);

}  // namespace simpo

namespace simpo {

template <class T> std::vector<T>& InputValues::as() {
  if (auto* v = std::get_if<std::vector<T>>(&values_)) return *v;
  wrong_dtype(dtype_of<T>());
}
template <class T> const std::vector<T>& InputValues::as() const {
  if (const auto* v = std::get_if<std::vector<T>>(&values_)) return *v;
  wrong_dtype(dtype_of<T>());
}

}  // namespace simpo
