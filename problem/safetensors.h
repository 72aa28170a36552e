// The Hugging Face safetensors format (8-byte little-endian header length, JSON header, raw little-endian
// data), with SPEC's dtypes BF16, F32, F64, I64. No C++ library for it is packaged here, so this is ours.
// Every malformed file is an InputError naming the file and the problem, never a crash.
#pragma once

#include "problem/tensor.h"

#include <map>
#include <string>

namespace simpo {

struct SafetensorsFile {
  TensorMap tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__": string to string
};

SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& source_name);
std::string serialize_safetensors(const SafetensorsFile&);  // deterministic: tensors in name order

SafetensorsFile read_safetensors(const std::string& path);
// Writes to a temporary file beside `path` and renames it, so a failure never leaves a half-written file.
void write_safetensors(const std::string& path, const SafetensorsFile&);

}  // namespace simpo
