// The cuda backend's own tests, beside the suite both backends pass (fused/tests/backend_suite.cpp, built into
// this executable as the CudaBackend* tests): the logits GEMM's forms (cuBLAS slices, the promoted GEMM's
// variants), workspace budgets from the 64 MiB minimum up with the runner's own report, device errors and the
// dispatch. Needs a CUDA device: without one every test that runs the backend skips with a message saying so.
#include "fused/cuda/cuda_backend.h"
#include "fused/cuda/device_buffer.h"
#include "fused/cuda/device_fused.h"
#include "fused/cuda/hilo_gemm.h"
#include "fused/cuda/promoted_gemm.h"
#include "fused/cuda/promoted_stats.h"
#include "fused/fused.h"
#include "fused/schedule.h"
#include "fused/simpo_math.h"
#include "fused/tests/backend_suite.h"
#include "problem/generate.h"
#include "reference/reference.h"
#include "verifier/error_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace simpo::fused {
namespace {

using namespace suite;

#define SKIP_WITHOUT_DEVICE()                                                                             \
  do {                                                                                                     \
    if (!cuda::device_present())                                                                           \
      GTEST_SKIP() << "no CUDA device on this machine: the cuda backend tests run on a GPU machine (ctest -L gpu)"; \
  } while (0)

Options cuda_options() { return options_for(Backend::cuda); }

const Shape feature_shape{.B = 4, .T = 64, .H = 96, .V = 300};
const cuda::GradientOutputs bf16_outputs{.grad_weight_16bit = true};  // what cuda::compute gives the runner

// ---- the logits GEMM ----

// The logits GEMM through cuBLAS cut along k (Options::logits_k_slice; the default off sm_90): slices summed in the
// fp32 epilogue compute the same function. Odd H (31 -> 32 padded columns, slices of 8) and H = 96 (slices of
// 24/32) exercise the slice arithmetic.
TEST(CudaBackendFeatures, LogitsKSlicesMeetTheBar) {
  SKIP_WITHOUT_DEVICE();
  for (Shape shape : {Shape{.B = 4, .T = 16, .H = 31, .V = 123}, feature_shape}) {
    CaseSpec spec = spec_of(shape, 30.0, 33);
    spec.bias = true;
    const Problem problem = generate(spec);
    const TensorMap exact = reference::compute(problem);
    for (int slices : {2, 3, 4}) {
      SCOPED_TRACE(shape.to_string() + ", " + std::to_string(slices) + " slices");
      Options options = cuda_options();
      options.logits_k_slice = (shape.H + slices - 1) / slices;
      ASSERT_EQ(cuda::logits_gemm(shape.H, DType::BF16, options, {}).k_splits, slices);
      const TensorMap out = cuda::compute(problem, options, cuda::Tuning{.cublas_logits = true});
      expect_meets_bar(out, exact, spec.logit_scale);
    }
  }
}

// The promoted logits GEMM (promoted_gemm.h; the default on sm_90 when built with CUTLASS), promoting every 64,
// 256 or 512 k (512: a block of k tiles longer than the pipeline's stages, StaggeredMainloop), computes the same
// function, at odd sizes (rows and V not multiples of a tile, V % 4 != 0 for the cuBLAS tail, H = 31 padded to 32 <
// one k tile) as well. The full step with fp32 logits: the GEMM's stored logits and
// row_stats_kernel over them.
TEST(CudaBackendFeatures, PromotedLogitsGemmMeetsTheBar) {
  SKIP_WITHOUT_DEVICE();
  if (!cuda::promoted_logits_available())
    GTEST_SKIP() << "the promoted logits GEMM needs a build with CUTLASS and a device of compute capability 9.0";
  EXPECT_TRUE(cuda::logits_gemm(4096, DType::BF16, Options{}, cuda::device_features()).promoted) << "the default on sm_90";
  for (Shape shape : {Shape{.B = 4, .T = 16, .H = 31, .V = 123}, feature_shape, Shape{.B = 2, .T = 70, .H = 520, .V = 1001}}) {
    CaseSpec spec = spec_of(shape, 30.0, 34);
    spec.bias = true;
    const Problem problem = generate(spec);
    const TensorMap exact = reference::compute(problem);
    for (std::int64_t promotion_k : {64, 256, 512}) {
      SCOPED_TRACE(shape.to_string() + ", promotion_k " + std::to_string(promotion_k));
      Options options = cuda_options();
      options.logits_k_slice = promotion_k;
      options.logit_distances = false;
      const TensorMap out = cuda::compute(problem, options);
      expect_meets_bar(out, exact, spec.logit_scale);
    }
  }
}

// The row statistics from the promoted GEMM's epilogue (promoted_stats.h): the same function as row_stats_kernel
// over stored logits, in every schedule (the forward and two_pass's first pass store no logits; the full step's
// statistics come from the epilogue that writes the logit distances), with a bias, random ignored rows and a custom
// ignore_index, at V not a multiple of the 192-wide tile (200: a last tile of 8 columns) or a multiple (384), rows
// not a multiple of the 128-row tile; against row_stats_kernel (the forward through cuBLAS, the full step with fp32
// logits). The last two shapes have K a partial last k tile and 330 / 320 tiles, more than two per CTA on any GPU
// of <= 132 SMs; at promotion every k tile (64) and every four (256). V = 384 and 12288 run without a bias: the
// kernels without edges (promoted_stats.cu), 12288 with more tiles than CTAs. With distances the gradients move
// by their rounding (2^-12 of each softmax value), so the comparison there is the scalars'.
TEST(CudaBackendFeatures, EpilogueStatisticsMeetTheBarInEverySchedule) {
  SKIP_WITHOUT_DEVICE();
  if (!cuda::promoted_stats_available())
    GTEST_SKIP() << "the epilogue statistics need the promoted GEMM (CUTLASS build, compute capability 9.0)";
  for (Shape shape : {Shape{.B = 4, .T = 50, .H = 136, .V = 200}, Shape{.B = 2, .T = 300, .H = 64, .V = 384},
                      Shape{.B = 2, .T = 300, .H = 200, .V = 6152}, Shape{.B = 2, .T = 300, .H = 200, .V = 12288}}) {
    CaseSpec spec = spec_of(shape, 30.0, 35);
    spec.bias = shape.V % cuda::statistics_tile_columns != 0;
    spec.ignore = IgnorePattern::random;
    spec.hp.ignore_index = 7;  // inside [0, V): an ignored row must not gather column 7
    const Problem problem = generate(spec);
    const TensorMap exact = reference::compute(problem);
    reference::Options forward_ref;
    forward_ref.gradients = false;
    const TensorMap exact_forward = reference::compute(problem, forward_ref);
    for (const std::int64_t chunk_rows : {std::int64_t{0}, shape.T - 1}) {  // three_pass, two_pass
      for (const bool gradients : {true, false}) {
        for (const std::int64_t promotion_k : {std::int64_t{256}, std::int64_t{64}}) {
          SCOPED_TRACE(shape.to_string() + ", max_chunk_rows " + std::to_string(chunk_rows) +
                       (gradients ? ", gradients" : ", forward only") + ", promotion_k " + std::to_string(promotion_k));
          Options options = cuda_options();
          options.max_chunk_rows = chunk_rows;
          options.gradients = gradients;
          options.logits_k_slice = promotion_k;
          options.logit_distances = true;
          const cuda::StepPlan plan =
              cuda::plan_step(shape, DType::BF16, options, cuda::device_features(), gradients ? &bf16_outputs : nullptr);
          ASSERT_TRUE(plan.epilogue_statistics) << plan.to_string();
          const TensorMap out = cuda::compute(problem, options);
          expect_meets_bar(out, gradients ? exact : exact_forward, spec.logit_scale);
          Options fp32_logits = options;
          fp32_logits.logit_distances = false;
          const TensorMap other = gradients ? cuda::compute(problem, fp32_logits)
                                            : cuda::compute(problem, options, cuda::Tuning{.cublas_logits = true});
          if (gradients) {
            for (const char* name : {output_name::loss, output_name::nll_loss, output_name::chosen_logps,
                                     output_name::rejected_logps, output_name::chosen_logits_mean})
              for (std::int64_t i = 0; i < out.at(name).numel(); ++i)
                EXPECT_LE(std::abs(out.at(name).value(i) - other.at(name).value(i)),
                          1e-6 * (1 + std::abs(out.at(name).value(i)))) << name << "[" << i << "]";
          } else {
            expect_same_to_fp32_noise(out, other, &exact_forward);
          }
        }
      }
    }
  }
}

// ---- logit distances (Tuning::logit_distances) ----

std::vector<bf16> random_bf16(std::size_t n, double scale, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-scale, scale);
  std::vector<bf16> out(n);
  for (auto& v : out) v = bf16(static_cast<float>(u(rng)));
  return out;
}

// The statistics GEMMs against the plain promoted GEMM (the same mainloop, so the same logits, bit for bit), in
// each of their kernels (a bias or none; V = 1000, whose last tile has 40 columns, or V = 960, five whole tiles):
// every tile max is the max of the plain logits (bias added) over the tile's columns, every target logit is its
// plain logit, the forward's kernel and the distances' agree on all partials, every stored q is
// min(round((tile max - z) 2^11), 65535), and the columns past V are not written. 200 rows: a partial row tile;
// logits of spread ~30 leave many distances saturated. H = 520 (9 k tiles) at promotion every 256 and 512 k: a
// block of k tiles shorter and longer than the pipeline's stages.
TEST(CudaBackendFeatures, LogitDistancesAreTheLogitsBelowTheirTileMax) {
  SKIP_WITHOUT_DEVICE();
  if (!cuda::promoted_stats_available())
    GTEST_SKIP() << "the logit distances need the promoted GEMM (CUTLASS build, compute capability 9.0)";
  const std::int64_t rows = 200, H = 520, ld = 1008;
  std::mt19937_64 rng(61);
  const std::vector<bf16> x = random_bf16(rows * H, 1.0, rng), w = random_bf16(1000 * H, 3.0, rng),
                          bias = random_bf16(1000, 2.0, rng);
  auto upload = [](const void* data, std::size_t bytes, const char* what) {
    cuda::DeviceBuffer b(bytes, what);
    EXPECT_EQ(cudaMemcpy(b.get(), data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    return b;
  };
  auto download = [](const cuda::DeviceBuffer& b, auto* out) {
    EXPECT_EQ(cudaMemcpy(out, b.get(), b.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  };
  const cuda::DeviceBuffer x_d = upload(x.data(), x.size() * 2, "x"), w_d = upload(w.data(), w.size() * 2, "w"),
                           bias_d = upload(bias.data(), bias.size() * 2, "bias");
  for (const std::int64_t V : {1000, 960})
    for (const bool with_bias : {true, false})
      for (const std::int64_t promotion_k : {256, 512}) {
        SCOPED_TRACE("V = " + std::to_string(V) + (with_bias ? ", bias" : ", no bias") + ", promotion_k " +
                     std::to_string(promotion_k));
        const std::int64_t tiles = cuda::statistics_tiles(V);
        std::vector<std::int64_t> target(rows);
        for (std::int64_t r = 0; r < rows; ++r) target[r] = (r * 37) % V;
        const cuda::DeviceBuffer target_d = upload(target.data(), target.size() * 8, "target");
        struct Partials {
          cuda::DeviceBuffer max, sum_exp, sum, z_target;
          cuda::LogitTileStats stats;
        };
        auto partials = [&](const char* what) {
          Partials p{cuda::DeviceBuffer(tiles * rows * 4, what), cuda::DeviceBuffer(tiles * rows * 4, what),
                     cuda::DeviceBuffer(tiles * rows * 8, what), cuda::DeviceBuffer(rows * 4, what), {}};
          p.stats.bias = with_bias ? bias_d.as<__nv_bfloat16>() : nullptr;
          p.stats.target = target_d.as<std::int64_t>();
          p.stats.ld = rows;
          p.stats.tile_max = p.max.as<float>();
          p.stats.tile_sum_exp = p.sum_exp.as<float>();
          p.stats.tile_sum = p.sum.as<double>();
          p.stats.z_target = p.z_target.as<float>();
          return p;
        };
        Partials forward = partials("forward's partials"), with_distances = partials("distances' partials");
        cuda::DeviceBuffer logits_d(rows * ld * 4, "logits"), distances_d(rows * ld * 2, "distances");
        ASSERT_EQ(cudaMemset(distances_d.get(), 0x5A, distances_d.bytes()), cudaSuccess);  // columns past V keep it
        const auto* xp = x_d.as<__nv_bfloat16>();
        const auto* wp = w_d.as<__nv_bfloat16>();
        cuda::promoted_logits(rows, V, H, xp, wp, logits_d.as<float>(), ld, promotion_k, nullptr, nullptr, 0);
        cuda::promoted_logits_stats(rows, V, H, xp, wp, promotion_k, forward.stats, nullptr, nullptr, 0);
        cuda::promoted_logits_distances(rows, V, H, xp, wp, distances_d.as<std::uint16_t>(), ld, promotion_k,
                                        with_distances.stats, nullptr, nullptr, 0);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        std::vector<float> logits(rows * ld), tile_max(tiles * rows), tile_max_d(tiles * rows), z_target(rows);
        std::vector<std::uint16_t> q(rows * ld);
        download(logits_d, logits.data());
        download(distances_d, q.data());
        download(forward.max, tile_max.data());
        download(with_distances.max, tile_max_d.data());
        download(forward.z_target, z_target.data());
        EXPECT_EQ(tile_max, tile_max_d);
        for (const auto& [a, b] : {std::pair{&forward.sum_exp, &with_distances.sum_exp},
                                   std::pair{&forward.sum, &with_distances.sum},
                                   std::pair{&forward.z_target, &with_distances.z_target}}) {
          std::vector<char> ha(a->bytes()), hb(b->bytes());
          download(*a, ha.data());
          download(*b, hb.data());
          EXPECT_EQ(ha, hb) << "the forward's kernel and the distances' differ";
        }
        auto z_of = [&](std::int64_t r, std::int64_t v) {
          return logits[r * ld + v] + (with_bias ? float(bias[v]) : 0.0f);
        };
        int wrong_max = 0, wrong_target = 0, wrong = 0, saturated = 0, untouched_padding = 0;
        for (std::int64_t r = 0; r < rows; ++r) {
          for (std::int64_t t = 0; t < tiles; ++t) {
            float m = -INFINITY;
            for (std::int64_t v = t * cuda::statistics_tile_columns;
                 v < std::min(V, (t + 1) * cuda::statistics_tile_columns); ++v)
              m = std::max(m, z_of(r, v));
            wrong_max += tile_max[t * rows + r] != m;
          }
          wrong_target += z_target[r] != z_of(r, target[r]);
          for (std::int64_t v = 0; v < V; ++v) {
            const float m = tile_max[(v / cuda::statistics_tile_columns) * rows + r];
            const float expected = math::logit_distance(m, z_of(r, v));
            wrong += q[r * ld + v] != static_cast<std::uint16_t>(expected);
            saturated += expected == math::logit_distance_saturated;
          }
          for (std::int64_t v = V; v < ld; ++v) untouched_padding += q[r * ld + v] == 0x5A5A;
        }
        EXPECT_EQ(wrong_max, 0) << "tile maxima unlike the plain GEMM's, of " << rows * tiles;
        EXPECT_EQ(wrong_target, 0) << "target logits unlike the plain GEMM's, of " << rows;
        EXPECT_EQ(wrong, 0) << "of " << rows * V;
        EXPECT_GT(saturated, 0) << "the test should reach the saturation";
        EXPECT_EQ(untouched_padding, rows * (ld - V)) << "the store wrote past column V";
      }
}

// The runner with logit distances (the bar and the agreement with fp32 logits are the backend suite's
// LogitDistancesMeetTheBarAndAgreeWithFp32Logits, run on this backend too): it reports them, keeps 2 bytes per
// logit, and its partials share grad_x's bytes.
TEST(CudaBackendSchedules, LogitDistancesRunnerKeepsTwoBytesPerLogit) {
  SKIP_WITHOUT_DEVICE();
  if (!cuda::promoted_stats_available())
    GTEST_SKIP() << "the logit distances need the promoted GEMM (CUTLASS build, compute capability 9.0)";
  const Shape shape{.B = 4, .T = 64, .H = 96, .V = 304};
  const Problem problem = generate(spec_of(shape, 2.0, 63));
  cuda::FusedRunner runner;
  const cuda::DeviceInputs inputs = cuda::upload_inputs(problem, runner.stream());
  const std::int64_t N = shape.N(), H = shape.H, V = shape.V, ld_h = cuda::padded(H);
  cuda::DeviceBuffer grad_x(N * H * 2, "grad_x"), grad_w(V * H * 2, "grad_weight");
  cuda::DeviceGradients gradients;
  gradients.grad_x = grad_x.as<__nv_bfloat16>();
  gradients.grad_weight_16bit = grad_w.as<__nv_bfloat16>();
  Options options = cuda_options();
  options.logit_distances = true;
  runner.run(inputs.problem, &gradients, options);
  const auto& report = runner.last_report();
  EXPECT_TRUE(report.logit_distances());
  EXPECT_NE(report.to_string().find("16-bit logit distances"), std::string::npos) << report.to_string();
  EXPECT_EQ(report.schedule.chunks.size(), 1u) << report.to_string();
  const std::int64_t tiles = cuda::statistics_tiles(V);
  EXPECT_EQ(report.schedule.bytes_per_row, V * 2 + std::max(ld_h * 4, tiles * 12) + ld_h * 2 + tiles * 4);
}

// ---- grad_W as a bf16 hi/lo pair ----

// Half a bf16 unit in the last place at |e| (8 significant bits: 2^(floor(log2 |e|) - 8)).
double half_ulp_bf16(double e) { return e == 0 ? 0 : std::ldexp(1.0, std::ilogb(e) - 8); }

// The hi/lo GEMM (hilo_gemm.h) over four chunks (1 to 300 rows, dz with the runner's in-place stride, M and N
// multiples of 8 but not of a tile) against float64, element by element, with the error model of README.md:
// after each chunk hi + lo is s to within the accumulated bound
//   sum over chunks of  2^-16 |s_i|            (lo's own rounding: 2^-8 of a residual <= 2^-8 |s_i|)
//                     + K_i 2^-23 sum |dz x|   (the tensor cores' fp32 accumulation over the chunk's K_i rows)
//                     + 2^-22 (|s_i| + sum |dz x|)  (the epilogue's two fp32 additions)
// and hi is s rounded to nearest: within half a bf16 ulp of the exact sum plus that bound. hi and lo start as NaN:
// the first chunk must write them without reading. Then a fifth chunk as a step's last (PairOutput::hi): hi is the
// whole sum rounded to nearest as above, and lo is read but not written.
TEST(CudaBackendFeatures, HiLoWeightGemmCarriesSixteenBitsAndRoundsToNearest) {
  SKIP_WITHOUT_DEVICE();
  if (!cuda::hilo_gemm_available())
    GTEST_SKIP() << "the hi/lo weight GEMM needs a build with CUTLASS and a device of compute capability 9.0";
  const std::int64_t M = 264, N = 136, ld_dz = 2 * 272;
  const std::vector<std::int64_t> chunk_rows = {100, 1, 300, 37, 64};
  const double scales[] = {1.0, 0.5, 2.0, 0.01, 0.7};  // later chunks smaller and larger than the first
  const std::size_t finish = chunk_rows.size() - 1;
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  cuda::DeviceBuffer hi(M * N * 2, "hi"), lo(M * N * 2, "lo"), scratch(std::size_t{32} << 20, "scratch");
  {
    std::mt19937_64 rng(51);
    ASSERT_EQ(cudaMemset(hi.get(), 0xFF, hi.bytes()), cudaSuccess);  // 0xFFFF: a bf16 NaN
    ASSERT_EQ(cudaMemset(lo.get(), 0xFF, lo.bytes()), cudaSuccess);
    std::vector<double> exact(M * N, 0.0), bound(M * N, 0.0);
    std::vector<bf16> hi_h(M * N), lo_h(M * N), lo_before(M * N);
    auto check = [&](bool pair) {
      ASSERT_EQ(cudaMemcpy(hi_h.data(), hi.get(), hi.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(lo_h.data(), lo.get(), lo.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
      int pair_misses = 0, rounding_misses = 0, not_nearest = 0;
      for (std::int64_t i = 0; i < M * N; ++i) {
        const double h = float(hi_h[i]), l = float(lo_h[i]), e = exact[i], b = 1.01 * bound[i];
        pair_misses += !(std::abs(h + l - e) <= b);  // NaN counts as a miss
        rounding_misses += !(std::abs(h - e) <= half_ulp_bf16(std::abs(e) + b) + b);
        not_nearest += double(float(bf16(float(e)))) != h;
      }
      if (pair) EXPECT_EQ(pair_misses, 0) << "hi + lo outside the error model";
      EXPECT_EQ(rounding_misses, 0) << "hi not the nearest bf16 of the sum (to within the model)";
      // Most elements are nowhere near a rounding tie: hi is then exactly bf16(exact). (The model allows a flip
      // within ~2^-8 ulp of a tie per chunk: a fraction ~2^-5 here at the most; measured far below.)
      EXPECT_LE(not_nearest, M * N / 32);
    };
    for (std::size_t i = 0; i < chunk_rows.size(); ++i) {
      const std::int64_t K = chunk_rows[i];
      const std::vector<bf16> dz = random_bf16(K * ld_dz, scales[i], rng), x = random_bf16(K * N, 1.0, rng);
      cuda::DeviceBuffer dz_d(dz.size() * 2, "dz"), x_d(x.size() * 2, "x");
      ASSERT_EQ(cudaMemcpy(dz_d.get(), dz.data(), dz.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(x_d.get(), x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      if (i == finish) {
        SCOPED_TRACE("four chunks into the pair");
        check(/*pair=*/true);
        lo_before = lo_h;
      }
      cuda::hilo_accumulate_grad_weight(K, M, N, dz_d.as<__nv_bfloat16>(), ld_dz, x_d.as<__nv_bfloat16>(), N,
                                        hi.as<__nv_bfloat16>(), lo.as<__nv_bfloat16>(), N, /*overwrite=*/i == 0,
                                        cuda::Scale{}, stream, scratch.get(), scratch.bytes(),
                                        i == finish ? cuda::PairOutput::hi : cuda::PairOutput::hi_and_lo);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      for (std::int64_t m = 0; m < M; ++m)
        for (std::int64_t n = 0; n < N; ++n) {
          double sum = 0, abs_sum = 0;
          for (std::int64_t k = 0; k < K; ++k) {
            const double term = double(float(dz[k * ld_dz + m])) * double(float(x[k * N + n]));
            sum += term;
            abs_sum += std::abs(term);
          }
          double& e = exact[m * N + n];
          e += sum;
          bound[m * N + n] += std::ldexp(std::abs(e), -16) + K * std::ldexp(abs_sum, -23) +
                              std::ldexp(std::abs(e) + abs_sum, -22);
        }
    }
    SCOPED_TRACE("and a last chunk into hi alone");
    check(/*pair=*/false);
    EXPECT_EQ(std::memcmp(lo_h.data(), lo_before.data(), lo_h.size() * 2), 0) << "the last chunk wrote lo";
  }
  cudaStreamDestroy(stream);
}

// The full step with grad_W in the hi/lo pair (the default on sm_90 for a bf16 output) against the fp32 accumulator
// (an fp32 output, rounded to bf16 here): both meet the bar, and they agree to bf16 noise, in three_pass and
// two_pass, with a bias, random ignored rows, many rows per target (V = 44: ~20 rows share each target in a
// chunk, target_rows_kernel's sums), V % 8 != 0 (the last rows by hilo_tail), and a chunk of two parts.
TEST(CudaBackendFeatures, HiLoGradWeightMeetsTheBarAndAgreesWithTheFp32Accumulator) {
  SKIP_WITHOUT_DEVICE();
  if (!cuda::hilo_gemm_available())
    GTEST_SKIP() << "the hi/lo weight GEMM needs a build with CUTLASS and a device of compute capability 9.0";
  for (Shape shape : {Shape{.B = 4, .T = 100, .H = 96, .V = 44}, Shape{.B = 2, .T = 70, .H = 520, .V = 1001}}) {
    CaseSpec spec = spec_of(shape, 30.0, 52);
    spec.bias = true;
    spec.ignore = IgnorePattern::random;
    const Problem problem = generate(spec);
    const TensorMap exact = reference::compute(problem);
    for (const std::int64_t chunk_rows : {std::int64_t{0}, 2 * shape.T, shape.T - 1}) {
      SCOPED_TRACE(shape.to_string() + ", max_chunk_rows " + std::to_string(chunk_rows));
      Options options = cuda_options();
      options.max_chunk_rows = chunk_rows;
      ASSERT_EQ(cuda::plan_step(shape, DType::BF16, options, cuda::device_features(), &bf16_outputs).grad_weight,
                cuda::StepPlan::GradWeight::hilo) << "the default";
      const TensorMap out = cuda::compute(problem, options);
      expect_meets_bar(out, exact, spec.logit_scale);
      Options f32 = options;
      f32.grad_weight_f32 = true;
      TensorMap rounded = cuda::compute(problem, f32);
      for (const char* name : {output_name::grad_weight, output_name::grad_bias}) {
        const Tensor& t = rounded.at(name);
        std::vector<bf16> values(static_cast<std::size_t>(t.numel()));
        for (std::int64_t i = 0; i < t.numel(); ++i) values[static_cast<std::size_t>(i)] = bf16(static_cast<float>(t.value(i)));
        rounded[name] = Tensor::from<bf16>(t.shape, values);
      }
      expect_same_to_fp32_noise(out, rounded, &exact);
    }
  }
}

// The runner's memory with the hi/lo pair: no fp32 grad_W anywhere (the caller gives none), lo of V*H*2 bytes,
// no separate dz buffer (per row: fp32 logits + fp32 grad_x + gathered x), and the same grad_weight, bit for bit,
// as cuda::compute's (both deterministic: the target term is summed per target in chunk order, no atomics).
TEST(CudaBackendSchedules, HiLoRunnerKeepsNoFp32AccumulatorAndNoDzBuffer) {
  SKIP_WITHOUT_DEVICE();
  if (!cuda::hilo_gemm_available())
    GTEST_SKIP() << "the hi/lo weight GEMM needs a build with CUTLASS and a device of compute capability 9.0";
  const Problem problem = generate(spec_of({.B = 4, .T = 64, .H = 96, .V = 300}, 2.0, 53));
  const std::int64_t N = problem.shape.N(), H = problem.shape.H, V = problem.shape.V, ld_h = cuda::padded(H);
  cuda::FusedRunner runner;
  const cuda::DeviceInputs inputs = cuda::upload_inputs(problem, runner.stream());
  const cuda::DeviceProblem& device = inputs.problem;
  cuda::DeviceBuffer grad_x(N * H * 2, "grad_x"), grad_w(V * H * 2, "grad_weight");
  cuda::DeviceGradients gradients;
  gradients.grad_x = grad_x.as<__nv_bfloat16>();
  gradients.grad_weight_16bit = grad_w.as<__nv_bfloat16>();  // and no fp32 grad_weight
  Options options = cuda_options();
  options.max_chunk_rows = 128;  // two chunks of one pair each: the second accumulates
  runner.run(device, &gradients, options);
  const auto& report = runner.last_report();
  EXPECT_EQ(report.grad_weight, cuda::RunReport::GradWeight::hilo);
  EXPECT_EQ(report.accumulator_bytes, V * H * 2);
  EXPECT_EQ(report.schedule.chunks.size(), 2u);
  const std::int64_t ld_v = cuda::padded(V);
  EXPECT_EQ(report.schedule.bytes_per_row, ld_v * 4 + ld_h * 4 + ld_h * 2) << "a separate dz buffer came back";
  std::vector<bf16> from_runner(V * H);
  ASSERT_EQ(cudaMemcpy(from_runner.data(), grad_w.get(), grad_w.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  const TensorMap out = cuda::compute(problem, options);
  const auto expected = out.at(output_name::grad_weight).as<bf16>();
  ASSERT_EQ(expected.size(), from_runner.size());
  EXPECT_EQ(std::memcmp(expected.data(), from_runner.data(), from_runner.size() * 2), 0);
}

// The backend's declaration to the verifier (deterministic: verifier/implementation.cpp): the same inputs give the
// same bits, with a bias and many rows per target (V = 44: the target terms of grad_W and grad_bias sum many rows
// into one row), in both grad_weight forms (the hi/lo pair, the fp32 accumulator) and every schedule (the
// low-memory one's included).
TEST(CudaBackendFeatures, RerunsAreBitIdentical) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of({.B = 4, .T = 100, .H = 96, .V = 44}, 30.0, 59);
  spec.bias = true;
  spec.ignore = IgnorePattern::random;
  const Problem problem = generate(spec);
  // One chunk, chunks of T - 1 rows, and the low-memory schedule (where it runs), whose slices' target terms also
  // add per target in row order.
  struct Schedule {
    const char* what;
    std::int64_t max_chunk_rows;
    bool low_memory;
  };
  for (const bool f32 : {false, true})
    for (const Schedule& schedule : {Schedule{"one chunk", 0, false}, Schedule{"chunks", spec.shape.T - 1, false},
                                     Schedule{"low-memory schedule", 0, true}}) {
      if (schedule.low_memory && !cuda::promoted_stats_available()) continue;
      SCOPED_TRACE(std::string(f32 ? "fp32" : "bf16") + " grad_weight, " + schedule.what);
      Options options = cuda_options();
      options.grad_weight_f32 = f32;
      options.max_chunk_rows = schedule.max_chunk_rows;
      cuda::Tuning tuning;
      if (schedule.low_memory) {
        options.workspace_bytes = std::int64_t{1} << 20;
        tuning.low_memory = cuda::Tuning::LowMemory::always;
      }
      const TensorMap first = cuda::compute(problem, options, tuning);
      for (int run = 0; run < 3; ++run) {
        const TensorMap again = cuda::compute(problem, options, tuning);
        for (const auto& [name, t] : first) EXPECT_EQ(again.at(name).bytes, t.bytes) << name << ", rerun " << run;
      }
    }
}

// The rounding residues (DeviceCall::grad_*_lo) and scale_gradient_on_device, what the torch module's backward does
// with a grad_output s: T(s (hi + lo)) meets the bar against the reference at grad_scale s. For a power of two it is
// also the step run at s (dz = T(s k p) is then s T(k p), every sum scales exactly) but where hi + lo, 16 bits of
// the fp32 sum, lands on a tie; for other s the direct run rounds its dz at another scale, so the two differ by dz's
// rounding noise, each within the bar. bf16 (the hi/lo pair's lo is the caller's buffer) and f16 (an fp32
// accumulator rounded with its residue).
TEST(CudaBackendFeatures, ResiduesScaleGradientsWithOneRounding) {
  SKIP_WITHOUT_DEVICE();
  for (const DType dtype : {DType::BF16, DType::F16}) {
    CaseSpec spec = spec_of({.B = 4, .T = 64, .H = 96, .V = 304}, 2.0, 61);
    spec.bias = true;
    spec.dtype = dtype;
    const Problem problem = generate(spec);
    const Shape& s = problem.shape;
    const std::int64_t N = s.N(), H = s.H, V = s.V, e = static_cast<std::int64_t>(dtype_size(dtype));
    auto upload = [](const InputValues& v, const char* name) {
      return v.visit([&](const auto& values) {
        cuda::DeviceBuffer d(values.size() * sizeof(values[0]), name);
        EXPECT_EQ(cudaSuccess, cudaMemcpy(d.get(), values.data(), d.bytes(), cudaMemcpyHostToDevice));
        return d;
      });
    };
    const cuda::DeviceBuffer x = upload(problem.x, "x"), w = upload(problem.weight, "weight"),
                       b = upload(*problem.bias, "bias"), t(static_cast<std::size_t>(N * 8), "target");
    ASSERT_EQ(cudaSuccess, cudaMemcpy(t.get(), problem.target.data(), N * 8, cudaMemcpyHostToDevice));
    std::map<std::string, cuda::DeviceBuffer> hi, lo;
    const std::map<std::string, std::int64_t> sizes = {{output_name::grad_x, N * H},
                                                       {output_name::grad_weight, V * H},
                                                       {output_name::grad_bias, V}};
    for (const auto& [name, n] : sizes) {
      hi.emplace(name, cuda::DeviceBuffer(static_cast<std::size_t>(n * e), name.c_str()));
      lo.emplace(name, cuda::DeviceBuffer(static_cast<std::size_t>(n * e), name.c_str()));
    }
    auto at = [](const cuda::DeviceBuffer& d) { return reinterpret_cast<std::uintptr_t>(d.get()); };
    DeviceCall call;
    call.shape = s;
    call.hp = problem.hp;
    call.input_dtype = dtype;
    call.x = at(x), call.weight = at(w), call.bias = at(b), call.target = at(t);
    call.grad_x = at(hi.at(output_name::grad_x)), call.grad_weight = at(hi.at(output_name::grad_weight));
    call.grad_bias = at(hi.at(output_name::grad_bias));
    call.grad_x_lo = at(lo.at(output_name::grad_x)), call.grad_weight_lo = at(lo.at(output_name::grad_weight));
    call.grad_bias_lo = at(lo.at(output_name::grad_bias));
    call.options = cuda_options();
    compute_on_device(call);
    for (const double scale : {1.0 / 3.0, 0.25, 1e-4, -2.5, -2.0}) {
      SCOPED_TRACE(input_dtype_name(dtype) + ", grad_output " + std::to_string(scale));
      TensorMap scaled;
      for (const auto& [name, n] : sizes) {
        cuda::DeviceBuffer out(static_cast<std::size_t>(n * e), name.c_str());
        scale_gradient_on_device(dtype, at(hi.at(name)), at(lo.at(name)), n, scale, at(out), 0, 0);
        Tensor host(dtype, output_shape(s, name));
        ASSERT_EQ(cudaSuccess, cudaMemcpy(host.bytes.data(), out.get(), host.bytes.size(), cudaMemcpyDeviceToHost));
        scaled[name] = std::move(host);
      }
      Problem at_scale = problem;
      at_scale.hp.grad_scale = scale;
      TensorMap direct = cuda::compute(at_scale, cuda_options()), exact = reference::compute(at_scale, {});
      for (auto* m : {&direct, &exact})
        for (auto it = m->begin(); it != m->end();) it = is_gradient_output(it->first) ? std::next(it) : m->erase(it);
      expect_meets_bar(scaled, exact, spec.logit_scale, dtype);
      if (scale == 0.25 || scale == -2.0) expect_same_to_fp32_noise(scaled, direct, &exact);
    }
  }
}

// ---- the deferred weight finish (fused.h: DeviceCall::defer_weight_finish) ----

std::uintptr_t address(const cuda::DeviceBuffer& d) { return reinterpret_cast<std::uintptr_t>(d.get()); }

// A bf16 problem with a bias on the device, its gradient outputs (grad_x and grad_bias with their residues, as the
// torch module asks), and the DeviceCall over them.
struct DeviceStep {
  Problem problem;
  cuda::DeviceBuffer x, weight, bias, target, grad_x, grad_weight, grad_bias, grad_x_lo, grad_bias_lo, workspace;
  DeviceCall call;

  DeviceStep(const Problem& p, const Options& options) : problem(p) {
    const Shape& s = p.shape;
    const std::int64_t N = s.N(), H = s.H, V = s.V;
    auto upload = [](const void* data, std::int64_t bytes, const char* name) {
      cuda::DeviceBuffer d(static_cast<std::size_t>(bytes), name);
      EXPECT_EQ(cudaSuccess, cudaMemcpy(d.get(), data, d.bytes(), cudaMemcpyHostToDevice));
      return d;
    };
    x = upload(p.x.as<bf16>().data(), N * H * 2, "x");
    weight = upload(p.weight.as<bf16>().data(), V * H * 2, "weight");
    bias = upload(p.bias->as<bf16>().data(), V * 2, "bias");
    target = upload(p.target.data(), N * 8, "target");
    grad_x = cuda::DeviceBuffer(N * H * 2, "grad_x");
    grad_x_lo = cuda::DeviceBuffer(N * H * 2, "grad_x_lo");
    grad_weight = cuda::DeviceBuffer(V * H * 2, "grad_weight");
    grad_bias = cuda::DeviceBuffer(V * 2, "grad_bias");
    grad_bias_lo = cuda::DeviceBuffer(V * 2, "grad_bias_lo");
    call.shape = s;
    call.hp = p.hp;
    call.input_dtype = DType::BF16;
    call.x = address(x), call.weight = address(weight), call.bias = address(bias), call.target = address(target);
    call.grad_x = address(grad_x), call.grad_weight = address(grad_weight), call.grad_bias = address(grad_bias);
    call.grad_x_lo = address(grad_x_lo), call.grad_bias_lo = address(grad_bias_lo);
    call.options = options;
  }

  // The call, its gradient outputs poisoned with NaN first (every element must be written); `defer`: the last
  // weight GEMM deferred, in a workspace of this step's own sized by device_workspace.
  DeviceResult run(bool defer) {
    for (const cuda::DeviceBuffer* g : {&grad_x, &grad_weight, &grad_bias})
      EXPECT_EQ(cudaSuccess, cudaMemset(g->get(), 0xFF, g->bytes()));  // 0xFFFF: a bf16 NaN
    DeviceCall c = call;
    if (defer) {
      c.defer_weight_finish = true;
      const DeviceWorkspace need = device_workspace(c);
      EXPECT_TRUE(need.defers_weight_finish);
      workspace = cuda::DeviceBuffer(static_cast<std::size_t>(need.bytes), "the caller's workspace");
      c.workspace = address(workspace);
      c.workspace_size = need.bytes;
    }
    return compute_on_device(c);
  }

  // The gradients on the host; grad_x and grad_bias at grad_output `scale` from their residues
  // (scale_gradient_on_device, as the torch module's backward does), grad_weight as it stands.
  TensorMap gradients(double scale) const {
    const Shape& s = problem.shape;
    TensorMap out;
    auto download = [&](const std::string& name, const cuda::DeviceBuffer& hi, const cuda::DeviceBuffer* lo) {
      Tensor t(DType::BF16, output_shape(s, name));
      const void* from = hi.get();
      cuda::DeviceBuffer scaled;
      if (lo != nullptr && scale != 1.0) {
        scaled = cuda::DeviceBuffer(hi.bytes(), name);
        scale_gradient_on_device(DType::BF16, address(hi), address(*lo), t.numel(), scale, address(scaled), 0, 0);
        from = scaled.get();
      }
      EXPECT_EQ(cudaSuccess, cudaMemcpy(t.bytes.data(), from, t.bytes.size(), cudaMemcpyDeviceToHost));
      out[name] = std::move(t);
    };
    download(output_name::grad_x, grad_x, &grad_x_lo);
    download(output_name::grad_weight, grad_weight, nullptr);
    download(output_name::grad_bias, grad_bias, &grad_bias_lo);
    return out;
  }
};

Problem deferred_case(const Shape& shape, std::uint64_t seed) {
  CaseSpec spec = spec_of(shape, 2.0, seed);
  spec.bias = true;
  spec.ignore = IgnorePattern::random;
  return generate(spec);
}

// The shapes and chunkings the deferral meets: one chunk (the deferred GEMM is the first one too: it writes the pair
// without reading it), three_pass chunks of one pair each (x rows gathered), two_pass token chunks of 63 rows (x
// rows copied into the workspace, a last chunk of 4 rows); V % 8 == 0 (logit distances) and V = 300 (fp32 logits,
// the last 4 rows through hilo_tail_kernel); random ignored rows and a bias.
const Shape deferred_shapes[] = {{.B = 4, .T = 64, .H = 96, .V = 304}, {.B = 4, .T = 64, .H = 96, .V = 300}};
const std::int64_t deferred_chunk_rows[] = {0, 128, 63};

#define SKIP_WITHOUT_HILO()                                                                                    \
  do {                                                                                                          \
    SKIP_WITHOUT_DEVICE();                                                                                      \
    if (!cuda::hilo_gemm_available())                                                                           \
      GTEST_SKIP() << "the deferred weight finish needs the hi/lo weight GEMM (CUTLASS, compute capability 9.0)"; \
  } while (0)

// Deferred, then finished at grad_output 1: grad_weight, grad_x, grad_bias and the forward outputs are the whole
// step's, bit for bit (the same GEMM, tail and target-row kernels on the same operands, in the same order; the
// product by 1 is exact).
TEST(CudaBackendDeferredWeight, FinishAtOneIsTheWholeStepBitForBit) {
  SKIP_WITHOUT_HILO();
  for (const Shape& shape : deferred_shapes)
    for (const std::int64_t chunk_rows : deferred_chunk_rows) {
      SCOPED_TRACE(shape.to_string() + ", max_chunk_rows " + std::to_string(chunk_rows));
      Options options = cuda_options();
      options.max_chunk_rows = chunk_rows;
      DeviceStep step(deferred_case(shape, 71), options);
      const DeviceResult whole = step.run(false);
      EXPECT_FALSE(whole.pending.waiting());
      const TensorMap expected = step.gradients(1.0);
      const DeviceResult deferred = step.run(true);
      ASSERT_TRUE(deferred.pending.waiting()) << deferred.plan;
      EXPECT_NE(deferred.plan.find("deferred"), std::string::npos) << deferred.plan;
      EXPECT_EQ(deferred.workspace_bytes, 0) << "the call ran in the caller's workspace";
      EXPECT_EQ(deferred.extra_device_bytes, shape.V * 4) << "the fp32 grad_bias accumulator alone: lo of the pair "
                                                              "lives in the caller's workspace";
      finish_weight_gradient_on_device(deferred.pending, 1.0, 0);
      EXPECT_FALSE(deferred.pending.waiting());
      ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
      const TensorMap got = step.gradients(1.0);
      for (const auto& [name, t] : expected) EXPECT_EQ(got.at(name).bytes, t.bytes) << name;
      for (const auto& [name, t] : whole.forward) EXPECT_EQ(deferred.forward.at(name).bytes, t.bytes) << name;
    }
}

// Deferred, then finished at grad_output s, grad_x and grad_bias scaled from their residues: every output passes the
// verifier's strict profile against the reference at grad_scale s. For s = 0.25 (a power of two) the whole step run
// at grad_scale s scales every dz, sum and target term exactly, so its grad_weight is the finish's bit for bit (and
// grad_x, grad_bias agree to fp32 noise: hi + lo carries 16 bits of their fp32 sums); for other s the step's dz is
// rounded at another scale, a difference of dz's rounding noise (ResiduesScaleGradientsWithOneRounding).
TEST(CudaBackendDeferredWeight, FinishAtAScaleMeetsStrictAtThatGradScale) {
  SKIP_WITHOUT_HILO();
  for (const Shape& shape : deferred_shapes)
    for (const std::int64_t chunk_rows : deferred_chunk_rows) {
      Options options = cuda_options();
      options.max_chunk_rows = chunk_rows;
      const Problem problem = deferred_case(shape, 72);
      DeviceStep step(problem, options);
      for (const double scale : {1.0 / 3.0, 0.25, -1e-4}) {
        SCOPED_TRACE(shape.to_string() + ", max_chunk_rows " + std::to_string(chunk_rows) + ", grad_output " +
                     std::to_string(scale));
        const DeviceResult deferred = step.run(true);
        ASSERT_TRUE(deferred.pending.waiting()) << deferred.plan;
        finish_weight_gradient_on_device(deferred.pending, scale, 0);
        ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
        const TensorMap got = step.gradients(scale);
        Problem at_scale = problem;
        at_scale.hp.grad_scale = scale;
        const TensorMap exact = reference::compute(at_scale);
        TensorMap candidate = deferred.forward;
        for (const auto& [name, t] : got) candidate[name] = t;
        const verifier::Report report = verifier::compare(at_scale, exact, candidate, verifier::strict_profile());
        EXPECT_TRUE(report.passed()) << verifier::format_table(report);
        if (scale == 0.25) {
          DeviceStep direct(at_scale, options);
          direct.run(false);
          const TensorMap step_at_scale = direct.gradients(1.0);
          EXPECT_EQ(got.at(output_name::grad_weight).bytes, step_at_scale.at(output_name::grad_weight).bytes);
          expect_same_to_fp32_noise(got, step_at_scale, &exact);
        }
      }
    }
}

// Two calls deferred at once, each in its own workspace, an ordinary call of another problem between them and the
// finishes (the runner's own workspace and cuBLAS scratch back in use), then finished in reverse order: each is its
// own whole step, bit for bit. A pending GEMM runs once: a second finish is an InputError.
TEST(CudaBackendDeferredWeight, TwoPendingCallsFinishedInReverseOrder) {
  SKIP_WITHOUT_HILO();
  Options options = cuda_options();
  options.max_chunk_rows = 128;
  const Shape shape = deferred_shapes[0];
  DeviceStep a(deferred_case(shape, 73), options), b(deferred_case(shape, 74), options),
      between(deferred_case({.B = 2, .T = 100, .H = 96, .V = 304}, 75), options);
  a.run(false);
  const TensorMap expected_a = a.gradients(1.0);
  b.run(false);
  const TensorMap expected_b = b.gradients(1.0);
  const DeviceResult deferred_a = a.run(true), deferred_b = b.run(true);
  ASSERT_TRUE(deferred_a.pending.waiting() && deferred_b.pending.waiting());
  between.run(false);
  finish_weight_gradient_on_device(deferred_b.pending, 1.0, 0);
  finish_weight_gradient_on_device(deferred_a.pending, 1.0, 0);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  const TensorMap got_a = a.gradients(1.0), got_b = b.gradients(1.0);
  for (const auto& [name, t] : expected_a) EXPECT_EQ(got_a.at(name).bytes, t.bytes) << "a: " << name;
  for (const auto& [name, t] : expected_b) EXPECT_EQ(got_b.at(name).bytes, t.bytes) << "b: " << name;
  EXPECT_THROW(finish_weight_gradient_on_device(deferred_a.pending, 1.0, 0), InputError);
}

std::string input_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no InputError)";
}

// The scale on the device (DeviceScalar: autograd's grad_output, never read by the host) gives the host scale's bits:
// the finish's GEMM epilogue, tail and target rows read the same float, and grad_x and grad_bias scaled in place from
// their residues equal scale_gradient_on_device's new tensors (at 1 left as they are: the step's own rounding).
TEST(CudaBackendDeferredWeight, AScaleOnTheDeviceIsTheHostScale) {
  SKIP_WITHOUT_HILO();
  DeviceStep step(deferred_case(deferred_shapes[1], 77), cuda_options());
  const Shape& s = step.problem.shape;
  for (const float scale : {1.0f, 1.0f / 3.0f, -1e-4f}) {
    SCOPED_TRACE("grad_output " + std::to_string(scale));
    const DeviceResult host = step.run(true);
    finish_weight_gradient_on_device(host.pending, static_cast<double>(scale), 0);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    const TensorMap expected = step.gradients(scale);

    cuda::DeviceBuffer on_device(4, "grad_output");
    ASSERT_EQ(cudaSuccess, cudaMemcpy(on_device.get(), &scale, 4, cudaMemcpyHostToDevice));
    const DeviceScalar device_scale{address(on_device)};
    const DeviceResult device = step.run(true);
    finish_weight_gradient_on_device(device.pending, device_scale, 0);
    scale_gradient_on_device(DType::BF16, address(step.grad_x), address(step.grad_x_lo), s.N() * s.H, device_scale,
                             address(step.grad_x), 0, 0);
    scale_gradient_on_device(DType::BF16, address(step.grad_bias), address(step.grad_bias_lo), s.V, device_scale,
                             address(step.grad_bias), 0, 0);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    const TensorMap got = step.gradients(1.0);  // scaled already: downloaded as they are
    for (const auto& [name, t] : expected) EXPECT_EQ(got.at(name).bytes, t.bytes) << name;
  }
  EXPECT_NE(input_error_of([&] { finish_weight_gradient_on_device(step.run(true).pending, DeviceScalar{}, 0); })
                .find("float on the device"),
            std::string::npos);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
}

// Misuse is an InputError that says what to do; where the pair does not run (f16 inputs, an fp32 grad_weight)
// nothing is deferred and the call is the whole step.
TEST(CudaBackendDeferredWeight, MisuseIsAnInputErrorAndOtherPlansDeferNothing) {
  SKIP_WITHOUT_HILO();
  DeviceStep step(deferred_case(deferred_shapes[0], 76), cuda_options());
  EXPECT_NE(input_error_of([&] { finish_weight_gradient_on_device(PendingWeightGradient{}, 1.0, 0); })
                .find("nothing was deferred"),
            std::string::npos);
  DeviceCall no_workspace = step.call;
  no_workspace.defer_weight_finish = true;
  EXPECT_NE(input_error_of([&] { compute_on_device(no_workspace); }).find("needs DeviceCall::workspace"),
            std::string::npos);
  DeviceCall small = no_workspace;
  const DeviceWorkspace need = device_workspace(small);
  ASSERT_TRUE(need.defers_weight_finish);
  cuda::DeviceBuffer too_small(static_cast<std::size_t>(need.bytes / 2), "half a workspace");
  small.workspace = address(too_small);
  small.workspace_size = need.bytes / 2;
  EXPECT_NE(input_error_of([&] { compute_on_device(small); }).find("too small"), std::string::npos);
  const DeviceResult deferred = step.run(true);
  EXPECT_NE(input_error_of([&] { finish_weight_gradient_on_device(deferred.pending, INFINITY, 0); }).find("finite"),
            std::string::npos);
  EXPECT_TRUE(deferred.pending.waiting()) << "a refused scale leaves the GEMM waiting";
  finish_weight_gradient_on_device(deferred.pending, 1.0, 0);
  EXPECT_NE(input_error_of([&] { finish_weight_gradient_on_device(deferred.pending, 1.0, 0); })
                .find("finished already"),
            std::string::npos);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());

  DeviceCall f16 = step.call;
  f16.input_dtype = DType::F16;
  f16.defer_weight_finish = true;
  EXPECT_FALSE(device_workspace(f16).defers_weight_finish);
  DeviceCall f32_output = step.call;
  f32_output.options.grad_weight_f32 = true;
  f32_output.grad_x_lo = f32_output.grad_bias_lo = 0;
  EXPECT_FALSE(device_workspace(f32_output).defers_weight_finish);
  // The whole step in the caller's workspace, nothing pending.
  const DeviceWorkspace whole_need = device_workspace(f32_output);
  cuda::DeviceBuffer workspace(static_cast<std::size_t>(whole_need.bytes), "workspace"),
      grad_weight_f32(static_cast<std::size_t>(deferred_shapes[0].V * deferred_shapes[0].H * 4), "grad_weight"),
      grad_bias_f32(static_cast<std::size_t>(deferred_shapes[0].V * 4), "grad_bias");
  f32_output.grad_weight = address(grad_weight_f32);
  f32_output.grad_bias = address(grad_bias_f32);
  f32_output.defer_weight_finish = true;
  f32_output.workspace = address(workspace);
  f32_output.workspace_size = whole_need.bytes;
  const DeviceResult whole = compute_on_device(f32_output);
  EXPECT_FALSE(whole.pending.waiting()) << whole.plan;
  EXPECT_EQ(whole.plan.find("deferred"), std::string::npos) << whole.plan;
}

// ---- the host's part on the device (fused.h: DeviceCall::forward_on_device): validated, or asynchronous ----

// The eight forward outputs of a forward_on_device call, in device buffers of their own (problem.h's output order).
struct DeviceForwardOutputs {
  std::vector<std::string> names;
  std::vector<cuda::DeviceBuffer> buffers;

  explicit DeviceForwardOutputs(const Shape& s) {
    for (const std::string& name : all_output_names()) {
      if (is_gradient_output(name)) continue;
      std::int64_t n = 1;
      for (const std::int64_t d : output_shape(s, name)) n *= d;
      names.push_back(name);
      buffers.emplace_back(static_cast<std::size_t>(n * 4), name);
      EXPECT_EQ(cudaSuccess, cudaMemset(buffers.back().get(), 0, buffers.back().bytes()));
    }
  }
  void attach(DeviceCall& c) const {
    for (std::size_t i = 0; i < buffers.size(); ++i) c.forward_out[i] = address(buffers[i]);
  }
  std::map<std::string, std::vector<float>> download() const {
    std::map<std::string, std::vector<float>> out;
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      std::vector<float> v(buffers[i].bytes() / 4);
      EXPECT_EQ(cudaSuccess, cudaMemcpy(v.data(), buffers[i].get(), buffers[i].bytes(), cudaMemcpyDeviceToHost));
      out[names[i]] = std::move(v);
    }
    return out;
  }
};

// The same call with the host's part on the host (targets and forward outputs) and on the device, asynchronous
// (validate false) and validated (one synchronization at the end), on the deferral's shapes and chunkings, deferred
// or not, and through the low-memory schedule: the gradients bit for bit (the same kernels on the same n[b], and
// alpha / N_c is one IEEE division on either side), the forward outputs to the float rounding of doubles summed in
// another order (at most one ulp apart).
TEST(CudaBackendAsynchronous, OutputsAreTheSynchronousCalls) {
  SKIP_WITHOUT_HILO();
  struct Variant {
    std::int64_t chunk_rows;
    bool defer, low_memory;
  };
  const Variant variants[] = {{0, false, false}, {128, true, false}, {63, true, false}, {0, false, true}};
  for (const Shape& shape : deferred_shapes)
    for (const Variant& v : variants) {
      if (v.low_memory && shape.V % 8 != 0) continue;  // dz from the epilogue needs whole groups of 8 columns
      SCOPED_TRACE(shape.to_string() + ", max_chunk_rows " + std::to_string(v.chunk_rows) + (v.defer ? ", deferred" : "") +
                   (v.low_memory ? ", low-memory schedule" : ""));
      Options options = cuda_options();
      options.max_chunk_rows = v.chunk_rows;
      options.validate = false;
      Problem problem = deferred_case(shape, 81);
      problem.hp.compute_nll_loss = true;
      DeviceStep step(problem, options);
      const cuda::Tuning tuning{.low_memory = v.low_memory ? cuda::Tuning::LowMemory::always
                                                           : cuda::Tuning::LowMemory::automatic};
      auto run = [&](bool validate, const DeviceForwardOutputs* out) {
        for (const cuda::DeviceBuffer* g : {&step.grad_x, &step.grad_weight, &step.grad_bias})
          EXPECT_EQ(cudaSuccess, cudaMemset(g->get(), 0xFF, g->bytes()));
        DeviceCall c = step.call;
        cuda::DeviceBuffer workspace;
        if (v.defer) {
          c.defer_weight_finish = true;
          const DeviceWorkspace need = cuda::device_workspace(c, tuning);
          workspace = cuda::DeviceBuffer(static_cast<std::size_t>(need.bytes), "the caller's workspace");
          c.workspace = address(workspace);
          c.workspace_size = need.bytes;
        }
        c.options.validate = validate;
        c.forward_on_device = out != nullptr;
        if (out) out->attach(c);
        const DeviceResult r = cuda::compute_on_device(c, tuning);
        EXPECT_EQ(r.pending.waiting(), v.defer) << r.plan;
        if (v.low_memory) {
          EXPECT_NE(r.plan.find("low-memory"), std::string::npos) << r.plan;
        }
        if (r.pending.waiting()) finish_weight_gradient_on_device(r.pending, 1.0, 0);
        EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
        return std::make_pair(r, step.gradients(1.0));
      };
      const auto [sync, expected] = run(false, nullptr);
      for (const bool validate : {false, true}) {
        SCOPED_TRACE(validate ? "validated" : "asynchronous");
        const DeviceForwardOutputs out(shape);
        const auto [on_device, got] = run(validate, &out);
        EXPECT_TRUE(on_device.forward.empty()) << "a forward_on_device call's forward outputs are on the device";
        for (const auto& [name, t] : expected) EXPECT_EQ(got.at(name).bytes, t.bytes) << name;
        for (const auto& [name, values] : out.download()) {
          const auto host = sync.forward.at(name).as<float>();
          ASSERT_EQ(values.size(), host.size()) << name;
          for (std::size_t i = 0; i < host.size(); ++i)
            EXPECT_LE(std::abs(values[i] - host[i]), std::abs(host[i]) * 0x1p-23f + 1e-30f) << name << "[" << i << "]";
        }
      }
    }
}

// What SPEC makes an InputError is, asynchronously, NaN in every forward output, with no access outside the inputs
// (memcheck runs this test): a target past V, a negative target that is not ignore_index, an empty sequence under
// empty_sequence = error, no chosen completion token with the NLL term on. Validated, it is the host-side call's
// InputError, message for message. An empty sequence under empty_sequence = zero is valid: finite outputs equal to
// the host-side call's.
TEST(CudaBackendAsynchronous, InvalidTargetsMakeEveryForwardOutputNaN) {
  SKIP_WITHOUT_HILO();
  const Shape shape = deferred_shapes[0];
  const std::int64_t T = shape.T, P = shape.P();
  struct Case {
    std::string name;
    std::function<void(Problem&)> edit;
    bool valid;
  };
  const std::vector<Case> cases = {
      {"target = V", [&](Problem& p) { p.target[5] = shape.V; }, false},
      {"target = -7", [&](Problem& p) { p.target[T + 9] = -7; }, false},
      {"an empty sequence", [&](Problem& p) { std::fill_n(p.target.begin() + T, T, p.hp.ignore_index); }, false},
      {"an empty sequence, empty_sequence = zero",
       [&](Problem& p) {
         std::fill_n(p.target.begin() + T, T, p.hp.ignore_index);
         p.hp.empty_sequence = EmptySequence::zero;
       },
       true},
      {"no chosen completion token, the NLL term on",
       [&](Problem& p) {
         std::fill_n(p.target.begin(), P * T, p.hp.ignore_index);
         p.hp.empty_sequence = EmptySequence::zero;
         p.hp.compute_nll_loss = true;
         p.hp.alpha = 1.0;
       },
       false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Problem problem = deferred_case(shape, 82);
    c.edit(problem);
    Options options = cuda_options();
    options.validate = false;
    DeviceStep step(problem, options);
    DeviceCall call = step.call;
    call.forward_on_device = true;
    const DeviceForwardOutputs out(shape);
    out.attach(call);
    const DeviceResult r = compute_on_device(call);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    const auto got = out.download();
    DeviceCall validated = call;
    validated.options.validate = true;
    if (!c.valid) {
      const std::string host_error = input_error_of([&] { compute_on_device(step.call); });
      EXPECT_NE(host_error, "(no InputError)") << "SPEC's error, synchronously";
      EXPECT_EQ(input_error_of([&] { compute_on_device(validated); }), host_error) << "validated on the device";
      for (const auto& [name, values] : got)
        for (const float value : values) EXPECT_TRUE(std::isnan(value)) << name;
      continue;
    }
    const DeviceResult sync = compute_on_device(step.call);
    for (const auto& [name, values] : got)
      for (std::size_t i = 0; i < values.size(); ++i) {
        const float host = sync.forward.at(name).as<float>()[i];
        EXPECT_TRUE(std::isfinite(values[i])) << name;
        EXPECT_LE(std::abs(values[i] - host), std::abs(host) * 0x1p-23f + 1e-30f) << name << "[" << i << "]";
      }
  }
}

// A forward_on_device call the backend cannot make is refused with the reason: f16 inputs (their dz scale is planned
// from the targets on the host), missing output buffers.
TEST(CudaBackendAsynchronous, RefusedWhereTheHostMustLook) {
  SKIP_WITHOUT_DEVICE();
  DeviceStep step(deferred_case(deferred_shapes[0], 83), cuda_options());
  const DeviceForwardOutputs out(deferred_shapes[0]);
  DeviceCall call = step.call;
  call.forward_on_device = true;
  out.attach(call);
  for (const bool validate : {true, false}) {
    call.options.validate = validate;
    DeviceCall f16 = call;
    f16.input_dtype = DType::F16;
    EXPECT_NE(input_error_of([&] { compute_on_device(f16); }).find("f16"), std::string::npos);
    DeviceCall missing = call;
    missing.forward_out[3] = 0;
    EXPECT_NE(input_error_of([&] { compute_on_device(missing); }).find("forward_out"), std::string::npos);
  }
}

// SPEC's NaN/Inf rule on a validated forward_on_device call: the device's check of the row statistics sends the
// call to the scan, whose message names the first non-finite element as the host-side call's does (a NaN in x, in
// the weight, in the bias); finite inputs raise nothing.
TEST(CudaBackendAsynchronous, ValidatedCallsNameTheFirstNonFiniteInput) {
  SKIP_WITHOUT_DEVICE();
  const Shape shape = deferred_shapes[0];
  const Problem clean = deferred_case(shape, 84);
  struct Case {
    std::string expected;
    std::function<void(Problem&)> edit;
  };
  const std::vector<Case> cases = {
      {"non-finite input: x(1, 2, 3)", [&](Problem& p) { p.x.as<bf16>()[(shape.T + 2) * shape.H + 3] = bf16(NAN); }},
      {"non-finite input: weight(3, 2)", [&](Problem& p) { p.weight.as<bf16>()[3 * shape.H + 2] = bf16(INFINITY); }},
      {"non-finite input: bias(7)", [&](Problem& p) { p.bias->as<bf16>()[7] = bf16(NAN); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.expected);
    Problem problem = clean;
    c.edit(problem);
    DeviceStep step(problem, cuda_options());
    const DeviceForwardOutputs out(shape);
    DeviceCall validated = step.call;
    validated.forward_on_device = true;
    out.attach(validated);
    const std::string host_error = input_error_of([&] { compute_on_device(step.call); });
    EXPECT_NE(host_error.find(c.expected), std::string::npos) << host_error;
    EXPECT_EQ(input_error_of([&] { compute_on_device(validated); }), host_error);
  }
  DeviceStep step(clean, cuda_options());
  const DeviceForwardOutputs out(shape);
  DeviceCall validated = step.call;
  validated.forward_on_device = true;
  out.attach(validated);
  EXPECT_EQ(input_error_of([&] { compute_on_device(validated); }), "(no InputError)");
}

// ---- schedules and budgets ----

// Budgets from the 64 MiB minimum up, on a shape whose one pair (2T = 512 rows) needs ~147 MiB with fp32 logits and
// ~51 MiB with distances, plus the GEMM scratch: with fp32 logits 64 and 100 MiB run the low-memory schedule (sm_90)
// or the two_pass fallback, 200 MiB one pair per chunk, 1 GiB one chunk; with distances every budget holds a pair.
// All must meet the bar, and the runner must never allocate past the budget.
TEST(CudaBackendSchedules, WorkspaceBudgetsFromTheMinimumUp) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = spec_of({.B = 4, .T = 256, .H = 64, .V = 50000}, 2.0, 44);
  spec.hp.label_smoothing = 0.1;
  const Problem problem = generate(spec);
  const TensorMap exact = reference::compute(problem);
  for (const bool distances : {true, false})
    for (std::int64_t mib : {64, 100, 200, 1024}) {
      SCOPED_TRACE("workspace " + std::to_string(mib) + " MiB" + (distances ? ", distances" : ", fp32 logits"));
      Options options = cuda_options();
      options.workspace_bytes = mib << 20;
      options.logit_distances = distances;
      const TensorMap out = cuda::compute(problem, options);
      expect_meets_bar(out, exact, spec.logit_scale);
    }
}

TEST(CudaBackendSchedules, WorkspaceStaysInsideTheBudget) {
  SKIP_WITHOUT_DEVICE();
  const Problem problem = generate(spec_of({.B = 4, .T = 256, .H = 64, .V = 50000}, 2.0, 45));
  const std::int64_t N = problem.shape.N(), H = problem.shape.H, V = problem.shape.V, ld_h = cuda::padded(H);
  cuda::FusedRunner runner;
  const cuda::DeviceInputs inputs = cuda::upload_inputs(problem, runner.stream());
  const cuda::DeviceProblem& device = inputs.problem;
  cuda::DeviceBuffer grad_x(N * H * 2, "grad_x"), grad_w(V * ld_h * 4, "grad_weight");
  cuda::DeviceGradients gradients;
  gradients.grad_x = grad_x.as<__nv_bfloat16>();
  gradients.grad_weight = grad_w.as<float>();
  for (const bool distances : {true, false})
    for (std::int64_t mib : {64, 100, 200, 1024}) {
      for (bool with_gradients : {true, false}) {
        Options options = cuda_options();
        options.workspace_bytes = mib << 20;
        options.logit_distances = distances;
        runner.run(device, with_gradients ? &gradients : nullptr, options);
        const auto& report = runner.last_report();
        SCOPED_TRACE(std::to_string(mib) + " MiB: " + report.to_string());
        EXPECT_LE(report.workspace_bytes, options.workspace_bytes);
        EXPECT_EQ(report.gemm_fallbacks, 0) << "cuBLASLt refused a padded, 16-byte aligned GEMM";
        // One pair (512 rows) fits from 200 MiB with fp32 logits (~294 KiB a row), and from 64 MiB with distances
        // (~102 KiB). Below it, where the epilogue statistics run: the low-memory schedule (its statistics pass is
        // forward_only; the forward alone stores no logits either), else the two_pass fallback.
        const bool stats = cuda::promoted_stats_available();
        const bool pair_fits = mib >= 200 || (distances && stats);
        const bool low_memory = !pair_fits && stats;
        EXPECT_EQ(report.vocab_slice_columns > 0, with_gradients && low_memory);
        if (with_gradients) {
          EXPECT_EQ(report.schedule.mode, pair_fits ? Mode::three_pass : low_memory ? Mode::forward_only : Mode::two_pass);
        } else if (stats) {
          EXPECT_EQ(report.schedule.bytes_per_row, cuda::statistics_tiles(V) * 16) << "logits stored";
        }
      }
    }
}

// The statistics GEMM over a part's rows in launches (Tuning::statistics_launch_rows): a logit's k-sum does not depend
// on the launch it is in, so the step in launches of 64 rows is the step in one launch per part bit for bit: the
// forward's chunks, the low-memory schedule's statistics pass, and (unchanged) the full step.
TEST(CudaBackendSchedules, StatisticsInLaunchesOfFewRowsAreBitIdentical) {
  SKIP_WITHOUT_DEVICE();
  if (!cuda::promoted_stats_available())
    GTEST_SKIP() << "the promoted GEMM needs the CUTLASS build and compute capability 9.0";
  CaseSpec spec = spec_of({.B = 4, .T = 100, .H = 96, .V = 1000}, 30.0, 62);
  spec.bias = true;
  spec.ignore = IgnorePattern::random;
  const Problem problem = generate(spec);
  using LowMemory = cuda::Tuning::LowMemory;
  for (const LowMemory low_memory : {LowMemory::automatic, LowMemory::always})
    for (const bool gradients : {true, false}) {
      Options options = cuda_options();
      options.gradients = gradients;
      if (low_memory == LowMemory::always) options.workspace_bytes = std::int64_t{1} << 20;
      cuda::Tuning whole{.low_memory = low_memory, .statistics_launch_rows = 0}, in_launches = whole;
      in_launches.statistics_launch_rows = 64;
      const TensorMap one = cuda::compute(problem, options, whole), many = cuda::compute(problem, options, in_launches);
      SCOPED_TRACE(std::string(low_memory == LowMemory::always ? "low-memory" : "chunked") +
                   (gradients ? ", full step" : ", forward only"));
      ASSERT_EQ(one.size(), many.size());
      for (const auto& [name, t] : one) EXPECT_EQ(many.at(name).bytes, t.bytes) << name;
    }
}

// The low-memory schedule (Tuning::low_memory): statistics from the epilogue, then the backward a tile (a
// vocabulary slice by a block of rows) at a time, its dz from the recomputing GEMM's epilogue where V % 8 == 0
// (promoted_dz.h) and from dz_kernel over fp32 tile logits otherwise. With a 1 MiB budget: V = 1000 one slice of
// all 200 rows; V = 196 one slice (its statistics pass has a 4-column last tile; dz_kernel); N = 1200 rows of V =
// 6000 (epilogue dz) in 11 slices of 2 row blocks, and of V = 6004 (dz_kernel) in 16 slices of 3 (the last slice's
// last 4 columns through hilo_tail_kernel), the last block and slice partial, so grad_W accumulates over row blocks
// and grad_x over slices in both dz paths; with a bias (but V = 6000: the epilogue's kernel without one), random
// ignored rows, an ignore_index inside [0, V), label smoothing, and the grad_weight forms: bf16 (the hi/lo pair,
// lo the workspace's slice, or the caller's: then lo is hi's rounding residue) and fp32 (accumulated in place).
// Against the reference's bar, and against three_pass to fp32 noise.
TEST(CudaBackendSchedules, LowMemoryScheduleMeetsTheBarAndAgreesWithThreePass) {
  SKIP_WITHOUT_DEVICE();
  if (!cuda::promoted_stats_available())
    GTEST_SKIP() << "the low-memory schedule needs the epilogue statistics (CUTLASS build, compute capability 9.0)";
  for (Shape shape : {Shape{.B = 4, .T = 50, .H = 136, .V = 1000}, Shape{.B = 2, .T = 70, .H = 64, .V = 196},
                      Shape{.B = 4, .T = 300, .H = 64, .V = 6000}, Shape{.B = 4, .T = 300, .H = 64, .V = 6004}}) {
    CaseSpec spec = spec_of(shape, 30.0, 36);
    spec.bias = shape.V != 6000;
    spec.ignore = IgnorePattern::random;
    spec.hp.ignore_index = 7;
    spec.hp.label_smoothing = 0.1;
    const Problem problem = generate(spec);
    const TensorMap exact = reference::compute(problem);
    for (const bool f32 : {false, true}) {
      SCOPED_TRACE(shape.to_string() + (f32 ? ", fp32 grad_weight" : ", bf16 grad_weight"));
      Options options = cuda_options();
      options.grad_weight_f32 = f32;
      const TensorMap three_pass = cuda::compute(problem, options);
      options.workspace_bytes = std::int64_t{1} << 20;
      const cuda::Tuning tuning{.low_memory = cuda::Tuning::LowMemory::always};
      const TensorMap out = cuda::compute(problem, options, tuning);
      expect_meets_bar(out, exact, spec.logit_scale);
      expect_same_to_fp32_noise(out, three_pass, &exact);

      cuda::FusedRunner runner;
      const cuda::DeviceInputs inputs = cuda::upload_inputs(problem, runner.stream());
      const std::int64_t N = shape.N(), ld_h = cuda::padded(shape.H);
      // The runner with the grad_weight form cuda::compute chose above: its report shows the tile shape that ran.
      cuda::DeviceBuffer grad_x(N * shape.H * 2, "grad_x"),
          grad_w(shape.V * (f32 ? ld_h * 4 : shape.H * 2), "grad_weight"), grad_b(shape.V * 4, "grad_bias");
      cuda::DeviceGradients gradients;
      gradients.grad_x = grad_x.as<__nv_bfloat16>();
      if (f32) gradients.grad_weight = grad_w.as<float>();
      else gradients.grad_weight_16bit = grad_w.as<__nv_bfloat16>();
      gradients.grad_bias = grad_b.as<float>();
      runner.run(inputs.problem, &gradients, options, tuning);
      const cuda::RunReport& report = runner.last_report();
      SCOPED_TRACE(report.to_string());
      const std::int64_t C = report.vocab_slice_columns;
      ASSERT_GT(C, 0);
      EXPECT_EQ(C % 192, 0);
      EXPECT_EQ(report.vocab_slices, (shape.V + C - 1) / C);
      const std::int64_t R = report.block_rows;
      ASSERT_GT(R, 0);
      EXPECT_TRUE(R == N || R % 128 == 0) << "row blocks are whole M tiles of the GEMM, or all rows";
      EXPECT_EQ(report.row_blocks, (N + R - 1) / R);
      // The shapes the comment above promises (the tile's cost model, plan.cpp's backward_tile).
      const std::map<std::int64_t, std::pair<std::int64_t, std::int64_t>> slices_blocks{
          {1000, {1, 1}}, {196, {1, 1}}, {6000, {11, 2}}, {6004, {16, 3}}};
      EXPECT_EQ(report.vocab_slices, slices_blocks.at(shape.V).first);
      EXPECT_EQ(report.row_blocks, slices_blocks.at(shape.V).second);
      EXPECT_EQ(report.grad_weight,
                f32 ? cuda::RunReport::GradWeight::sliced : cuda::RunReport::GradWeight::sliced_hilo);
      EXPECT_EQ(report.accumulator_bytes, N * ld_h * 4);
      EXPECT_LE(report.workspace_bytes, options.workspace_bytes);
      if (f32) continue;
      // The caller's lo (DeviceCall::grad_weight_lo): the pair's lo is the output, each element hi's rounding
      // residue (|lo| at most half an ulp of hi: 2^-8 |hi|), and hi meets the bar.
      cuda::DeviceBuffer lo(shape.V * shape.H * 2, "grad_weight_lo");
      gradients.grad_weight_lo = lo.as<__nv_bfloat16>();
      runner.run(inputs.problem, &gradients, options, tuning);
      EXPECT_EQ(runner.last_report().grad_weight, cuda::RunReport::GradWeight::sliced_hilo);
      std::vector<bf16> hi(shape.V * shape.H), residue(shape.V * shape.H);
      ASSERT_EQ(cudaMemcpy(hi.data(), grad_w.get(), hi.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(residue.data(), lo.get(), residue.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      std::size_t nonzero = 0;
      for (std::size_t i = 0; i < hi.size(); ++i) {
        const double h = static_cast<float>(hi[i]), l = static_cast<float>(residue[i]);
        nonzero += l != 0.0;
        ASSERT_LE(std::abs(l), half_ulp_bf16(std::abs(h))) << "grad_weight[" << i << "]: hi " << h << ", lo " << l;
      }
      EXPECT_GT(nonzero, hi.size() / 2) << "lo carries the sums' lower bits";
      TensorMap with_lo = out;
      with_lo.at(output_name::grad_weight) =
          Tensor::from<bf16>(out.at(output_name::grad_weight).shape, std::span<const bf16>(hi));
      expect_meets_bar(with_lo, exact, spec.logit_scale);
    }
  }
}

// ---- errors and dispatch ----

TEST(CudaBackendErrors, OutOfDeviceMemoryIsAnInputErrorNamingTheBytes) {
  SKIP_WITHOUT_DEVICE();
  try {
    cuda::DeviceBuffer huge(std::size_t{1} << 50, "a test buffer");  // 1 PiB
    FAIL() << "a 1 PiB allocation succeeded";
  } catch (const InputError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(std::to_string(std::size_t{1} << 50)), std::string::npos) << message;
    EXPECT_NE(message.find("a test buffer"), std::string::npos) << message;
  }
  // The failed allocation must leave the device usable.
  check_case(spec_of({.B = 2, .T = 8, .H = 16, .V = 40}, 2.0, 46), cuda_options());
}

// The device's NaN/Inf scan reads inputs at any element offset (a torch slice such as weight[1:]): the unaligned
// head element by element, the 16-byte aligned middle by vectors, the tail element by element; each names the lowest
// non-finite index, as validate() does.
TEST(CudaBackendErrors, NonFiniteScanOfAnUnalignedInputNamesTheFirstOne) {
  SKIP_WITHOUT_DEVICE();
  const Shape shape{.B = 2, .T = 16, .H = 40, .V = 64};
  const std::int64_t n = shape.V * shape.H;
  Options options = cuda_options();
  options.gradients = false;
  DeviceStep step(deferred_case(shape, 53), options);
  const auto& clean = step.problem.weight.as<bf16>();
  for (const std::int64_t offset : {1, 3, 7}) {
    // (row, column) -> the message's index; head, middle and tail positions, the earliest of two in one vector
    for (const std::vector<std::int64_t>& poisoned :
         std::vector<std::vector<std::int64_t>>{{0}, {7 - offset}, {1000, 1002}, {1003, 1001}, {n - 1}}) {
      std::vector<bf16> w(clean.begin(), clean.end());
      for (const std::int64_t i : poisoned) w[static_cast<std::size_t>(i)] = bf16(NAN);
      cuda::DeviceBuffer shifted(static_cast<std::size_t>((n + offset) * 2), "a shifted weight");
      ASSERT_EQ(cudaSuccess, cudaMemcpy(static_cast<bf16*>(shifted.get()) + offset, w.data(), n * 2,
                                        cudaMemcpyHostToDevice));
      DeviceCall c = step.call;
      c.weight = address(shifted) + offset * 2;
      const std::int64_t first = *std::min_element(poisoned.begin(), poisoned.end());
      const std::string expected = "non-finite input: weight(" + std::to_string(first / shape.H) + ", " +
                                   std::to_string(first % shape.H) + ")";
      try {
        compute_on_device(c);
        ADD_FAILURE() << "no InputError at offset " << offset << " for " << expected;
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << "offset " << offset << ": " << e.what();
      }
    }
  }
}

TEST(CudaBackendDispatch, FusedComputePicksTheCudaBackend) {
  SKIP_WITHOUT_DEVICE();
  EXPECT_EQ(resolve(Backend::automatic), Backend::cuda);
  const Problem problem = generate(spec_of({.B = 2, .T = 8, .H = 16, .V = 40}, 2.0, 49));
  expect_same_to_fp32_noise(compute(problem, cuda_options()), cuda::compute(problem, cuda_options()));
}

// ---- a runner per thread, stream-ordered memory ----

// cuda::compute keeps one runner per thread (stream, cuBLAS handles) and allocates on its stream from a pool
// (device_buffer.h): calls of every size in turn, from several threads at once, must compute what one fresh
// call computes. A free ordered before the work that still reads the buffer, or a GEMM left pointing at an
// old workspace, would show here as outputs far past fp32 noise.
TEST(CudaBackendRunners, ConcurrentCallsOfEverySizeAgreeWithSequentialOnes) {
  SKIP_WITHOUT_DEVICE();
  std::vector<Problem> problems;
  for (Shape shape : {Shape{.B = 2, .T = 8, .H = 16, .V = 40}, feature_shape, Shape{.B = 2, .T = 33, .H = 200, .V = 1001},
                      Shape{.B = 6, .T = 5, .H = 31, .V = 77}}) {
    CaseSpec spec = spec_of(shape, 30.0, 60 + problems.size());
    spec.bias = problems.size() % 2 == 1;
    problems.push_back(generate(spec));
  }
  std::vector<TensorMap> sequential;
  for (const Problem& problem : problems) sequential.push_back(cuda::compute(problem, cuda_options()));

  constexpr int threads = 6, rounds = 3;
  std::vector<std::vector<TensorMap>> concurrent(threads);
  std::vector<std::string> errors(threads);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t)
    workers.emplace_back([&, t] {
      try {
        for (int i = 0; i < rounds * static_cast<int>(problems.size()); ++i)
          concurrent[t].push_back(cuda::compute(problems[(t + i) % problems.size()], cuda_options()));
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  for (std::thread& worker : workers) worker.join();
  for (int t = 0; t < threads; ++t) {
    ASSERT_EQ(errors[t], "") << "thread " << t;
    for (std::size_t i = 0; i < concurrent[t].size(); ++i) {
      SCOPED_TRACE("thread " + std::to_string(t) + ", call " + std::to_string(i));
      expect_same_to_fp32_noise(concurrent[t][i], sequential[(t + i) % problems.size()]);
    }
  }
}

// The runner's buffers come from the device's default pool, whose release threshold it raises to keep freed
// memory between calls; the pool is the whole process's, so a higher threshold set by someone else (torch's
// cudaMallocAsync allocator keeps more) must survive. (ctest runs each test in its own process, so the runner
// meets the pool here for the first time.)
TEST(CudaBackendRunners, ThePoolReleaseThresholdIsRaisedNeverLowered) {
  SKIP_WITHOUT_DEVICE();
  cudaMemPool_t pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
  std::uint64_t before = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &before), cudaSuccess);
  std::uint64_t threshold = std::uint64_t{16} << 30;
  ASSERT_GT(threshold, cuda::pool_retained_bytes);
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold), cudaSuccess);
  cuda::compute(generate(spec_of(feature_shape, 2.0, 71)), cuda_options());
  std::uint64_t after = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &after), cudaSuccess);
  // The pool back as it was, for the tests after this one in the same process.
  cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &before);
  EXPECT_EQ(after, threshold);
}

}  // namespace
}  // namespace simpo::fused
