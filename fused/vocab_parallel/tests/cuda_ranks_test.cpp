// The vocab-parallel step's cuda ranks (cuda_ranks.cu) against the float64 reference under the strict profile:
// G = 1, 2, 3 ranks on one GPU through the in-process collectives (V not divisible by G), across the features and
// both chunk schedules; every rank's replicated outputs bit-identical; NCCL with G = 1 against the in-process
// G = 1. Labelled gpu: each test skips, saying why, where no CUDA device is present.
#include "fused/vocab_parallel/vocab_parallel.h"
#include "fused/vocab_parallel/tests/shard_cases.h"
#include "problem/generate.h"
#include "reference/reference.h"
#include "verifier/error_model.h"

#include <gtest/gtest.h>

#include <string>

namespace {

using namespace simpo;
namespace vp = simpo::fused::vocab_parallel;
using namespace vp::shard_cases;

#define SKIP_WITHOUT_DEVICE()                                                                        \
  do {                                                                                               \
    if (!fused::cuda_available()) GTEST_SKIP() << "no CUDA device here: the cuda ranks are not run"; \
  } while (0)

// The in-process ranks, gathered (gather refuses ranks whose replicated outputs differ in a bit).
TensorMap in_process(const Problem& problem, const fused::Options& options, int shards) {
  return vp::gather(vp::compute_ranks_cuda(problem, options, shards, vp::Communication::in_process));
}

// The shared features, and one at tensor-core size: H not a multiple of 8 (padded rows), shards of 1367/1366
// columns (the promoted GEMM's groups of 4 and its cuBLAS tail), two three_pass chunks.
const std::vector<Feature>& cuda_features() {
  static const std::vector<Feature> all = [] {
    std::vector<Feature> f = features();
    f.push_back({"mid_size_bias_chunks", [](CaseSpec& s, fused::Options& o) {
                   s.shape = {4, 48, 260, 4099};
                   s.bias = true;
                   o.max_chunk_rows = 96;
                 }});
    return f;
  }();
  return all;
}

class CudaVocabShards : public ::testing::TestWithParam<int> {};

TEST_P(CudaVocabShards, AgreesWithTheReferenceUnderStrict) {
  SKIP_WITHOUT_DEVICE();
  std::uint64_t seed = 200;
  for (const Feature& f : cuda_features()) {
    SCOPED_TRACE(f.name);
    CaseSpec spec = small_case(seed++);
    fused::Options options;
    f.apply(spec, options);
    const Problem problem = generate(spec);
    expect_strict_pass(problem, in_process(problem, options, GetParam()));
  }
}

TEST_P(CudaVocabShards, ForwardOnlyAndF32Gradients) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = small_case(17);
  spec.bias = true;
  const Problem problem = generate(spec);
  fused::Options forward;
  forward.gradients = false;
  expect_strict_pass(problem, in_process(problem, forward, GetParam()), false);
  fused::Options f32;
  f32.grad_weight_f32 = true;
  const TensorMap out = in_process(problem, f32, GetParam());
  EXPECT_EQ(out.at("grad_weight").dtype, DType::F32);
  EXPECT_EQ(out.at("grad_bias").dtype, DType::F32);
  expect_strict_pass(problem, out);
}

// Every rank ends with the same bits of the replicated outputs, and its own shard of grad_weight/grad_bias.
TEST_P(CudaVocabShards, ReplicatedOutputsAreBitIdenticalAcrossRanks) {
  SKIP_WITHOUT_DEVICE();
  CaseSpec spec = small_case(19);
  spec.bias = true;
  const Problem problem = generate(spec);
  const auto ranks = vp::compute_ranks_cuda(problem, {}, GetParam(), vp::Communication::in_process);
  ASSERT_EQ(ranks.size(), static_cast<std::size_t>(GetParam()));
  std::int64_t rows = 0;
  for (const auto& r : ranks) {
    EXPECT_EQ(r.shard.begin, rows);
    EXPECT_EQ(r.outputs.at("grad_weight").shape, (std::vector<std::int64_t>{r.shard.size(), spec.shape.H}));
    EXPECT_EQ(r.outputs.at("grad_bias").shape, (std::vector<std::int64_t>{r.shard.size()}));
    for (const auto& [name, t] : ranks[0].outputs) {
      if (name == "grad_weight" || name == "grad_bias") continue;
      EXPECT_EQ(r.outputs.at(name).bytes, t.bytes) << name << " of rank " << r.shard.begin;
    }
    rows += r.shard.size();
  }
  EXPECT_EQ(rows, spec.shape.V);
}

INSTANTIATE_TEST_SUITE_P(G, CudaVocabShards, ::testing::Values(1, 2, 3));

// NCCL with one rank on GPU 0 runs the same arithmetic as the in-process form with one rank: the same bits
// everywhere but grad_weight/grad_bias, whose target terms are fp32 atomics in either order (both pass strict).
TEST(CudaVocabParallel, NcclOneRankMatchesInProcessOneRank) {
  SKIP_WITHOUT_DEVICE();
  if (!vp::nccl_built()) GTEST_SKIP() << "this build has no NCCL: the NCCL collectives are not run";
  CaseSpec spec = small_case(23);
  spec.bias = true;
  const Problem problem = generate(spec);
  const TensorMap nccl = vp::gather(vp::compute_ranks_cuda(problem, {}, 1, vp::Communication::nccl));
  const TensorMap local = in_process(problem, {}, 1);
  ASSERT_EQ(nccl.size(), local.size());
  for (const auto& [name, t] : local) {
    if (name == "grad_weight" || name == "grad_bias") continue;
    EXPECT_EQ(nccl.at(name).bytes, t.bytes) << name;
  }
  expect_strict_pass(problem, nccl);
}

TEST(CudaVocabParallel, PlansNameWhatRunsWhereAndRefuseWhatCannot) {
  SKIP_WITHOUT_DEVICE();
  const vp::CudaPlan two = vp::plan_cuda(2, vp::Communication::in_process);
  EXPECT_EQ(two.communication, vp::Communication::in_process);
  EXPECT_NE(two.description.find("in-process"), std::string::npos) << two.description;
  // automatic picks NCCL only with a GPU per rank.
  const vp::CudaPlan many = vp::plan_cuda(two.devices + 1);
  EXPECT_EQ(many.communication, vp::Communication::in_process) << many.description;
  if (vp::nccl_built()) {
    try {
      vp::plan_cuda(two.devices + 1, vp::Communication::nccl);
      ADD_FAILURE() << "NCCL with more ranks than GPUs was accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("Duplicate GPU"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(vp::plan_cuda(0), InputError);
  const Problem problem = generate(small_case(29));
  EXPECT_THROW(vp::compute_ranks_cuda(problem, {}, 68, vp::Communication::in_process), InputError);  // G > V
}

}  // namespace
