// reference-cuda against the CPU reference: the same function in float64, so the two differ by rounding alone.
//
// The bound, 1e-12 relative. Both evaluate every logit as a sum of H products in float64 (in different orders:
// OpenBLAS's blocking, cuBLAS's DMMA tiles), every log-sum-exp as a sum of V exponentials, with elementary
// functions within 1-2 ulp (glibc, CUDA's libdevice). The differences are the rounding of those sums: at most
// ~(H + V) eps relative to the sums' magnitudes in the worst case, ~sqrt(H + V) eps in practice; for the sizes here
// (H, V <= 1001) that is ~5e-15 typically and 2e-13 at worst, so 1e-12 holds with a margin and any real
// difference (a float32 step is 6e-8) fails it. Scales: tensors normwise (max |a - b| / max |b|); the logits means,
// which can cancel to nearly zero, against the mean |logit| their rounding scales with.
#include "problem/generate.h"
#include "problem/problem_io.h"
#include "reference/reference.h"
#include "reference/tests/tensor_compare.h"
#include "reference/tests/test_problems.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

namespace simpo::reference {
namespace {

using testing::case_spec;
using testing::hyperparameters;
using testing::normwise_error;

constexpr double kAgreement = 1e-12;
double largest_disagreement = 0;  // over every test of this binary, printed at the end

double mean_abs_logit(const Problem& p) {
  const Shape& s = p.shape;
  double total = 0;
  for (std::int64_t r = 0; r < s.N(); ++r)
    for (std::int64_t v = 0; v < s.V; ++v) {
      double z = p.bias ? p.bias->value(v) : 0.0;
      for (std::int64_t h = 0; h < s.H; ++h)
        z += p.x.value(r * s.H + h) * p.weight.value(v * s.H + h);
      total += std::abs(z);
    }
  return total / static_cast<double>(s.N() * s.V);
}

// The largest relative disagreement over every output, with the tensor it is in.
std::pair<double, std::string> disagreement(const Problem& p, const TensorMap& gpu, const TensorMap& cpu) {
  std::pair<double, std::string> worst{0.0, ""};
  if (gpu.size() != cpu.size()) return {INFINITY, "the set of outputs"};
  const double logit_scale = mean_abs_logit(p);
  for (const auto& [name, tensor] : cpu) {
    if (!gpu.count(name) || gpu.at(name).shape != tensor.shape || gpu.at(name).dtype != tensor.dtype) return {INFINITY, name};
    const std::vector<double> a = gpu.at(name).to_double(), b = tensor.to_double();
    double error = normwise_error(a, b);
    if (name == "chosen_logits_mean" || name == "rejected_logits_mean")
      error = std::abs(a[0] - b[0]) / std::max(std::abs(b[0]), logit_scale);
    if (!(error <= worst.first)) worst = {error, name};
  }
  return worst;
}

void expect_agreement(const Problem& p, const Options& options, const std::string& what) {
  Options cpu = options, gpu = options;
  cpu.device = Device::cpu;
  gpu.device = Device::cuda;
  OffTargetSoftmax cpu_off, gpu_off;  // the error model's by-product, too
  cpu.off_target = &cpu_off;
  gpu.off_target = &gpu_off;
  auto [error, name] = disagreement(p, compute(p, gpu), compute(p, cpu));
  if (options.gradients) {
    for (const auto& [part, a, b] : {std::tuple{"off-target softmax norm", &gpu_off.norm, &cpu_off.norm},
                                     std::tuple{"off-target softmax max", &gpu_off.max, &cpu_off.max}}) {
      const double e = a->size() == b->size() && !b->empty() ? normwise_error(*a, *b) : INFINITY;
      if (!(e <= error)) error = e, name = part;
    }
  }
  largest_disagreement = std::max(largest_disagreement, error);
  EXPECT_LE(error, kAgreement) << what << ": " << name << " differs by " << error;
  std::printf("[ %s ] largest disagreement %.3g (%s)\n", what.c_str(), error, name.c_str());
}

std::filesystem::path fixtures_directory() {
  // The device machine runs a copy of the tree elsewhere: SIMPO_FIXTURES_DIR points at its fixtures/cases.
  if (const char* dir = std::getenv("SIMPO_FIXTURES_DIR")) return dir;
  return SIMPO_FIXTURES_CASES_DIR;
}

TEST(CudaAgreesWithCpu, EveryCommittedFixture) {
  int cases = 0;
  for (const auto& entry : std::filesystem::directory_iterator(fixtures_directory())) {
    const std::string file = entry.path().filename().string();
    const std::string suffix = ".inputs.safetensors";
    if (file.size() <= suffix.size() || file.compare(file.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const Problem p = load_problem(entry.path().string());
    expect_agreement(p, {}, file.substr(0, file.size() - suffix.size()));
    ++cases;
  }
  EXPECT_GE(cases, 10) << "fixtures in " << fixtures_directory();
}

// Random shapes (odd H and V, T = 1, one pair and several), every hyperparameter drawn, every ignore pattern, bias or
// not, each with both schedules (whole pairs, and pairs split with the logits recomputed) and loss-only.
TEST(CudaAgreesWithCpu, RandomSweepOfShapesAndHyperparameters) {
  Rng rng(20261203);
  const std::vector<std::int64_t> Bs{2, 4, 6}, Ts{1, 2, 5, 17}, Hs{1, 3, 33, 67, 130}, Vs{2, 7, 64, 301, 1001};
  const std::vector<IgnorePattern> patterns{IgnorePattern::none, IgnorePattern::random, IgnorePattern::prompt_prefix,
                                            IgnorePattern::all_but_one, IgnorePattern::empty_sequence};
  for (int i = 0; i < 40; ++i) {
    const Shape shape{Bs[rng.below(3)], Ts[rng.below(4)], Hs[rng.below(5)], Vs[rng.below(5)]};
    const IgnorePattern ignore = patterns[rng.below(5)];
    Hyperparameters hp = hyperparameters(0.01 + 4 * rng.uniform(), -1 + 3 * rng.uniform(), rng.below(3) * 0.5,
                                         0.5 * rng.uniform(), -3 + 6 * rng.uniform(), rng.below(4) != 0);
    if (ignore == IgnorePattern::empty_sequence) {
      hp.empty_sequence = EmptySequence::zero;
      hp.alpha = 0;  // the empty sequence may leave no chosen token
    }
    if (rng.below(4) == 0) hp.ignore_index = rng.below(shape.V);  // an ignore_index inside the vocabulary
    const Problem p = generate(case_spec(shape, rng.below(2) == 1, ignore, 0.5 + 12 * rng.uniform(), 1000 + i, hp));
    Options options;
    options.chunk_rows = std::vector<std::int64_t>{0, 1, 2 * shape.T, shape.T + 1}[rng.below(4)];
    options.gradients = rng.below(5) != 0;
    char what[160];
    std::snprintf(what, sizeof what, "sweep %d: %s, %s, chunk_rows %lld%s", i, shape.to_string().c_str(),
                  ignore_pattern_name(ignore).c_str(), static_cast<long long>(options.chunk_rows), options.gradients ? "" : ", loss only");
    expect_agreement(p, options, what);
  }
}

// Near the published workload's widths on a few rows: K = 4096 sums through the GEMMs, rows of 32003 logits through
// the row kernels (the generator's cost, single-threaded, keeps V below 128256 here).
TEST(CudaAgreesWithCpu, PublishedWidths) {
  Hyperparameters hp = hyperparameters(0.1, 0.5, 1.0, 0.1, 1.0);
  const Problem p = generate(case_spec({2, 3, 4096, 32003}, true, IgnorePattern::random, 2.0, 77, hp));
  expect_agreement(p, {}, "B=2 T=3 H=4096 V=32003, bias");
}

// Printed for the README: the largest disagreement this binary saw.
class ReportLargest : public ::testing::Environment {
 public:
  void TearDown() override {
    if (largest_disagreement > 0) std::printf("largest disagreement between reference-cuda and the CPU reference: %.3g\n", largest_disagreement);
  }
};
const auto* report = ::testing::AddGlobalTestEnvironment(new ReportLargest);

}  // namespace
}  // namespace simpo::reference
