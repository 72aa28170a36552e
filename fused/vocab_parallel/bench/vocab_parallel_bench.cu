// The vocab-parallel step's time on one GPU against the one-GPU fused step and against the GEMM floor, on the
// published shape with a large vocabulary (default T=1024, H=4096, V=256000, B=2). With one GPU lent, the G ranks
// run in process on it (in-process collectives), so the step can at best take G times one shard's GEMMs: the
// table shows that floor next to it. On a machine with G GPUs, --nccl puts one rank per GPU.
//   vocab_parallel_bench [--B 2 8] [--T 1024] [--H 4096] [--V 256000] [--shards 2 3] [--reps 5] [--nccl]
// Inputs: x ~ U(-sqrt3, sqrt3), W scaled for logits of standard deviation ~2, targets uniform with the first tenth
// of each sequence a prompt (never zeros: they run faster than real data). Times: medians over --reps after one
// warm-up; the fused steps by host clock around each synchronized run, the GEMMs by CUDA events.
#include "fused/cuda/bench/random_fill.cuh"
#include "fused/cuda/cuda_check.h"
#include "fused/cuda/device_fused.h"
#include "fused/cuda/gemm.h"
#include "fused/vocab_parallel/cuda_ranks.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

using namespace simpo;
using namespace simpo::fused;
using namespace simpo::fused::cuda;
namespace vp = simpo::fused::vocab_parallel;
using namespace simpo::fused::cuda::bench;

namespace {

void fill(std::vector<bf16>& out, float scale, std::uint64_t seed) {
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  const std::size_t n = out.size(), per = (n + threads - 1) / threads;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (std::size_t i = t * per; i < std::min(n, (t + 1) * per); ++i) out[i] = bf16(scale * uniform_pm1(seed, i));
    });
  for (auto& th : pool) th.join();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The one-GPU fused step (FusedRunner) on the same inputs, uploaded once; `schedule` gets its chunk plan.
double time_one_gpu(const Problem& p, const Options& options, int reps, std::string& schedule) {
  const Shape& s = p.shape;
  const std::int64_t N = s.N(), V = s.V, H = s.H, ld_h = padded(H);
  FusedRunner runner;
  const cudaStream_t stream = runner.stream();
  const DeviceInputs inputs = upload_inputs(p, stream);
  const DeviceProblem& d = inputs.problem;
  DeviceBuffer grad_x(N * H * 2, "grad_x"), grad_w(V * ld_h * 4, "grad_weight fp32"), grad_w16(V * H * 2, "grad_weight");
  DeviceGradients g;
  g.grad_x = grad_x.as<__nv_bfloat16>();
  g.grad_weight = grad_w.as<float>();
  g.grad_weight_16bit = grad_w16.as<__nv_bfloat16>();
  runner.run(d, &g, options);
  schedule = runner.last_report().schedule.to_string();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    runner.run(d, &g, options);  // ends synchronized (the row statistics on the host)
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  return median(ms);
}

// The step's three GEMMs over all N rows and `V` vocabulary rows, through the backend's cuBLASLt wrappers (one
// logits GEMM, no k slicing): logits, grad_x, grad_weight (overwrite). The floor of one rank's step.
double time_gemms(std::int64_t N, std::int64_t V, std::int64_t H, int reps) {
  const std::int64_t ld_h = padded(H), ld_v = padded(V);
  cudaStream_t stream;
  SIMPO_CUDA_CHECK(cudaStreamCreate(&stream));
  double result = 0;
  {
    DeviceBuffer scratch(32 << 20, "GEMM scratch"), x(N * ld_h * 2, "x"), w(V * ld_h * 2, "w"), logits(N * ld_v * 4, "logits"),
        dz(N * ld_v * 2, "dz"), gx(N * ld_h * 4, "grad_x"), gw(V * ld_h * 4, "grad_w");
    // Random operands (padding columns included: the floor needs no exact zeros there).
    fill_uniform<<<4096, 256, 0, stream>>>(x.as<__nv_bfloat16>(), 1, N * ld_h, N * ld_h, 1.7320508f, 1);
    fill_uniform<<<4096, 256, 0, stream>>>(w.as<__nv_bfloat16>(), 1, V * ld_h, V * ld_h, 0.054f, 2);
    fill_uniform<<<4096, 256, 0, stream>>>(dz.as<__nv_bfloat16>(), 1, N * ld_v, N * ld_v, 1e-3f, 4);
    SIMPO_CUDA_CHECK_LAUNCH();
    Gemms gemms(stream, scratch.get(), scratch.bytes());
    auto once = [&] {
      gemms.logits(N, V, ld_h, x.as<__nv_bfloat16>(), w.as<__nv_bfloat16>(), logits.as<float>(), ld_v);
      gemms.grad_x(N, V, ld_h, dz.as<__nv_bfloat16>(), ld_v, w.as<__nv_bfloat16>(), gx.as<float>());
      gemms.accumulate_grad_weight(N, V, ld_h, dz.as<__nv_bfloat16>(), ld_v, x.as<__nv_bfloat16>(), gw.as<float>(), true);
    };
    once();
    cudaEvent_t a, b;
    SIMPO_CUDA_CHECK(cudaEventCreate(&a));
    SIMPO_CUDA_CHECK(cudaEventCreate(&b));
    std::vector<double> ms;
    for (int i = 0; i < reps; ++i) {
      SIMPO_CUDA_CHECK(cudaEventRecord(a, stream));
      once();
      SIMPO_CUDA_CHECK(cudaEventRecord(b, stream));
      SIMPO_CUDA_CHECK(cudaEventSynchronize(b));
      float t = 0;
      SIMPO_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    result = median(ms);
  }
  cudaStreamDestroy(stream);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t T = 1024, H = 4096, V = 256000;
  int reps = 5;
  bool nccl = false;
  std::vector<int> shards = {2};
  std::vector<std::int64_t> batches = {2};
  CLI::App app{"The vocab-parallel step's time against the one-GPU fused step and the GEMM floor"};
  app.add_option("--B", batches, "sequences per step (one row of the table each)")->check(CLI::PositiveNumber);
  app.add_option("--T", T, "tokens per sequence")->check(CLI::PositiveNumber);
  app.add_option("--H", H, "hidden size")->check(CLI::PositiveNumber);
  app.add_option("--V", V, "vocabulary size")->check(CLI::PositiveNumber);
  app.add_option("--shards", shards, "vocabulary shards G (one column set each)")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timed repetitions (median)")->check(CLI::PositiveNumber);
  app.add_flag("--nccl", nccl, "one rank per GPU through NCCL (needs G GPUs)");
  CLI11_PARSE(app, argc, argv);
  try {
    cudaDeviceProp prop{};
    SIMPO_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    Options options;
    options.backend = Backend::cuda;
    options.validate = false;  // inputs made here are finite
    std::printf("device %s; T=%lld H=%lld V=%lld, full step (forward + gradients, bf16 grad_weight), median of %d; "
                "workspace %lld MiB per rank (one GPU: also G times that)\n",
                prop.name, (long long)T, (long long)H, (long long)V, reps, (long long)(options.workspace_bytes >> 20));
    for (const std::int64_t B : batches) {
      Problem p;
      p.shape = {B, T, H, V};
      const std::int64_t N = p.shape.N();
      p.x = std::vector<bf16>(static_cast<std::size_t>(N * H));
      p.weight = std::vector<bf16>(static_cast<std::size_t>(V * H));
      fill(p.x.as<bf16>(), 1.7320508f, 1);
      fill(p.weight.as<bf16>(), static_cast<float>(std::sqrt(3.0 * 4.0 / H)), 2);
      p.target.resize(static_cast<std::size_t>(N));
      for (std::int64_t r = 0; r < N; ++r)
        p.target[r] = (r % T) < T / 10 ? p.hp.ignore_index
                                       : std::min<std::int64_t>(V - 1, static_cast<std::int64_t>(0.5f * (uniform_pm1(3, r) + 1) * V));
      std::string schedule;
      const double one = time_one_gpu(p, options, reps, schedule);
      const double floor_one = time_gemms(N, V, H, reps);
      std::printf("B=%lld one GPU (FusedRunner): step %.2f ms | GEMM floor %.2f ms | step/floor %.3f | %s\n",
                  (long long)B, one, floor_one, one / floor_one, schedule.c_str());
      for (const int G : shards) {
        Options wide = options;
        wide.workspace_bytes = options.workspace_bytes * G;
        const double one_wide = time_one_gpu(p, wide, reps, schedule);
        std::printf("B=%lld one GPU, %lld MiB workspace: step %.2f ms | step/floor %.3f | %s\n", (long long)B,
                    (long long)(wide.workspace_bytes >> 20), one_wide, one_wide / floor_one, schedule.c_str());
        const auto split = vp::split_vocabulary(V, G);
        const double shard_floor = time_gemms(N, split[0].size(), H, reps);
        const vp::Communication c = nccl ? vp::Communication::nccl : vp::Communication::in_process;
        const double t = median(vp::time_ranks_cuda(p, options, G, c, reps, &schedule));
        std::printf("B=%lld G=%d %s: step %.2f ms | shard GEMM floor %.2f ms, x G = %.2f ms | step/(G floor) %.3f | "
                    "step/one GPU %.3f, /one GPU at G x workspace %.3f | %s\n",
                    (long long)B, G, vp::plan_cuda(G, c).description.c_str(), t, shard_floor, G * shard_floor,
                    t / (G * shard_floor), t / one, t / one_wide, schedule.c_str());
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vocab_parallel_bench: %s\n", e.what());
    return 2;
  }
  return 0;
}
