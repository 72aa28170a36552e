// Benchmark of the cuda backend on the published workload (T=1024, H=4096, V=128256, bf16): fused
// forward-only and forward+backward times against the floor measured in the same run: the same GEMMs through
// cuBLAS with bf16 outputs, as torch runs them (1 GEMM for the forward, 3 for forward+backward); the peak device memory the fused step takes
// above its inputs and outputs. Random inputs (never zeros: they run faster than real data), times are medians
// of CUDA-event intervals after warm-up, the fused step and its floor timed in turns. Inputs live on the device:
// no host transfers are timed. Each B also prints one "JSON {...}" line (bench/speed_table.py collects them);
// --kernels adds the step kernel by kernel (CUPTI, bench/kernel_trace.h).
#include "fused/cuda/bench/kernel_trace.h"
#include "fused/cuda/bench/interleaved_timing.cuh"
#include "fused/cuda/bench/random_fill.cuh"
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_fused.h"
#include "fused/cuda/gemm.h"
#include "fused/cuda/hilo_gemm.h"
#include "fused/cuda/promoted_gemm.h"

#include <CLI/CLI.hpp>
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

using namespace simpo;
using namespace simpo::fused;
using namespace simpo::fused::cuda;
using namespace simpo::fused::cuda::bench;

namespace {

// Targets uniform in [0, V); the first tenth of each sequence is a prompt (ignore_index), as in training data.
__global__ void fill_targets(std::int64_t* target, std::int64_t N, std::int64_t T, std::int64_t V,
                             std::int64_t ignore_index, std::uint64_t seed) {
  for (std::int64_t r = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; r < N;
       r += std::int64_t(gridDim.x) * blockDim.x) {
    const float u = 0.5f * (uniform_pm1(seed, r) + 1.0f);
    target[r] = (r % T) < T / 10 ? ignore_index : min(V - 1, static_cast<std::int64_t>(u * V));
  }
}

Timing time_it(cudaStream_t stream, int warmup, int reps, const std::function<void()>& body) {
  return time_interleaved(stream, warmup, reps, {body})[0];
}

std::int64_t free_device_bytes() {
  std::size_t free_bytes = 0, total = 0;
  SIMPO_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return static_cast<std::int64_t>(free_bytes);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The cuda backend's fused step on the published workload against the same run's cuBLAS floor"};
  std::vector<std::int64_t> batches = {2, 4, 8, 16};
  std::int64_t T = 1024, H = 4096, V = 128256, workspace_mib = default_workspace_bytes >> 20, max_chunk_rows = 0;
  std::int64_t logits_k_slice = Options{}.logits_k_slice;
  int warmup = 3, reps = 10;
  Tuning tuning;
  std::string low_memory = "auto";
  bool kernels = false, block_timing = false, fp32_logits = false;
  app.add_option("--B", batches, "sequences (B/2 pairs); a list")->capture_default_str();
  app.add_option("--T", T, "tokens per sequence")->capture_default_str();
  app.add_option("--H", H, "hidden size")->capture_default_str();
  app.add_option("--V", V, "vocabulary")->capture_default_str();
  app.add_option("--workspace-mib", workspace_mib, "the workspace budget")->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions (the median is reported)")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed repetitions first")->capture_default_str();
  app.add_option("--max-chunk-rows", max_chunk_rows, "cap on rows per chunk (0: the plan's)")->capture_default_str();
  app.add_option("--logits-k-slice", logits_k_slice, "Options::logits_k_slice (k per promotion / cuBLAS slice; 0: one GEMM)")
      ->capture_default_str();
  std::int64_t against_k_slice = -1;
  app.add_option("--against-logits-k-slice", against_k_slice,
                 "also time the step with this logits_k_slice in turns with this run's, and print their ratio "
                 "(a kernel variant against the default in one process: -1, off)")
      ->capture_default_str();
  app.add_option("--statistics-launch-rows", tuning.statistics_launch_rows,
                 "Tuning::statistics_launch_rows: the statistics GEMM's rows per launch at most (0: a chunk's part)")
      ->capture_default_str();
  std::int64_t against_statistics_launch_rows = -1;
  app.add_option("--against-statistics-launch-rows", against_statistics_launch_rows,
                 "also time the step with this statistics_launch_rows in turns with this run's, and print their ratio "
                 "(-1, off)")
      ->capture_default_str();
  app.add_flag("--cublas-logits", tuning.cublas_logits, "the logits through cuBLAS even where the promoted GEMM runs");
  app.add_flag("--fp32-grad-w-slices", tuning.fp32_grad_w_slices,
               "the low-memory schedule's grad_W slices in fp32 rows instead of the hi/lo pair");
  bool against_fp32_grad_w_slices = false;
  app.add_flag("--against-fp32-grad-w-slices", against_fp32_grad_w_slices,
               "also time the step with the other grad_W slice form in turns with this run's, and print their ratio");
  bool logit_distances = Options{}.logit_distances;
  app.add_flag("--logit-distances", logit_distances, "the full step keeps 16-bit logit distances");
  app.add_flag("--fp32-logits", fp32_logits, "the full step keeps fp32 logits");
  app.add_option("--low-memory", low_memory, "the vocabulary-sliced schedule: always, never, or auto (when the budget "
                                             "cannot hold one pair's rows)")
      ->check(CLI::IsMember({"always", "never", "auto"}))
      ->capture_default_str();
  app.add_flag("--kernels", kernels,
               "after each B's row, 3 full steps, 3 forwards and 3 rounds of full step and floor in turns, kernel by "
               "kernel (CUPTI)");
  app.add_flag("--block-timing", block_timing, "each body's repetitions back to back instead of in turns");
  CLI11_PARSE(app, argc, argv);
  if (fp32_logits) logit_distances = false;
  tuning.low_memory = low_memory == "always"  ? Tuning::LowMemory::always
                      : low_memory == "never" ? Tuning::LowMemory::never
                                              : Tuning::LowMemory::automatic;
  const std::int64_t workspace = workspace_mib << 20;
  Options plan_options;
  plan_options.workspace_bytes = workspace;
  plan_options.logits_k_slice = logits_k_slice;
  plan_options.logit_distances = logit_distances;
  const GradientOutputs bf16_outputs{.grad_weight_16bit = true};
  const StepPlan header_plan = plan_step({.B = 2, .T = T, .H = H, .V = V}, DType::BF16, plan_options, device_features(),
                                         &bf16_outputs, tuning);
  const std::string logits_gemm = header_plan.logits_form();
  const std::string grad_weight_path = header_plan.grad_weight_form();
  try {
    cudaDeviceProp prop{};
    SIMPO_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs, %.1f GiB; T=%lld H=%lld V=%lld, workspace budget %lld MiB, logits: %s, "
                "grad_W: %s, %d reps (median)\n", prop.name, prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0,
                (long long)T, (long long)H, (long long)V, (long long)(workspace >> 20), logits_gemm.c_str(),
                grad_weight_path.c_str(), reps);
    std::printf("%4s | %9s %9s | %9s %9s | %7s %7s | %10s %10s | %s\n", "B", "floor fwd", "fused fwd", "floor full",
                "fused full", "fwd/fl", "full/fl", "extra MiB", "(ws+acc)", "schedule");

    for (const std::int64_t B : batches) {
      const std::int64_t N = B * T, ld_h = padded(H), ld_v = padded(V);
      FusedRunner runner;
      const cudaStream_t stream = runner.stream();

      // Inputs: x ~ U(-sqrt3, sqrt3) (variance 1), W scaled for logits of standard deviation ~2.
      DeviceBuffer x(N * ld_h * 2, "x"), weight(V * ld_h * 2, "weight"), target(N * 8, "target");
      fill_uniform<<<4096, 256, 0, stream>>>(x.as<__nv_bfloat16>(), N, H, ld_h, 1.7320508f, 1);
      SIMPO_CUDA_CHECK_LAUNCH();
      fill_uniform<<<4096, 256, 0, stream>>>(weight.as<__nv_bfloat16>(), V, H, ld_h,
                                              static_cast<float>(std::sqrt(3.0 * 4.0 / H)), 2);
      SIMPO_CUDA_CHECK_LAUNCH();
      Hyperparameters hp;
      fill_targets<<<256, 256, 0, stream>>>(target.as<std::int64_t>(), N, T, V, hp.ignore_index, 3);
      SIMPO_CUDA_CHECK_LAUNCH();
      std::vector<std::int64_t> host_target(N);
      SIMPO_CUDA_CHECK(cudaMemcpyAsync(host_target.data(), target.get(), N * 8, cudaMemcpyDeviceToHost, stream));
      SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));

      DeviceProblem problem;
      problem.shape = {.B = B, .T = T, .H = H, .V = V};
      problem.hp = hp;
      problem.ld_h = ld_h;
      problem.x = x.as<__nv_bfloat16>();
      problem.weight = weight.as<__nv_bfloat16>();
      problem.target = target.as<std::int64_t>();
      problem.targets.n.assign(B, 0);
      for (std::int64_t r = 0; r < N; ++r) {
        const bool completion = host_target[r] != hp.ignore_index;
        problem.targets.n[r / T] += completion;
        if (completion && r / T < B / 2) ++problem.targets.n_chosen;
      }

      // Outputs (grad_x and the bf16 grad_weight). The runner's "extra" memory (workspace, grad_W accumulator: lo
      // of the hi/lo pair or an fp32 one, handles) is what its first run takes, measured below.
      DeviceBuffer grad_x(N * H * 2, "grad_x"), grad_weight_bf16(V * H * 2, "grad_weight");
      DeviceGradients gradients;
      gradients.grad_x = grad_x.as<__nv_bfloat16>();
      gradients.grad_weight_16bit = grad_weight_bf16.as<__nv_bfloat16>();  // no fp32 grad_W: the runner's choice

      Options options = plan_options;
      options.max_chunk_rows = max_chunk_rows;
      Options forward_options = options;
      forward_options.gradients = false;

      // The floor: the three GEMMs as torch runs them, cuBLAS with bf16 outputs (fp32 compute), no fused work
      // between them; and, for reference, the same GEMMs with fp32 outputs as the backend's cuBLAS path runs them.
      DeviceBuffer logits(N * ld_v * 4, "floor logits"), dz(N * ld_v * 2, "floor dz"), gx(N * ld_h * 4, "floor grad_x"),
          gemm_ws(std::size_t{32} << 20, "floor GEMM workspace"), grad_weight(V * ld_h * 4, "floor grad_W");
      fill_uniform<<<4096, 256, 0, stream>>>(dz.as<__nv_bfloat16>(), N, V, ld_v, 1e-3f, 4);  // not zeros
      SIMPO_CUDA_CHECK_LAUNCH();
      cublasHandle_t blas;
      SIMPO_CUBLAS_CHECK(cublasCreate(&blas));
      SIMPO_CUBLAS_CHECK(cublasSetStream(blas, stream));
      const float one = 1.0f, zero = 0.0f;
      // Row-major C[m, n] = A B as column-major C^T = B^T A^T; each call says which operand is transposed.
      auto bf16_gemm = [&](cublasOperation_t op_w, cublasOperation_t op_x, std::int64_t m, std::int64_t n,
                           std::int64_t k, const void* A, std::int64_t lda, const void* Bm, std::int64_t ldb, void* C,
                           std::int64_t ldc) {
        SIMPO_CUBLAS_CHECK(cublasGemmEx(blas, op_w, op_x, int(m), int(n), int(k), &one, A, CUDA_R_16BF, int(lda), Bm,
                                        CUDA_R_16BF, int(ldb), &zero, C, CUDA_R_16BF, int(ldc), CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT));
      };
      auto floor_logits = [&] {  // logits[N, V] = x W^T
        bf16_gemm(CUBLAS_OP_T, CUBLAS_OP_N, V, N, ld_h, problem.weight, ld_h, problem.x, ld_h, logits.get(), ld_v);
      };
      auto floor_step = [&] {
        floor_logits();
        // grad_x[N, H] = dz W
        bf16_gemm(CUBLAS_OP_N, CUBLAS_OP_N, ld_h, N, V, problem.weight, ld_h, dz.get(), ld_v, gx.get(), ld_h);
        // grad_W[V, H] = dz^T x
        bf16_gemm(CUBLAS_OP_N, CUBLAS_OP_T, ld_h, V, N, problem.x, ld_h, dz.get(), ld_v, grad_weight.get(), ld_h);
      };

      // The fused step once, for its report and the memory it takes (baseline: everything above), then the fused
      // step and its floor in turns (time_interleaved), forward+backward and forward alone.
      trim_device_pool();  // what the pool kept of the last B's workspace, out of the baseline
      const std::int64_t free_before = free_device_bytes();
      runner.run(problem, &gradients, options, tuning);
      const std::string schedule = runner.last_report().to_string();
      const std::int64_t workspace_full = runner.last_report().workspace_bytes;
      const int fallbacks = runner.last_report().gemm_fallbacks;
      const std::int64_t accumulator = runner.last_report().accumulator_bytes;
      const std::int64_t extra = free_before - free_device_bytes();  // workspace + accumulator + handles
      const std::function<void()> fused_step = [&] { runner.run(problem, &gradients, options, tuning); };
      const std::function<void()> fused_forward = [&] { runner.run(problem, nullptr, forward_options, tuning); };
      // --block-timing: each body's repetitions back to back (the method before time_interleaved), to compare.
      const auto full_pair = block_timing ? std::vector<Timing>{time_it(stream, warmup, reps, fused_step),
                                                                time_it(stream, warmup, reps, floor_step)}
                                          : time_interleaved(stream, warmup, reps, {fused_step, floor_step});
      const auto fwd_pair = block_timing ? std::vector<Timing>{time_it(stream, warmup, reps, fused_forward),
                                                               time_it(stream, warmup, reps, floor_logits)}
                                         : time_interleaved(stream, warmup, reps, {fused_forward, floor_logits});
      const std::string forward_schedule = runner.last_report().schedule.to_string();
      // --against-*: the other setting's step and forward in turns with this one's (same runner, inputs and
      // outputs; neither changes a buffer), so their ratio is free of the drift between runs.
      std::string against;
      auto time_against = [&](const char* name, std::int64_t value, const Options& full_options,
                              const Options& fwd_options, const Tuning& other) {
        const auto ab_full = time_interleaved(
            stream, warmup, reps, {fused_step, [&] { runner.run(problem, &gradients, full_options, other); }});
        const auto ab_fwd = time_interleaved(
            stream, warmup, reps, {fused_forward, [&] { runner.run(problem, nullptr, fwd_options, other); }});
        char line[256];
        std::snprintf(line, sizeof line,
                      "     in turns, %s %lld against this: forward %.3f / %.3f ms = %.4f, full %.3f / %.3f ms = %.4f\n",
                      name, (long long)value, ab_fwd[1].median_ms, ab_fwd[0].median_ms,
                      ab_fwd[1].median_ms / ab_fwd[0].median_ms, ab_full[1].median_ms, ab_full[0].median_ms,
                      ab_full[1].median_ms / ab_full[0].median_ms);
        against += line;
      };
      if (against_k_slice >= 0) {
        Options other = options, other_forward = forward_options;
        other.logits_k_slice = other_forward.logits_k_slice = against_k_slice;
        time_against("logits_k_slice", against_k_slice, other, other_forward, tuning);
      }
      if (against_statistics_launch_rows >= 0) {
        Tuning other = tuning;
        other.statistics_launch_rows = against_statistics_launch_rows;
        time_against("statistics_launch_rows", against_statistics_launch_rows, options, forward_options, other);
      }
      if (against_fp32_grad_w_slices) {
        Tuning other = tuning;
        other.fp32_grad_w_slices = !tuning.fp32_grad_w_slices;
        time_against("fp32_grad_w_slices", other.fp32_grad_w_slices, options, forward_options, other);
      }
      const Timing full = full_pair[0], floor_full = full_pair[1], forward = fwd_pair[0], floor_fwd = fwd_pair[1];
      SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
      Timing f32_fwd, f32_full;
      {
        Gemms gemms(stream, gemm_ws.get(), gemm_ws.bytes());
        auto f32_logits = [&] { gemms.logits(N, V, ld_h, problem.x, problem.weight, logits.as<float>(), ld_v); };
        f32_fwd = time_it(stream, warmup, reps, f32_logits);
        f32_full = time_it(stream, warmup, reps, [&] {
          f32_logits();
          gemms.grad_x(N, V, ld_h, dz.as<__nv_bfloat16>(), ld_v, problem.weight, gx.as<float>());
          gemms.accumulate_grad_weight(N, V, ld_h, dz.as<__nv_bfloat16>(), ld_v, problem.x, grad_weight.as<float>());
        });
      }
      const double flops_fwd = 2.0 * N * H * V;
      std::printf("%4lld | %9.2f %9.2f | %9.2f %9.2f | %7.2f %7.2f | %10.0f %10s | %s%s\n", (long long)B,
                  floor_fwd.median_ms, forward.median_ms, floor_full.median_ms, full.median_ms,
                  forward.median_ms / floor_fwd.median_ms, full.median_ms / floor_full.median_ms,
                  extra / 1048576.0,
                  (std::to_string(workspace_full >> 20) + "+" + std::to_string(accumulator >> 20)).c_str(),
                  schedule.c_str(), fallbacks ? " (cuBLAS fallbacks!)" : "");
      std::printf("     floor (bf16 out) rate: fwd %.0f TFLOP/s, full %.0f TFLOP/s; fused full %.0f TFLOP/s (3 GEMMs' "
                  "flops); fp32-out cuBLASLt GEMMs: fwd %.2f full %.2f ms\n",
                  flops_fwd / floor_fwd.median_ms / 1e9, 3 * flops_fwd / floor_full.median_ms / 1e9,
                  3 * flops_fwd / full.median_ms / 1e9, f32_fwd.median_ms, f32_full.median_ms);
      std::printf("     forward: %s\n", forward_schedule.c_str());
      std::printf("%s", against.c_str());
      std::printf("JSON {\"B\": %lld, \"floor_fwd_ms\": %.4f, \"fused_fwd_ms\": %.4f, \"floor_full_ms\": %.4f, "
                  "\"fused_full_ms\": %.4f, \"extra_mib\": %.1f, \"logits\": \"%s\", \"grad_w\": \"%s\", "
                  "\"workspace_mib\": %lld, \"workspace_used_mib\": %.1f, \"accumulator_mib\": %.1f}\n",
                  (long long)B, floor_fwd.median_ms, forward.median_ms, floor_full.median_ms, full.median_ms,
                  extra / 1048576.0, logits_gemm.c_str(), grad_weight_path.c_str(), (long long)(workspace >> 20),
                  workspace_full / 1048576.0, accumulator / 1048576.0);
      if (kernels) {
        SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
        constexpr int steps = 3;
        for (const bool full_step : {true, false}) {  // KernelTrace: one at a time
          std::printf("     %s, kernel by kernel:\n", full_step ? "full step" : "forward");
          KernelTrace trace;
          for (int i = 0; i < steps; ++i)
            runner.run(problem, full_step ? &gradients : nullptr, full_step ? options : forward_options, tuning);
          trace.stop();
          trace.print(stdout, steps);
        }
        // The full step in turns with its floor, as it was timed above: the same kernels' durations beside the
        // floor's GEMMs (clocks and caches as the ratio saw them), the floor's cuBLAS kernels listed with them.
        std::printf("     full step and floor in turns, kernel by kernel:\n");
        KernelTrace trace;
        for (int i = 0; i < steps; ++i) {
          fused_step();
          floor_step();
        }
        SIMPO_CUDA_CHECK(cudaStreamSynchronize(stream));
        trace.stop();
        trace.print(stdout, steps);
      }
      cublasDestroy(blas);  // the floor's handle: timed above, traced in turns with the step just now
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
