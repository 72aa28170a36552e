// The vocab-parallel algebra (G ranks in one process) against the float64 reference under the strict profile,
// for G = 1, 2, 3 (V not divisible by G), across the features and both chunk schedules.
#include "fused/cpu/cpu_backend.h"
#include "fused/vocab_parallel/vocab_parallel.h"
#include "fused/vocab_parallel/tests/shard_cases.h"
#include "problem/generate.h"
#include "reference/reference.h"
#include "verifier/error_model.h"

#include <gtest/gtest.h>

namespace {

using namespace simpo;
namespace vp = simpo::fused::vocab_parallel;
using namespace vp::shard_cases;

class VocabShards : public ::testing::TestWithParam<int> {};

TEST_P(VocabShards, AgreesWithTheReferenceUnderStrict) {
  std::uint64_t seed = 100;
  for (const Feature& f : features()) {
    SCOPED_TRACE(f.name);
    CaseSpec spec = small_case(seed++);
    fused::Options options;
    f.apply(spec, options);
    const Problem problem = generate(spec);
    expect_strict_pass(problem, vp::compute(problem, options, GetParam()));
  }
}

TEST_P(VocabShards, ForwardOnlyAndF32Gradients) {
  const Problem problem = generate(small_case(7));
  fused::Options forward;
  forward.gradients = false;
  expect_strict_pass(problem, vp::compute(problem, forward, GetParam()), false);
  fused::Options f32;
  f32.grad_weight_f32 = true;
  const TensorMap out = vp::compute(problem, f32, GetParam());
  EXPECT_EQ(out.at("grad_weight").dtype, DType::F32);
  expect_strict_pass(problem, out);
}

// Each rank holds only its shard of grad_weight/grad_bias and the full replicated outputs.
TEST_P(VocabShards, EachRankHoldsItsShardAndTheReplicatedOutputs) {
  CaseSpec spec = small_case(9);
  spec.bias = true;
  const Problem problem = generate(spec);
  const auto ranks = vp::compute_ranks(problem, {}, GetParam());
  ASSERT_EQ(ranks.size(), static_cast<std::size_t>(GetParam()));
  std::int64_t rows = 0;
  for (const auto& r : ranks) {
    EXPECT_EQ(r.shard.begin, rows);
    EXPECT_EQ(r.outputs.at("grad_weight").shape, (std::vector<std::int64_t>{r.shard.size(), spec.shape.H}));
    EXPECT_EQ(r.outputs.at("grad_bias").shape, (std::vector<std::int64_t>{r.shard.size()}));
    EXPECT_EQ(r.outputs.at("grad_x").bytes, ranks[0].outputs.at("grad_x").bytes);
    EXPECT_EQ(r.outputs.at("loss").bytes, ranks[0].outputs.at("loss").bytes);
    rows += r.shard.size();
  }
  EXPECT_EQ(rows, spec.shape.V);
}

INSTANTIATE_TEST_SUITE_P(G, VocabShards, ::testing::Values(1, 2, 3));

// One rank does what the cpu backend does, operation for operation: the same bits.
TEST(VocabParallel, OneRankIsTheCpuBackendBitForBit) {
  CaseSpec spec = small_case(11);
  spec.bias = true;
  const Problem problem = generate(spec);
  const TensorMap one = vp::compute(problem, {}, 1);
  fused::Options fp32_logits;  // the shards keep fp32 logits (Options::logit_distances does not apply to them)
  fp32_logits.logit_distances = false;
  const TensorMap cpu = fused::cpu::compute(problem, fp32_logits);
  ASSERT_EQ(one.size(), cpu.size());
  for (const auto& [name, t] : cpu) EXPECT_EQ(one.at(name).bytes, t.bytes) << name;
}

TEST(VocabParallel, SplitsTheVocabularyEvenly) {
  const auto shards = vp::split_vocabulary(10, 3);
  ASSERT_EQ(shards.size(), 3u);
  EXPECT_EQ(shards[0].size(), 4);
  EXPECT_EQ(shards[1].size(), 3);
  EXPECT_EQ(shards[2].end, 10);
  EXPECT_THROW(vp::split_vocabulary(10, 0), InputError);
  EXPECT_THROW(vp::split_vocabulary(10, 11), InputError);
}

TEST(VocabParallel, GatherRefusesRanksThatDisagree) {
  const Problem problem = generate(small_case(13));
  auto ranks = vp::compute_ranks(problem, {}, 2);
  ranks[1].outputs.at("grad_x").bytes[0] ^= std::byte{1};
  EXPECT_THROW(vp::gather(ranks), InputError);
}

}  // namespace
