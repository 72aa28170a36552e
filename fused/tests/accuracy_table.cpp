// The accuracy table of the issue: a fused backend's error against the float64 reference, next to the bf16
// floor, for B in {2, 8, 32} at realistic (2) and large (30) logit scales. ANCHORS.md measured the peers at
// T=256, H=1024, V=32000 on a GPU; the default here is that shape scaled down (T=64, H=512, V=8000) to run in
// a minute or two on a 2-core CPU; --T/--H/--V restore the full one. `--backend cuda` runs the same table on
// the GPU (fused/cuda/bench/gpu_run.sh), `--logits-k-slice` sets fused::Options::logits_k_slice.
#include "fused/fused.h"
#include "fused/tests/accuracy.h"
#include "problem/generate.h"
#include "reference/reference.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>

int main(int argc, char** argv) {
  using namespace simpo;
  CLI::App app{"a fused backend's relative Frobenius errors vs the bf16 floor, and its scalars' relative errors"};
  std::int64_t T = 64, H = 512, V = 8000;
  std::vector<std::int64_t> batches = {2, 8, 32};
  std::vector<double> scales = {2.0, 30.0};
  std::uint64_t seed = 1;
  app.add_option("--T", T, "tokens per sequence");
  app.add_option("--H", H, "hidden size");
  app.add_option("--V", V, "vocabulary size");
  app.add_option("--B", batches, "sequences (B/2 pairs), one row each");
  app.add_option("--scales", scales, "logit standard deviations");
  app.add_option("--seed", seed, "generator seed");
  std::string backend = "cpu";
  fused::Options options;
  app.add_option("--backend", backend, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--logits-k-slice", options.logits_k_slice,
                 "cuda: hidden units per logits-GEMM slice (0: one GEMM; default from fused::Options)");
  bool fp32_logits = false;
  app.add_flag("--fp32-logits", fp32_logits, "dz from fp32 logits (fused::Options::logit_distances off)");
  std::string dtype_name = "bf16";
  app.add_option("--dtype", dtype_name, "input dtype: bf16, f16 or f32 (the floor is that dtype's)")
      ->check(CLI::IsMember({"bf16", "f16", "f32"}));
  CLI11_PARSE(app, argc, argv);
  if (fp32_logits) options.logit_distances = false;
  DType dtype = DType::BF16;
  try {
    dtype = input_dtype_from_name(dtype_name);
    options.backend = fused::resolve(fused::backend_from_name(backend));
  } catch (const InputError& e) {
    std::fprintf(stderr, "fused_accuracy_table: %s\n", e.what());
    return 2;
  }

  std::printf("%s backend, %s inputs, T=%lld H=%lld V=%lld, logits_k_slice %lld, dz from %s, ignore pattern prompt_prefix, "
              "default hyperparameters\n", backend.c_str(), dtype_name.c_str(), static_cast<long long>(T), static_cast<long long>(H),
              static_cast<long long>(V), static_cast<long long>(options.logits_k_slice),
              options.logit_distances ? "16-bit logit distances" : "fp32 logits");
  std::printf("%4s %6s | %-21s | %-21s | %9s %9s %9s | %8s %8s\n", "B", "scale", "grad_x err / floor",
              "grad_weight err / floor", "loss", "nll", "logps", "fused s", "ref s");
  bool all_pass = true;
  for (double scale : scales) {
    for (std::int64_t B : batches) {
      CaseSpec spec;
      spec.shape = {.B = B, .T = T, .H = H, .V = V};
      spec.logit_scale = scale;
      spec.seed = seed;
      spec.dtype = dtype;
      const Problem problem = generate(spec);
      auto t0 = std::chrono::steady_clock::now();
      const TensorMap out = fused::compute(problem, options);
      auto t1 = std::chrono::steady_clock::now();
      const TensorMap exact = reference::compute(problem);
      auto t2 = std::chrono::steady_clock::now();

      bool bar_met = true;
      auto grad = [&](const char* name, double& ratio) {
        const double e = fused::testing::relative_error(out.at(name), exact.at(name));
        const double f = fused::testing::rounding_floor(exact.at(name), dtype);
        ratio = e / f;
        bar_met = bar_met && e <= fused::testing::gradient_bar(dtype, f, scale, V);
        char text[64];
        std::snprintf(text, sizeof text, "%.2e / %.2e = %.2f", e, f, ratio);
        return std::string(text);
      };
      auto relative = [&](const char* name) {
        double worst = 0;
        for (std::int64_t i = 0; i < exact.at(name).numel(); ++i)
          worst = std::max(worst, std::abs(out.at(name).value(i) - exact.at(name).value(i)) /
                                      std::abs(exact.at(name).value(i)));
        return worst;
      };
      double rx = 0, rw = 0;
      const std::string gx = grad(output_name::grad_x, rx), gw = grad(output_name::grad_weight, rw);
      const double loss = relative(output_name::loss), nll = relative(output_name::nll_loss);
      const double logps = std::max(relative(output_name::chosen_logps), relative(output_name::rejected_logps));
      std::printf("%4lld %6.1f | %-21s | %-23s | %9.1e %9.1e %9.1e | %8.2f %8.2f\n", static_cast<long long>(B), scale,
                  gx.c_str(), gw.c_str(), loss, nll, logps, std::chrono::duration<double>(t1 - t0).count(),
                  std::chrono::duration<double>(t2 - t1).count());
      std::fflush(stdout);
      all_pass = all_pass && bar_met && loss <= fused::testing::scalar_relative_bar &&
                 nll <= fused::testing::scalar_relative_bar && logps <= fused::testing::scalar_relative_bar;
    }
  }
  std::printf("bar: gradients <= %.1fx floor%s, loss/nll/logps <= %.0e relative: %s\n",
              fused::testing::gradient_floor_ratio_bar, dtype == DType::F32 ? " + 2 u32 scale sqrt(2 ln V)" : "",
              fused::testing::scalar_relative_bar, all_pass ? "met" : "MISSED");
  return all_pass ? 0 : 1;
}
