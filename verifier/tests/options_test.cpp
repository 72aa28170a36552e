// Options are validated in one place for every implementation, and a case's fields are one list:
// its description, its replay command and the CLI's flags agree.
#include "verifier/properties.h"

#include <gtest/gtest.h>

#include <cmath>
#include <iterator>
#include <map>
#include <sstream>

namespace simpo::verifier {
namespace {

Problem small_problem() {
  CaseSpec spec;
  spec.shape = {2, 3, 4, 5};
  return generate(spec);
}

TEST(RunOptions, ANegativeChunkCapIsRefusedByEveryImplementation) {
  RunOptions bad;
  bad.max_chunk_rows = -3;
  // The reference used to take it as "its own default" where the fused backends refused it.
  for (const auto& impl : available_implementations()) {
    try {
      (void)impl.compute(small_problem(), bad);
      ADD_FAILURE() << impl.name << " accepted max_chunk_rows = -3";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("--max-chunk-rows"), std::string::npos) << impl.name << ": " << e.what();
    }
  }
  RunOptions no_workspace;
  no_workspace.workspace_bytes = 0;
  EXPECT_THROW((void)reference_implementation().compute(small_problem(), no_workspace), InputError);
}

TEST(Profile, ToleranceFlagsAreValidatedNeverDropped) {
  const double minus_one = -1, nan = std::nan(""), small = 1e-3;
  EXPECT_THROW(profile_from_flags("strict", &minus_one, &minus_one), InputError);  // used to mean "strict"
  EXPECT_THROW(profile_from_flags("strict", nullptr, &nan), InputError);           // used to mean "strict"
  EXPECT_THROW(profile_from_flags("strict", &nan, nullptr), InputError);
  EXPECT_EQ(profile_from_flags("strict", nullptr, nullptr).kind, ProfileKind::strict);
  EXPECT_EQ(profile_from_flags("peer", nullptr, nullptr).kind, ProfileKind::peer);
  const Profile user = profile_from_flags("strict", &small, nullptr);
  EXPECT_EQ(user.kind, ProfileKind::user);
  EXPECT_EQ(user.rtol, small);
  EXPECT_EQ(user.atol, 0);
}

// Reads back `simpo-verify case ...` flags as the CLI does.
Case parse_command(const std::string& command) {
  std::istringstream in(command);
  std::vector<std::string> words{std::istream_iterator<std::string>(in), {}};
  std::map<std::string, std::string> given;
  for (std::size_t i = 0; i < words.size(); ++i)
    for (const auto& f : case_fields())
      if (words[i] == f.flag) given[f.flag] = f.is_switch ? "" : words[i + 1];
  Case c;
  apply_case_fields(c, given);
  return c;
}

TEST(CaseFields, TheReplayCommandRebuildsTheCaseExactly) {
  Rng rng(5);
  for (int i = 0; i < 200; ++i) {
    const Case c = random_case(rng);
    const Case back = parse_command(c.case_command("cpu"));
    EXPECT_EQ(back.to_string(), c.to_string());
    EXPECT_EQ(back.spec.hp, c.spec.hp);  // exactly: the command carries 17 digits
    EXPECT_EQ(back.spec.shape, c.spec.shape);
    EXPECT_EQ(back.spec.seed, c.spec.seed);
    EXPECT_EQ(back.spec.logit_scale, c.spec.logit_scale);
    EXPECT_EQ(back.max_chunk_rows, c.max_chunk_rows);
    EXPECT_EQ(back.workspace_bytes, c.workspace_bytes);
  }
}

TEST(CaseFields, EveryFieldIsInTheDescriptionAndBadValuesNameTheirFlag) {
  Case c;
  c.spec.hp.empty_sequence = EmptySequence::zero;
  c.workspace_bytes = fused::min_workspace_bytes;  // the three fields the description shows only when not default
  c.spec.dtype = DType::F32;
  for (const auto& f : case_fields())
    EXPECT_NE(c.to_string().find(f.key + "="), std::string::npos) << f.key << " missing from " << c.to_string();
  try {
    apply_case_fields(c, {{"--beta", "lots"}});
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--beta"), std::string::npos);
  }
}

// The inputs' dtype is a field of a case: shown and replayed when not bf16, set by --dtype, a bad value naming it.
TEST(CaseFields, DtypeIsAFieldOfTheCase) {
  Case c;
  EXPECT_EQ(c.to_string().find("dtype="), std::string::npos);  // bf16: descriptions read as they always did
  apply_case_fields(c, {{"--dtype", "f16"}});
  EXPECT_EQ(c.spec.dtype, DType::F16);
  EXPECT_NE(c.to_string().find("dtype=f16"), std::string::npos);
  EXPECT_NE(c.case_command("cpu").find("--dtype f16"), std::string::npos);
  try {
    apply_case_fields(c, {{"--dtype", "f64"}});
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--dtype"), std::string::npos) << e.what();
  }
}

// A distribution asked for several dtypes draws each of them, and every other choice of a case is drawn as without
// them; asked for none it draws bf16 with no draw at all.
TEST(Distribution, DtypesAreDrawnLastFromTheOnesAskedFor) {
  CaseDistribution mixed;
  mixed.dtypes = {DType::BF16, DType::F16, DType::F32};
  Rng a(5), b(5);
  std::map<DType, int> seen;
  for (int i = 0; i < 60; ++i) {
    Rng before = a;
    const Case plain = random_case(before);
    const Case drawn = random_case(a, mixed);
    ++seen[drawn.spec.dtype];
    EXPECT_EQ(plain.spec.shape, drawn.spec.shape);
    EXPECT_EQ(plain.spec.hp, drawn.spec.hp);
    EXPECT_EQ(plain.spec.seed, drawn.spec.seed);
    EXPECT_EQ(random_case(b).spec.dtype, DType::BF16);
  }
  EXPECT_EQ(seen.size(), 3u);
}

// One distribution: the sweep's stream is what it was before the pieces were split out (the mutant table and
// the README's seeded figures depend on it), and a chooser that always answers 0 gives the simplest case.
TEST(Distribution, ZeroChoicesGiveTheSimplestCase) {
  struct Zero : Chooser {
    double uniform() override { return 0; }
    std::int64_t below(std::int64_t) override { return 0; }
    std::uint64_t seed() override { return 0; }
  } zero;
  const Case c = random_case(zero);
  EXPECT_EQ(c.spec.shape, (Shape{2, 1, 1, 1}));
  EXPECT_EQ(c.spec.hp.beta, Hyperparameters{}.beta);
  EXPECT_EQ(c.max_chunk_rows, 0);
}

TEST(Distribution, TheSweepStreamIsUnchanged) {
  // The first cases of the default seed, as the sweep drew them before the distribution was split into pieces.
  Rng rng(20260101);
  for (const char* before :
       {"B=2 T=44 H=42 V=328 seed=17486582413981831226 bias=on scale=3.611 ignore=prompt_prefix beta=0.1 gamma=0.5 "
        "alpha=1 ls=0.2641 nll=on ignore_index=-100 grad_scale=73.02 chunk_rows=80",
        "B=6 T=2 H=64 V=3 seed=1096830527967162810 bias=off scale=1.257 ignore=none beta=0.1 gamma=0.5 alpha=0.9999 "
        "ls=0.06918 nll=on ignore_index=-371 grad_scale=1 chunk_rows=0",
        "B=16 T=11 H=61 V=176 seed=14171276813304154931 bias=on scale=2.266 ignore=prompt_prefix beta=0.6584 gamma=0.5 "
        "alpha=0 ls=0.5 nll=off ignore_index=-729 grad_scale=1 chunk_rows=29"})
    EXPECT_EQ(random_case(rng).to_string(), before);
}

}  // namespace
}  // namespace simpo::verifier
