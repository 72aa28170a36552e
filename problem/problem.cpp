#include "problem/problem.h"

#include <cmath>
#include <sstream>

namespace simpo {

std::string Shape::to_string() const {
  return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " H=" + std::to_string(H) +
         " V=" + std::to_string(V);
}

std::string sequence_name(const Shape& s, std::int64_t b) {
  const std::int64_t P = s.P();
  return b < P ? "chosen sequence of pair " + std::to_string(b) + " (row " + std::to_string(b) + ")"
               : "rejected sequence of pair " + std::to_string(b - P) + " (row " + std::to_string(b) + ")";
}

void validate_shape(const Shape& s) {
  if (s.B <= 0 || s.T <= 0 || s.H <= 0 || s.V <= 0)
    throw InputError("invalid shape " + s.to_string() + ": every dimension must be positive");
  if (s.B % 2 != 0)
    throw InputError("invalid shape " + s.to_string() +
                     ": B must be even (rows 0..P-1 chosen, P..2P-1 rejected, B = 2P)");
  // Guards the index arithmetic everywhere (products of int64 dimensions), overflow-free itself.
  constexpr std::int64_t limit = std::int64_t{1} << 40;
  if (s.B > limit / s.T || s.B * s.T > limit / s.H || s.V > limit / s.H)
    throw InputError("invalid shape " + s.to_string() + ": too large (B*T*H and V*H must stay below 2^40)");
}

DType InputValues::dtype() const {
  return std::visit([](const auto& v) { return dtype_of<typename std::decay_t<decltype(v)>::value_type>(); }, values_);
}

std::size_t InputValues::size() const {
  return std::visit([](const auto& v) { return v.size(); }, values_);
}

double InputValues::value(std::size_t i) const {
  return std::visit([i](const auto& v) { return static_cast<double>(static_cast<float>(v[i])); }, values_);
}

void InputValues::wrong_dtype(DType wanted) const {
  throw InputError("input values are " + dtype_name(dtype()) + ", read as " + dtype_name(wanted));
}

bool is_input_dtype(DType d) { return d == DType::BF16 || d == DType::F16 || d == DType::F32; }

std::string input_dtype_name(DType d) {
  switch (d) {
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::F32: return "f32";
    default: return dtype_name(d);
  }
}

DType input_dtype_from_name(const std::string& name) {
  for (DType d : {DType::BF16, DType::F16, DType::F32})
    if (name == input_dtype_name(d) || name == dtype_name(d)) return d;
  throw InputError("unknown input dtype \"" + name + "\" (SPEC's input dtypes: bf16, f16, f32)");
}

std::int64_t input_bytes(const Shape& s, bool bias, DType dtype) {
  validate_shape(s);
  return (s.N() * s.H + s.V * s.H + (bias ? s.V : 0)) * static_cast<std::int64_t>(dtype_size(dtype)) +
         s.N() * static_cast<std::int64_t>(sizeof(std::int64_t));
}

void validate_hyperparameters(const Hyperparameters& hp) {
  auto bad = [](const std::string& name, double v, const std::string& range) {
    std::ostringstream os;
    os << "hyperparameter " << name << " = " << v << " is out of range: must be " << range;
    throw InputError(os.str());
  };
  if (!std::isfinite(hp.beta) || hp.beta <= 0) bad("beta", hp.beta, "finite and > 0");
  if (!std::isfinite(hp.gamma)) bad("gamma", hp.gamma, "finite");
  if (!std::isfinite(hp.alpha) || hp.alpha < 0) bad("alpha", hp.alpha, "finite and >= 0");
  if (!(hp.label_smoothing >= 0 && hp.label_smoothing <= 0.5))
    bad("label_smoothing", hp.label_smoothing, "in [0, 0.5]");
  if (!std::isfinite(hp.grad_scale)) bad("grad_scale", hp.grad_scale, "finite");
}

namespace {

void check_size(const char* name, std::size_t have, const std::vector<std::int64_t>& shape) {
  std::int64_t want = 1;
  for (auto d : shape) want *= d;
  if (static_cast<std::int64_t>(have) != want)
    throw InputError(std::string("shapes disagree: ") + name + " holds " + std::to_string(have) +
                     " values but the problem's shape needs " + name + " " + shape_string(shape) + " = " +
                     std::to_string(want));
}

template <class T>
void check_finite(const char* name, const std::vector<T>& values, const std::vector<std::int64_t>& shape) {
  // The scan on every core (the published weight is 525M values, scanned by every implementation's validate);
  // only a problem that has a non-finite value is walked again, in order, to name the first.
  const auto n = static_cast<std::int64_t>(values.size());
  bool any = false;
#pragma omp parallel for schedule(static) reduction(|| : any)
  for (std::int64_t i = 0; i < n; ++i) any = any || !std::isfinite(static_cast<float>(values[static_cast<std::size_t>(i)]));
  if (!any) return;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const float v = static_cast<float>(values[i]);
    if (!std::isfinite(v)) {
      std::ostringstream os;
      os << "non-finite input: " << name << index_string(static_cast<std::int64_t>(i), shape) << " = " << v;
      throw InputError(os.str());
    }
  }
}

void check_finite(const char* name, const InputValues& input, const std::vector<std::int64_t>& shape) {
  input.visit([&](const auto& values) { check_finite(name, values, shape); });
}

// SPEC: x, weight and bias share one of the input dtypes; mixing them is an error naming both.
void check_dtypes(const Problem& p) {
  auto same = [&](const char* name, const InputValues& v) {
    if (v.dtype() != p.x.dtype())
      throw InputError("input dtypes disagree: x is " + dtype_name(p.x.dtype()) + " but " + name + " is " +
                       dtype_name(v.dtype()) + " (x, weight and bias must share one dtype)");
  };
  same("weight", p.weight);
  if (p.bias) same("bias", *p.bias);
}

}  // namespace

void validate(const Problem& p, const ValidationOptions& options) {
  const Shape& s = p.shape;
  validate_shape(s);
  check_dtypes(p);
  check_size("x", p.x.size(), {s.B, s.T, s.H});
  check_size("weight", p.weight.size(), {s.V, s.H});
  if (p.bias) check_size("bias", p.bias->size(), {s.V});
  check_size("target", p.target.size(), {s.B, s.T});
  validate_hyperparameters(p.hp);

  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t t = 0; t < s.T; ++t) {
      const std::int64_t v = p.target[static_cast<std::size_t>(b * s.T + t)];
      if (v != p.hp.ignore_index && (v < 0 || v >= s.V))
        throw InputError("target(" + std::to_string(b) + ", " + std::to_string(t) + ") = " + std::to_string(v) +
                         " is outside [0, V) = [0, " + std::to_string(s.V) + ") and is not ignore_index (" +
                         std::to_string(p.hp.ignore_index) + ")");
    }

  std::int64_t chosen_tokens = 0;
  for (std::int64_t b = 0; b < s.B; ++b) {
    std::int64_t n = 0;
    for (std::int64_t t = 0; t < s.T; ++t) n += p.is_completion(b, t);
    if (b < s.P()) chosen_tokens += n;
    if (n == 0 && p.hp.empty_sequence == EmptySequence::error)
      throw InputError("the " + sequence_name(s, b) +
                       " has no completion token (every target is ignore_index), so its average log-prob is 0/0; "
                       "mask at least one token or choose empty_sequence=zero");
  }
  if (p.hp.compute_nll_loss && p.hp.alpha != 0 && chosen_tokens == 0)
    throw InputError("compute_nll_loss is on (alpha = " + std::to_string(p.hp.alpha) +
                     ") but no chosen sequence has a completion token, so the NLL is 0/0; set alpha = 0 or "
                     "compute_nll_loss = false");

  if (options.scan_values) {
    check_finite("x", p.x, {s.B, s.T, s.H});
    check_finite("weight", p.weight, {s.V, s.H});
    if (p.bias) check_finite("bias", *p.bias, {s.V});
  }
}

const std::vector<std::string>& all_output_names() {
  static const std::vector<std::string> names = {
      output_name::loss,           output_name::nll_loss,           output_name::chosen_logps,
      output_name::rejected_logps, output_name::chosen_logits_mean, output_name::rejected_logits_mean,
      output_name::chosen_rewards, output_name::rejected_rewards,   output_name::grad_x,
      output_name::grad_weight,    output_name::grad_bias};
  return names;
}

bool is_gradient_output(const std::string& name) { return name.rfind("grad_", 0) == 0; }

std::vector<std::int64_t> output_shape(const Shape& s, const std::string& name) {
  if (name == output_name::chosen_logps || name == output_name::rejected_logps ||
      name == output_name::chosen_rewards || name == output_name::rejected_rewards)
    return {s.P()};
  if (name == output_name::grad_x) return {s.B, s.T, s.H};
  if (name == output_name::grad_weight) return {s.V, s.H};
  if (name == output_name::grad_bias) return {s.V};
  for (const auto& n : all_output_names())
    if (n == name) return {};
  throw InputError("unknown output tensor \"" + name + "\"");
}

}  // namespace simpo
