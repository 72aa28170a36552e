// libFuzzer target: an inputs file (problem/problem_io.cpp) and SPEC's validation (problem/problem.cpp) on
// arbitrary bytes: every malformed or invalid file must be an InputError, never a crash, a hang or a huge
// allocation. A problem that validates is also written back and read again unchanged.
#include "problem/problem.h"
#include "problem/problem_io.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    const simpo::Problem problem = simpo::problem_from_file(simpo::parse_safetensors(bytes, "fuzz input"), "fuzz input");
    simpo::validate(problem);
    const std::string again = simpo::serialize_safetensors(simpo::problem_to_file(problem));
    const simpo::Problem back = simpo::problem_from_file(simpo::parse_safetensors(again, "again"), "again");
    if (simpo::serialize_safetensors(simpo::problem_to_file(back)) != again) {
      std::fprintf(stderr, "an inputs file did not survive a write and a read\n");
      std::abort();
    }
  } catch (const simpo::InputError&) {
  }
  return 0;
}
