// The accuracy table of ANCHORS.md for the cuda backend: relative Frobenius error of each gradient against
// the float64 reference next to its bf16 floor, and the relative error of loss, nll and logps, for B in
// {2, 8, 32} at realistic (2) and large (30) logit scales on ANCHORS' shape (T=256, H=1024, V=32000).
// Exit 1 when any row misses the bar (gradients <= 1.5x floor, scalars <= 5e-7 relative).
#include "fused/cuda/cuda_backend.h"
#include "fused/cuda/device_fused.h"
#include "fused/tests/accuracy.h"
#include "problem/generate.h"
#include "reference/reference.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

int main(int argc, char** argv) {
  using namespace simpo;
  CLI::App app{"cuda backend: relative Frobenius errors vs the bf16 floor (ANCHORS.md's table)"};
  std::int64_t T = 256, H = 1024, V = 32000;
  std::vector<std::int64_t> batches = {2, 8, 32};
  std::vector<double> scales = {2.0, 30.0};
  std::uint64_t seed = 1;
  bool bias = false;
  app.add_option("--T", T, "tokens per sequence");
  app.add_option("--H", H, "hidden size");
  app.add_option("--V", V, "vocabulary size");
  app.add_option("--B", batches, "sequences (B/2 pairs), one row each");
  app.add_option("--scales", scales, "logit standard deviations");
  app.add_option("--seed", seed, "generator seed");
  app.add_flag("--bias", bias, "with an LM-head bias");
  fused::cuda::Tuning tuning;
  tuning.logits_k_splits = 0;
  app.add_option("--logits-k-splits", tuning.logits_k_splits,
                 "slices of the logits GEMM's k (1: fastest; default: from fused::Options::logits_k_slice)");
  CLI11_PARSE(app, argc, argv);
  if (tuning.logits_k_splits == 0) tuning = fused::cuda::tuning_for(H, fused::Options{});
  if (!fused::cuda::device_present()) {
    std::fprintf(stderr, "cuda_accuracy: no CUDA device\n");
    return 2;
  }

  std::printf("cuda backend, T=%lld H=%lld V=%lld%s, logits k in %d slice(s), ignore pattern prompt_prefix, "
              "default hyperparameters\n", (long long)T, (long long)H, (long long)V, bias ? ", bias" : "",
              tuning.logits_k_splits);
  std::printf("%4s %6s | %-24s | %-24s | %9s %9s %9s | %7s %7s\n", "B", "scale", "grad_x err / floor = x",
              "grad_weight err / floor = x", "loss", "nll", "logps", "cuda s", "ref s");
  bool all_pass = true;
  for (double scale : scales) {
    for (std::int64_t B : batches) {
      CaseSpec spec;
      spec.shape = {.B = B, .T = T, .H = H, .V = V};
      spec.logit_scale = scale;
      spec.seed = seed;
      spec.bias = bias;
      const Problem problem = generate(spec);
      fused::Options options;
      options.backend = fused::Backend::cuda;
      const auto t0 = std::chrono::steady_clock::now();
      const TensorMap out = fused::cuda::compute(problem, options, tuning);
      const auto t1 = std::chrono::steady_clock::now();
      const TensorMap exact = reference::compute(problem);
      const auto t2 = std::chrono::steady_clock::now();

      auto grad = [&](const char* name, double& ratio) {
        const double e = fused::testing::relative_error(out.at(name), exact.at(name));
        const double f = fused::testing::bf16_floor(exact.at(name));
        ratio = e / f;
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
      std::printf("%4lld %6.1f | %-24s | %-26s | %9.1e %9.1e %9.1e | %7.2f %7.2f\n", (long long)B, scale, gx.c_str(),
                  gw.c_str(), loss, nll, logps, std::chrono::duration<double>(t1 - t0).count(),
                  std::chrono::duration<double>(t2 - t1).count());
      std::fflush(stdout);
      all_pass = all_pass && rx <= fused::testing::gradient_floor_ratio_bar &&
                 rw <= fused::testing::gradient_floor_ratio_bar && loss <= fused::testing::scalar_relative_bar &&
                 nll <= fused::testing::scalar_relative_bar && logps <= fused::testing::scalar_relative_bar;
    }
  }
  std::printf("bar: gradients <= %.1fx floor, loss/nll/logps <= %.0e relative: %s\n",
              fused::testing::gradient_floor_ratio_bar, fused::testing::scalar_relative_bar,
              all_pass ? "met" : "MISSED");
  return all_pass ? 0 : 1;
}
