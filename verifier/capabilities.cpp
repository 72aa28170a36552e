#include "verifier/capabilities.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace simpo::verifier {

namespace {

using json = nlohmann::json;

const std::vector<std::string> known_dtypes = {"bf16", "f16", "f32"};
const std::vector<std::string> known_conventions = {"error", "zero", "nan"};

bool contains(const std::vector<std::string>& list, const std::string& s) {
  return std::find(list.begin(), list.end(), s) != list.end();
}

std::string joined(const std::vector<std::string>& list) {
  std::string out;
  for (const auto& s : list) out += (out.empty() ? "" : ", ") + s;
  return out;
}

std::vector<std::string> string_list(const json& value, const std::string& key, const std::vector<std::string>& allowed,
                                     const std::string& where) {
  if (!value.is_array()) throw InputError(where + ": capabilities key \"" + key + "\" must be a list of strings (" + joined(allowed) + ")");
  std::vector<std::string> out;
  for (const auto& item : value) {
    if (!item.is_string() || !contains(allowed, item.get<std::string>()))
      throw InputError(where + ": capabilities key \"" + key + "\" has " + item.dump() + "; each entry is one of " + joined(allowed));
    out.push_back(item.get<std::string>());
  }
  return out;
}

bool boolean(const json& value, const std::string& key, const std::string& where) {
  if (!value.is_boolean()) throw InputError(where + ": capabilities key \"" + key + "\" must be true or false, got " + value.dump());
  return value.get<bool>();
}

}  // namespace

bool Capabilities::declares_empty_sequence(const std::string& convention) const {
  if (!empty_sequence) return convention != "nan";
  return contains(*empty_sequence, convention);
}

bool Capabilities::all_of_spec() const {
  return !dtypes && !bias && !label_smoothing && !empty_sequence && !invalid_inputs && !max_B && !max_T && !max_H &&
         !max_V && !deterministic;
}

std::string Capabilities::to_json() const {
  json j = json::object();
  if (dtypes) j["dtypes"] = *dtypes;
  if (bias) j["bias"] = *bias;
  if (label_smoothing) j["label_smoothing"] = *label_smoothing;
  if (empty_sequence) j["empty_sequence"] = *empty_sequence;
  if (invalid_inputs) j["invalid_inputs"] = *invalid_inputs;
  if (max_B || max_T || max_H || max_V) {
    json m = json::object();
    if (max_B) m["B"] = *max_B;
    if (max_T) m["T"] = *max_T;
    if (max_H) m["H"] = *max_H;
    if (max_V) m["V"] = *max_V;
    j["max_shape"] = m;
  }
  if (deterministic) j["deterministic"] = *deterministic;
  return j.dump();
}

Capabilities capabilities_from_json(const std::string& text, const std::string& where) {
  const json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) throw InputError(where + ": capabilities must be a JSON object, got \"" + text.substr(0, 120) + "\"");
  Capabilities c;
  for (const auto& [key, value] : j.items()) {
    if (key == "dtypes") {
      c.dtypes = string_list(value, key, known_dtypes, where);
    } else if (key == "bias") {
      c.bias = boolean(value, key, where);
    } else if (key == "label_smoothing") {
      c.label_smoothing = boolean(value, key, where);
    } else if (key == "empty_sequence") {
      c.empty_sequence = string_list(value, key, known_conventions, where);
    } else if (key == "invalid_inputs") {
      if (!value.is_string() || (value != "error" && value != "unchecked"))
        throw InputError(where + ": capabilities key \"invalid_inputs\" must be \"error\" or \"unchecked\", got " + value.dump());
      c.invalid_inputs = value.get<std::string>();
    } else if (key == "max_shape") {
      if (!value.is_object()) throw InputError(where + ": capabilities key \"max_shape\" must be an object {\"B\", \"T\", \"H\", \"V\"}, got " + value.dump());
      for (const auto& [dim, n] : value.items()) {
        std::optional<std::int64_t>* slot = dim == "B" ? &c.max_B : dim == "T" ? &c.max_T : dim == "H" ? &c.max_H : dim == "V" ? &c.max_V : nullptr;
        if (!slot) throw InputError(where + ": capabilities key \"max_shape\" has \"" + dim + "\"; its keys are B, T, H, V");
        if (!n.is_number_integer() || n.get<std::int64_t>() < 1)
          throw InputError(where + ": capabilities key \"max_shape." + dim + "\" must be an integer >= 1, got " + n.dump());
        *slot = n.get<std::int64_t>();
      }
    } else if (key == "deterministic") {
      c.deterministic = boolean(value, key, where);
    } else {
      throw InputError(where + ": unknown capabilities key \"" + key +
                       "\" (dtypes, bias, label_smoothing, empty_sequence, invalid_inputs, max_shape, deterministic)");
    }
  }
  return c;
}

Capabilities capabilities_from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError("--capabilities: cannot read " + path);
  std::stringstream text;
  text << in.rdbuf();
  return capabilities_from_json(text.str(), "--capabilities " + path);
}


bool has_empty_sequence(const Problem& p) {
  for (std::int64_t b = 0; b < p.shape.B; ++b) {
    bool any = false;
    for (std::int64_t t = 0; t < p.shape.T && !any; ++t) any = p.is_completion(b, t);
    if (!any) return true;
  }
  return false;
}

std::optional<std::string> exclusion(const Capabilities& c, const Problem& p) {
  if (c.dtypes && !contains(*c.dtypes, simpo::input_dtype_name(p.input_dtype()))) return "dtypes";
  if (c.bias && !*c.bias && p.has_bias()) return "bias";
  if (c.label_smoothing && !*c.label_smoothing && p.hp.label_smoothing != 0) return "label_smoothing";
  const Shape& s = p.shape;
  if ((c.max_B && s.B > *c.max_B) || (c.max_T && s.T > *c.max_T) || (c.max_H && s.H > *c.max_H) || (c.max_V && s.V > *c.max_V))
    return "max_shape";
  if (c.empty_sequence && has_empty_sequence(p)) {
    const bool zero = p.hp.empty_sequence == EmptySequence::zero;
    if (zero ? !c.declares_empty_sequence("zero")
             : !(c.declares_empty_sequence("error") || c.declares_empty_sequence("nan")))
      return "empty_sequence";
  }
  return std::nullopt;
}

}  // namespace simpo::verifier
