// Writes cases for the independent numpy implementation to check, so that check runs under ctest whether or not
// the committed fixtures exist yet:
//   DIR/<name>.inputs.safetensors, DIR/<name>.reference.safetensors    the reference's outputs, to agree with
//   DIR/tampered/<name>.*                                              outputs altered by less than float32
//                                                                      rounding, which the check must reject
#include "problem/generate.h"
#include "problem/problem_io.h"
#include "reference/reference.h"
#include "reference/tests/test_problems.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>

namespace {

using namespace simpo;
using reference::testing::case_spec;

void write_case(const std::filesystem::path& dir, const std::string& name, const Problem& problem, const TensorMap& outputs) {
  save_problem((dir / (name + ".inputs.safetensors")).string(), problem);
  save_outputs((dir / (name + ".reference.safetensors")).string(), outputs, {{"implementation", "reference"}});
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: %s DIR [cpu|cuda]   (which float64 reference writes the outputs; default cpu)\n", argv[0]);
    return 2;
  }
  try {
    const std::filesystem::path dir = argv[1];
    reference::Options options;  // the device whose outputs the numpy implementation checks
    options.device = reference::device_from_name(argc == 3 ? argv[2] : "cpu");
    if (options.device == reference::Device::cuda && !reference::cuda_available()) {
      std::printf("skipped: %s\n", reference::cuda_unavailable_reason().c_str());
      return 77;  // ctest: skipped, never passed
    }
    std::filesystem::create_directories(dir / "tampered");

    CaseSpec defaults = case_spec({2, 8, 16, 32}, false, IgnorePattern::prompt_prefix, 2.0, 101, {}, "defaults");
    CaseSpec smoothing = case_spec({4, 5, 12, 40}, true, IgnorePattern::random, 2.0, 102, {}, "bias, label smoothing, grad_scale");
    smoothing.hp.beta = 2.0;
    smoothing.hp.gamma = 0.3;
    smoothing.hp.alpha = 0.5;
    smoothing.hp.label_smoothing = 0.2;
    smoothing.hp.grad_scale = 1.5;
    CaseSpec empty = case_spec({4, 6, 8, 20}, true, IgnorePattern::empty_sequence, 2.0, 103, {}, "empty_sequence=zero");
    empty.hp.empty_sequence = EmptySequence::zero;
    empty.hp.alpha = 0.0;  // the empty sequence may be the only chosen one with tokens missing: keep N_c = 0 legal
    CaseSpec no_nll = case_spec({6, 4, 10, 24}, false, IgnorePattern::all_but_one, 2.0, 104, {}, "no NLL, ignore_index inside V");
    no_nll.hp.compute_nll_loss = false;
    no_nll.hp.ignore_index = 5;
    no_nll.hp.label_smoothing = 0.5;
    no_nll.hp.gamma = 0.0;
    CaseSpec large = case_spec({2, 16, 64, 300}, true, IgnorePattern::none, 12.0, 105, {}, "large logits");
    large.hp.beta = 0.5;

    int written = 0;
    for (const auto& [name, spec] : {std::pair{"defaults", defaults}, std::pair{"smoothing", smoothing},
                                     std::pair{"empty_sequence_zero", empty}, std::pair{"no_nll", no_nll},
                                     std::pair{"large_logits", large}}) {
      const Problem problem = generate(spec);
      write_case(dir, name, problem, reference::compute(problem, options));
      ++written;
    }
    {
      const Problem problem = generate(smoothing);
      reference::Options loss_only = options;
      loss_only.gradients = false;
      write_case(dir, "forward_only", problem, reference::compute(problem, loss_only));
      ++written;
    }

    // Tampered outputs: one grad_weight entry moved by 1e-8 of the tensor's largest entry, and the loss rounded to
    // float32 (what a fused backend's F32 scalar carries). Both are far below any visible error and far above
    // float64 rounding; the numpy check must reject both.
    const Problem problem = generate(smoothing);
    TensorMap outputs = reference::compute(problem, options);
    auto grad_weight = outputs.at("grad_weight").as<double>();
    double scale = 0;
    for (double g : grad_weight) scale = std::max(scale, std::abs(g));
    grad_weight[7] += 1e-8 * scale;
    write_case(dir / "tampered", "grad_weight_nudged", problem, outputs);
    outputs = reference::compute(problem, options);
    auto loss = outputs.at("loss").as<double>();
    loss[0] = static_cast<double>(static_cast<float>(loss[0]));
    write_case(dir / "tampered", "loss_rounded_to_f32", problem, outputs);
    std::printf("wrote %d cases and 2 tampered ones under %s\n", written, dir.string().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return 0;
}
