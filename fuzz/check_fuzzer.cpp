// libFuzzer target: `check`'s judgement (verifier/error_model.h: compare, format_table, format_json) of an
// arbitrary candidate file against one fixed inputs file and its reference outputs (fuzz/check_case: B=2, T=3,
// H=4, V=5 with a bias, so every output name is expected and each run is cheap). This is where a candidate's bytes meet arithmetic: odd dtypes,
// shapes that disagree, empty or enormous tensors, NaN, Inf, subnormals.
// Properties: no crash; a passed report means every expected tensor is there, with the reference's shape and
// finite values; the JSON document parses.
#include "problem/problem.h"
#include "problem/problem_io.h"
#include "verifier/error_model.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

struct Fixed {
  simpo::Problem problem;
  simpo::TensorMap exact;
  simpo::verifier::ProblemScales scales;
};

const Fixed& fixed() {
  static const Fixed f = [] {
    Fixed x;
    x.problem = simpo::load_problem(SIMPO_FUZZ_CHECK_CASE "/inputs.safetensors");
    x.exact = simpo::load_outputs(SIMPO_FUZZ_CHECK_CASE "/reference.safetensors");
    x.scales = simpo::verifier::ProblemScales::of(x.problem, &x.exact);
    return x;
  }();
  return f;
}

void fail(const char* what) {
  std::fprintf(stderr, "check_fuzzer: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const Fixed& f = fixed();
  simpo::TensorMap candidate;
  try {
    const std::string bytes(reinterpret_cast<const char*>(data), size);
    candidate = simpo::outputs_from_file(simpo::parse_safetensors(bytes, "candidate"), "candidate");
  } catch (const simpo::InputError&) {
    return 0;  // check exits 2 with the reader's message
  }
  for (const auto& profile : {simpo::verifier::strict_profile(), simpo::verifier::peer_profile()}) {
    const simpo::verifier::Report report = simpo::verifier::compare(f.scales, f.exact, candidate, profile);
    if (report.passed()) {
      for (const auto& [name, exact] : f.exact) {
        const auto it = candidate.find(name);
        if (it == candidate.end()) fail("passed with an expected tensor missing");
        if (it->second.numel() != exact.numel()) fail("passed with a tensor of the wrong size");
        for (double v : it->second.to_double())
          if (!std::isfinite(v)) fail("passed with a non-finite value");
      }
    }
    if (simpo::verifier::format_table(report).empty()) fail("empty table");
    if (!nlohmann::json::accept(simpo::verifier::format_json(report))) fail("format_json wrote invalid JSON");
  }
  return 0;
}
