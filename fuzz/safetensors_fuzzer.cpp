// libFuzzer target: the safetensors reader (problem/safetensors.cpp) on arbitrary bytes.
// Property: any input is either an InputError or a file that serializes and parses back to the same tensors
// and metadata (the writer and the reader agree on everything the reader accepts).
#include "problem/safetensors.h"
#include "problem/problem.h"

#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  simpo::SafetensorsFile file;
  try {
    file = simpo::parse_safetensors(bytes, "fuzz input");
  } catch (const simpo::InputError&) {
    return 0;  // refused with a message: the expected outcome for most inputs
  }
  const std::string again = simpo::serialize_safetensors(file);
  const simpo::SafetensorsFile back = simpo::parse_safetensors(again, "re-serialized fuzz input");
  if (back.metadata != file.metadata || back.tensors.size() != file.tensors.size()) {
    std::fprintf(stderr, "round trip changed the file's metadata or tensor count\n");
    std::abort();
  }
  for (const auto& [name, t] : file.tensors) {
    const auto it = back.tensors.find(name);
    if (it == back.tensors.end() || it->second.dtype != t.dtype || it->second.shape != t.shape ||
        it->second.bytes != t.bytes) {
      std::fprintf(stderr, "round trip changed tensor %s\n", name.c_str());
      std::abort();
    }
  }
  return 0;
}
