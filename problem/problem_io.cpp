#include "problem/problem_io.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cmath>

namespace simpo {

namespace {

std::string format_double(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);  // shortest text that reads back to the same double
  return std::string(buf, res.ptr);
}

double parse_double(const std::string& key, const std::string& text) {
  double v = 0;
  auto res = std::from_chars(text.data(), text.data() + text.size(), v);
  if (res.ec != std::errc() || res.ptr != text.data() + text.size())
    throw InputError("metadata " + key + " = \"" + text + "\" is not a number");
  return v;
}

std::int64_t parse_int(const std::string& key, const std::string& text) {
  std::int64_t v = 0;
  auto res = std::from_chars(text.data(), text.data() + text.size(), v);
  if (res.ec != std::errc() || res.ptr != text.data() + text.size())
    throw InputError("metadata " + key + " = \"" + text + "\" is not an integer");
  return v;
}

bool parse_bool(const std::string& key, const std::string& text) {
  if (text == "true") return true;
  if (text == "false") return false;
  throw InputError("metadata " + key + " = \"" + text + "\" is not \"true\" or \"false\"");
}

// dtype: the one SPEC gives `name`; F32 stands for any of the input dtypes (BF16, F16, F32).
const Tensor& require(const SafetensorsFile& f, const std::string& source, const std::string& name, DType dtype,
                      std::size_t rank) {
  auto it = f.tensors.find(name);
  if (it == f.tensors.end()) throw InputError(source + ": inputs file has no tensor \"" + name + "\"");
  const Tensor& t = it->second;
  if (dtype == DType::I64 ? t.dtype != dtype : !is_input_dtype(t.dtype))
    throw InputError(source + ": " + name + " is " + dtype_name(t.dtype) + ", SPEC says " +
                     (dtype == DType::I64 ? dtype_name(dtype) : "BF16, F16 or F32"));
  if (t.shape.size() != rank)
    throw InputError(source + ": " + name + " has shape " + shape_string(t.shape) + ", SPEC says rank " +
                     std::to_string(rank));
  return t;
}

// The keys SPEC puts in an inputs file's __metadata__, and keys other tools write there that mean nothing to SPEC
// (Hugging Face's safetensors writers add "format"). Any other key is most likely a typo of a hyperparameter,
// which would silently run with its default: an error naming the nearest known key.
const std::vector<std::string>& known_metadata_keys() {
  static const std::vector<std::string> keys = {"beta", "gamma", "alpha", "label_smoothing", "compute_nll_loss",
                                                "ignore_index", "grad_scale", "empty_sequence", "seed", "description"};
  return keys;
}
bool foreign_metadata_key(const std::string& key) { return key == "format"; }

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t substitute = diagonal + (a[i - 1] != b[j - 1]);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitute});
    }
  }
  return row[b.size()];
}

[[noreturn]] void unknown_metadata_key(const std::string& key) {
  std::string nearest;
  std::size_t best = SIZE_MAX;
  for (const std::string& k : known_metadata_keys())
    if (const std::size_t d = edit_distance(key, k); d < best) best = d, nearest = k;
  std::string known;
  for (const std::string& k : known_metadata_keys()) known += (known.empty() ? "" : ", ") + k;
  throw InputError("unknown __metadata__ key \"" + key + "\" (did you mean \"" + nearest + "\"? the keys SPEC knows: " +
                   known + ")");
}

template <class T> std::vector<T> values_of(const Tensor& t) {
  auto s = t.as<T>();
  return {s.begin(), s.end()};
}

InputValues input_values(const Tensor& t) {
  switch (t.dtype) {
    case DType::BF16: return values_of<bf16>(t);
    case DType::F16: return values_of<f16>(t);
    default: return values_of<float>(t);  // require() let only the input dtypes through
  }
}

Tensor input_tensor(std::vector<std::int64_t> shape, const InputValues& values) {
  return values.visit([&](const auto& v) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    return Tensor::from<T>(std::move(shape), std::span<const T>(v));
  });
}

}  // namespace

Hyperparameters hyperparameters_from_metadata(const std::map<std::string, std::string>& metadata) {
  Hyperparameters hp;
  for (const auto& [key, value] : metadata) {
    if (key == "beta") hp.beta = parse_double(key, value);
    else if (key == "gamma") hp.gamma = parse_double(key, value);
    else if (key == "alpha") hp.alpha = parse_double(key, value);
    else if (key == "label_smoothing") hp.label_smoothing = parse_double(key, value);
    else if (key == "grad_scale") hp.grad_scale = parse_double(key, value);
    else if (key == "compute_nll_loss") hp.compute_nll_loss = parse_bool(key, value);
    else if (key == "ignore_index") hp.ignore_index = parse_int(key, value);
    else if (key == "empty_sequence") {
      if (value == "error") hp.empty_sequence = EmptySequence::error;
      else if (value == "zero") hp.empty_sequence = EmptySequence::zero;
      else throw InputError("metadata empty_sequence = \"" + value + "\" is not \"error\" or \"zero\"");
    } else if (key != "seed" && key != "description" && !foreign_metadata_key(key)) unknown_metadata_key(key);
  }
  return hp;
}

Problem problem_from_file(const SafetensorsFile& f, const std::string& source) {
  const Tensor& x = require(f, source, "x", DType::F32, 3);
  const Tensor& w = require(f, source, "weight", DType::F32, 2);
  const Tensor& target = require(f, source, "target", DType::I64, 2);
  Problem p;
  p.shape = {x.shape[0], x.shape[1], x.shape[2], w.shape[0]};
  auto disagree = [&](const std::string& a, const Tensor& ta, const std::string& b, const Tensor& tb,
                      const std::string& what) {
    throw InputError(source + ": shapes disagree: " + a + " " + shape_string(ta.shape) + " and " + b + " " +
                     shape_string(tb.shape) + " (" + what + ")");
  };
  if (w.shape[1] != x.shape[2]) disagree("x", x, "weight", w, "H must match");
  if (target.shape[0] != x.shape[0] || target.shape[1] != x.shape[1]) disagree("x", x, "target", target, "B and T must match");
  p.x = input_values(x);
  p.weight = input_values(w);
  p.target = values_of<std::int64_t>(target);
  if (f.tensors.count("bias")) {
    const Tensor& b = require(f, source, "bias", DType::F32, 1);
    if (b.shape[0] != w.shape[0]) disagree("weight", w, "bias", b, "V must match");
    p.bias = input_values(b);
  }
  for (const auto& [name, t] : f.tensors)
    if (name != "x" && name != "weight" && name != "bias" && name != "target")
      throw InputError(source + ": unexpected tensor \"" + name + "\" in an inputs file");

  try {
    p.hp = hyperparameters_from_metadata(f.metadata);
    if (auto seed = f.metadata.find("seed"); seed != f.metadata.end()) p.seed = seed->second;
    if (auto description = f.metadata.find("description"); description != f.metadata.end())
      p.description = description->second;
  } catch (const InputError& e) {
    throw InputError(source + ": " + e.what());
  }
  return p;
}

SafetensorsFile problem_to_file(const Problem& p) {
  SafetensorsFile f;
  const Shape& s = p.shape;
  f.tensors["x"] = input_tensor({s.B, s.T, s.H}, p.x);
  f.tensors["weight"] = input_tensor({s.V, s.H}, p.weight);
  if (p.bias) f.tensors["bias"] = input_tensor({s.V}, *p.bias);
  f.tensors["target"] = Tensor::from<std::int64_t>({s.B, s.T}, p.target);
  const Hyperparameters& hp = p.hp;
  f.metadata = {{"beta", format_double(hp.beta)},
                {"gamma", format_double(hp.gamma)},
                {"alpha", format_double(hp.alpha)},
                {"label_smoothing", format_double(hp.label_smoothing)},
                {"compute_nll_loss", hp.compute_nll_loss ? "true" : "false"},
                {"ignore_index", std::to_string(hp.ignore_index)},
                {"grad_scale", format_double(hp.grad_scale)},
                {"empty_sequence", hp.empty_sequence == EmptySequence::zero ? "zero" : "error"},
                {"seed", p.seed},
                {"description", p.description}};
  return f;
}

Problem load_problem(const std::string& path) { return problem_from_file(read_safetensors(path), path); }
void save_problem(const std::string& path, const Problem& p, const std::vector<std::string>& never_replace) {
  write_safetensors(path, problem_to_file(p), never_replace);
}

TensorMap outputs_from_file(SafetensorsFile f, const std::string& source_name) {
  for (const auto& [name, t] : f.tensors) {
    bool known = false;
    for (const auto& n : all_output_names()) known |= (n == name);
    if (!known) throw InputError(source_name + ": unknown output tensor \"" + name + "\" (SPEC's outputs: loss, nll_loss, ...)");
  }
  return std::move(f.tensors);
}

TensorMap load_outputs(const std::string& path) { return outputs_from_file(read_safetensors(path), path); }

void save_outputs(const std::string& path, const TensorMap& outputs, const std::map<std::string, std::string>& metadata,
                  const std::vector<std::string>& never_replace) {
  write_safetensors(path, SafetensorsFile{outputs, metadata}, never_replace);
}

}  // namespace simpo
