// How close the float64 reference runs to its floor: the three float64 GEMMs any forward+backward of a linear
// layer must do, timed in the same process through the same OpenBLAS calls (reference/blas_products.h) and threads.
//   logits       Z  = X W^T     [N,H] x [H,V]
//   grad_x       dX = Z W       [N,V] x [V,H]
//   grad_weight  dW = Z^T X     [V,N] x [N,H]
// The reference does exactly these (by pieces) plus O(N V) elementwise work when whole pairs fit its chunk, so
// the ratio reference / floor should be a little above 1; a ratio near 4/3 means it recomputed the logits.
#include "problem/generate.h"
#include "reference/blas_products.h"
#include "reference/reference.h"
#include "reference/reference_core.h"

#include <CLI/CLI.hpp>
#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <omp.h>

namespace {

using RowMajorMatrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Times the float64 reference against three float64 GEMMs of the same shapes"};
  simpo::CaseSpec spec;
  spec.shape = {2, 1024, 4096, 128256};  // the published workload at B = 2
  spec.seed = 1;
  std::int64_t chunk_rows = 0;
  int reps = 1;
  app.add_option("--B", spec.shape.B, "sequences (even)");
  app.add_option("--T", spec.shape.T, "tokens per sequence");
  app.add_option("--H", spec.shape.H, "hidden size");
  app.add_option("--V", spec.shape.V, "vocabulary size");
  app.add_option("--seed", spec.seed, "case seed");
  app.add_flag("--bias", spec.bias, "give the LM head a bias");
  app.add_option("--chunk-rows", chunk_rows, "reference::Options::chunk_rows (0: its default)");
  app.add_option("--reps", reps, "floor and reference alternate this many times; the fastest of each is compared");
  CLI11_PARSE(app, argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a long run logged to a file shows each line as it comes

  try {
    const simpo::Shape& s = spec.shape;
    const std::int64_t N = s.N();
    std::printf("shape %s, %d OpenMP threads, %s\n", s.to_string().c_str(), omp_get_max_threads(),
                simpo::reference::blas::description().c_str());
    auto start = std::chrono::steady_clock::now();
    const simpo::Problem problem = simpo::generate(spec);
    std::printf("generate: %.1f s\n", seconds_since(start));

    // Floor and reference alternate --reps times and each keeps its fastest run: on a shared machine the load
    // changes from minute to minute, and the minimum is the run it disturbed least.
    double best_floor = INFINITY, best_reference = INFINITY, loss = 0;
    for (int rep = 0; rep < reps; ++rep) {
      double floor_seconds = 0;
      {
        const std::vector<double> x_values = simpo::reference::widen(problem.x);
        const std::vector<double> w_values = simpo::reference::widen(problem.weight);
        const double* X = x_values.data();
        const double* W = w_values.data();
        RowMajorMatrix Z(N, s.V), dX(N, s.H), dW(s.V, s.H);
        const double flops = 2.0 * static_cast<double>(N) * static_cast<double>(s.H) * static_cast<double>(s.V);
        auto time_gemm = [&](const char* name, auto&& gemm) {
          const auto t0 = std::chrono::steady_clock::now();
          gemm();
          const double t = seconds_since(t0);
          std::printf("  %-28s %8.2f s  %6.1f GFLOP/s\n", name, t, flops / t * 1e-9);
          floor_seconds += t;
        };
        namespace blas = simpo::reference::blas;
        std::printf("floor: three float64 GEMMs (OpenBLAS), run %d\n", rep + 1);
        time_gemm("Z = X W^T   [N,H]x[H,V]", [&] { blas::logits(X, W, Z.data(), N, s.V, s.H); });
        time_gemm("dX = Z W    [N,V]x[V,H]", [&] { blas::grad_x(Z.data(), W, dX.data(), N, s.V, s.H); });
        time_gemm("dW = Z^T X  [V,N]x[N,H]", [&] { blas::accumulate_grad_weight(Z.data(), X, dW.data(), N, s.V, s.H, true); });
        std::printf("  %-28s %8.2f s  %6.1f GFLOP/s\n", "total", floor_seconds, 3 * flops / floor_seconds * 1e-9);
      }  // the floor's buffers go before the reference allocates its own

      simpo::reference::Options options;
      options.chunk_rows = chunk_rows;
      double last_reported = 0;
      options.progress = [&](double fraction) {
        if (fraction >= last_reported + 0.1 || fraction == 1.0) {
          std::fprintf(stderr, "  reference %3.0f%%\n", 100 * fraction);
          last_reported = fraction;
        }
      };
      start = std::chrono::steady_clock::now();
      const simpo::TensorMap outputs = simpo::reference::compute(problem, options);
      const double reference_seconds = seconds_since(start);
      loss = outputs.at("loss").value(0);
      std::printf("reference (validate, widen, loss and all gradients), run %d: %.2f s, loss %.17g\n", rep + 1,
                  reference_seconds, loss);
      best_floor = std::min(best_floor, floor_seconds);
      best_reference = std::min(best_reference, reference_seconds);
    }
    std::printf("fastest of %d: three GEMMs %.2f s, reference %.2f s, ratio reference / three GEMMs: %.3f\n", reps,
                best_floor, best_reference, best_reference / best_floor);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return 0;
}
