// What an implementation declares it supports (SPEC "External implementations", Capabilities), and which drawn
// cases a declaration excludes. A sweep draws every case from the one distribution, so every implementation sees
// the same stream; a case outside the declaration is excluded (counted by the key that excluded it), never
// judged and never a failure.
//
// Keys, each optional (absent: all of SPEC):
//   dtypes           input dtypes it takes ("bf16", "f16", "f32")
//   bias             whether it takes an LM-head bias
//   label_smoothing  whether it takes label_smoothing > 0
//   empty_sequence   conventions for a sequence with no completion token: "error" (SPEC's refusal), "zero"
//                    (SPEC's empty_sequence = zero option), "nan" (the peers' NaN outputs where SPEC errors)
//   invalid_inputs   "error" (refuses SPEC's invalid inputs) or "unchecked" (computes whatever it is given)
//   max_shape        {"B", "T", "H", "V"}: the largest it takes (each key optional)
//   deterministic    bitwise-identical outputs when run twice on the same inputs
#pragma once

#include "problem/problem.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace simpo::verifier {

struct Capabilities {
  std::optional<std::vector<std::string>> dtypes;          // "bf16", "f16", "f32"
  std::optional<bool> bias, label_smoothing;
  std::optional<std::vector<std::string>> empty_sequence;  // "error", "zero", "nan"
  std::optional<std::string> invalid_inputs;               // "error", "unchecked"
  std::optional<std::int64_t> max_B, max_T, max_H, max_V;
  std::optional<bool> deterministic;

  bool declares_empty_sequence(const std::string& convention) const;  // absent: error and zero (SPEC)
  bool is_deterministic() const { return deterministic.value_or(false); }
  bool all_of_spec() const;  // nothing declared
  std::string to_json() const;
};

// Parses a declaration (a JSON object); `where` names its source in messages ("--capabilities caps.json",
// "the program's capabilities answer"). InputError naming the key for anything malformed: an unknown key, a
// value of the wrong type, an unknown dtype or convention, a max_shape dimension < 1.
Capabilities capabilities_from_json(const std::string& text, const std::string& where);
Capabilities capabilities_from_file(const std::string& path);  // `--capabilities FILE.json`

// The key of `declared` that excludes this problem, or nothing when it is to be judged. Decided from the inputs
// alone (no run of the implementation or the reference):
//   dtypes, bias, label_smoothing, max_shape: the input is outside what is declared
//   empty_sequence: the problem has a sequence with no completion token and asks for a convention the
//     implementation does not declare (empty_sequence = zero without "zero"; SPEC's error without "error" or
//     "nan"). With "nan" and not "error" the case is judged as the NaN convention (properties.h).
// invalid_inputs = unchecked is decided later, once the reference has said whether SPEC rejects the input
// (CaseRun::excluded_by).
std::optional<std::string> exclusion(const Capabilities& declared, const Problem&);

// Whether some sequence of the problem has no completion token (n[b] = 0).
bool has_empty_sequence(const Problem&);

}  // namespace simpo::verifier
