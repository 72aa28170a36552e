// The problem: shape + hyperparameters + inputs, exactly as ../shared/SPEC.md defines them, and the one
// validation every entry point (reference, fused backends, files, CLI) goes through.
#pragma once

#include "problem/tensor.h"

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
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

struct Problem {
  Shape shape;
  Hyperparameters hp;
  std::vector<bf16> x;                     // [B, T, H] row-major
  std::vector<bf16> weight;                // [V, H]
  std::optional<std::vector<bf16>> bias;   // [V]
  std::vector<std::int64_t> target;        // [B, T]
  std::string seed;                        // free-form provenance, carried into files
  std::string description;

  bool has_bias() const { return bias.has_value(); }
  bool is_completion(std::int64_t b, std::int64_t t) const {
    return target[static_cast<std::size_t>(b * shape.T + t)] != hp.ignore_index;
  }
};

// Which checks to run. The scan of x/weight/bias for NaN/Inf is O(inputs); SPEC lets a fused backend skip it
// only when the caller turns it off.
struct ValidationOptions {
  bool scan_values = true;
};

// Throws InputError with SPEC's message for the first violated rule of SPEC's edge-case table: shape, tensor
// sizes, hyperparameter ranges, targets out of range, empty sequences (unless empty_sequence = zero), no chosen
// completion token with compute_nll_loss and alpha != 0, non-finite inputs.
void validate(const Problem&, const ValidationOptions& = {});

// Parts of the above, for callers that build a problem piece by piece.
void validate_shape(const Shape&);
// Bytes of a problem's inputs (x, weight, optional bias, target); validates the shape first.
std::int64_t input_bytes(const Shape&, bool bias);
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
