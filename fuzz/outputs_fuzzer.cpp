// libFuzzer target: an outputs file (problem/problem_io.cpp: any subset of SPEC's output names) on arbitrary
// bytes: a malformed file or an unknown tensor name is an InputError, never a crash.
#include "problem/problem.h"
#include "problem/problem_io.h"

#include <cstdint>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    const simpo::TensorMap outputs = simpo::outputs_from_file(simpo::parse_safetensors(bytes, "fuzz input"), "fuzz input");
    for (const auto& [name, t] : outputs) (void)t.to_double();  // every element readable whatever the dtype
  } catch (const simpo::InputError&) {
  }
  return 0;
}
