// Problems and outputs to and from safetensors files (SPEC "Files").
#pragma once

#include "problem/problem.h"
#include "problem/safetensors.h"

namespace simpo {

// Inputs file <-> Problem. Reading checks dtypes (x, weight, bias each BF16, F16 or F32; that they agree is
// validate()'s, which names both) and shapes and parses every hyperparameter in __metadata__ (absent ones take
// SPEC's defaults); it does not run validate().
Problem problem_from_file(const SafetensorsFile&, const std::string& source_name);
SafetensorsFile problem_to_file(const Problem&);
// An inputs file's __metadata__ as hyperparameters (absent ones take SPEC's defaults; seed, description and other
// tools' keys are ignored; an unknown key or a value that does not parse is an InputError naming it).
Hyperparameters hyperparameters_from_metadata(const std::map<std::string, std::string>& metadata);
Problem load_problem(const std::string& path);
void save_problem(const std::string& path, const Problem&, const std::vector<std::string>& never_replace = {});

// Outputs file: any subset of SPEC's output names (unknown names are an error naming them).
TensorMap outputs_from_file(SafetensorsFile, const std::string& source_name);
TensorMap load_outputs(const std::string& path);
// never_replace: the command's inputs files (safetensors.h: write_safetensors).
void save_outputs(const std::string& path, const TensorMap& outputs, const std::map<std::string, std::string>& metadata = {},
                  const std::vector<std::string>& never_replace = {});

}  // namespace simpo
