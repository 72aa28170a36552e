// The suite every fused backend must pass: against the float64 reference on every SPEC feature at the issue's
// accuracy bar (each gradient within 1.5x its bf16 floor; loss, nll and logps within 5e-7 relative), and
// against itself across chunk schedules. Built once per backend: into fused_cpu_tests (suites CpuBackend*) and,
// with SIMPO_SUITE_CUDA=1, into cuda_backend_test (suites CudaBackend*, ctest label gpu), where every test
// skips with a message on a machine without a CUDA device. Backend-specific tests live beside it.
#include "fused/schedule.h"
#include "fused/tests/backend_suite.h"

#include <gtest/gtest.h>

namespace simpo::fused {
namespace {

using namespace suite;

#if SIMPO_SUITE_CUDA
constexpr Backend kBackend = Backend::cuda;
#define SIMPO_SUITE(name) CudaBackend##name
#else
constexpr Backend kBackend = Backend::cpu;
#define SIMPO_SUITE(name) CpuBackend##name
#endif

// The backend under test, or a skip saying why it cannot run here.
#define SKIP_WITHOUT_BACKEND()                                                                              \
  do {                                                                                                       \
    if (kBackend == Backend::cuda && !cuda_available())                                                      \
      GTEST_SKIP() << "no CUDA device on this machine (or a build without CUDA): the cuda backend's suite " \
                      "runs on a GPU machine (ctest -L gpu)";                                                \
  } while (0)

Options backend_options() { return options_for(kBackend); }

// ---- the bar on shapes big enough for the Frobenius statistic to be stable (N*H and V*H >= 1e5) ----

const Shape bar_shape{.B = 4, .T = 128, .H = 256, .V = 512};

TEST(SIMPO_SUITE(Accuracy), RealisticLogitsMeetTheBar) {
  SKIP_WITHOUT_BACKEND();
  check_case(spec_of(bar_shape, 2.0, 11), backend_options());
}

TEST(SIMPO_SUITE(Accuracy), LargeLogitsMeetTheBar) {
  SKIP_WITHOUT_BACKEND();
  check_case(spec_of(bar_shape, 30.0, 12), backend_options());
}

TEST(SIMPO_SUITE(Accuracy), EveryFeatureAtOnceMeetsTheBar) {
  SKIP_WITHOUT_BACKEND();
  for (double scale : {2.0, 30.0}) {
    SCOPED_TRACE("logit scale " + std::to_string(scale));
    CaseSpec spec = spec_of(bar_shape, scale, 13);
    spec.bias = true;
    spec.ignore = IgnorePattern::random;
    spec.hp.label_smoothing = 0.2;
    spec.hp.grad_scale = 0.37;
    spec.hp.ignore_index = 7;  // inside [0, V): target 7 means "ignored"
    spec.hp.beta = 2.0;
    spec.hp.gamma = -0.3;
    spec.hp.alpha = 0.6;
    Options options = backend_options();
    options.max_chunk_rows = 3 * 128 + 5;  // three_pass, one pair per chunk
    check_case(spec, options);
  }
}

// A vocabulary in the tens of thousands, not a multiple of 4 or 8: many vector steps per row, per-row sums of
// 50k exponentials, and (cuda, sm_90) the promoted GEMM's cuBLAS tail columns.
TEST(SIMPO_SUITE(Accuracy), LargeVocabularyMeetsTheBar) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of({.B = 2, .T = 64, .H = 128, .V = 50007}, 2.0, 14);
  spec.bias = true;
  check_case(spec, backend_options());
}

// ---- every input dtype (SPEC): f16 and f32 inputs, gradients in their dtype, at their own floor ----

TEST(SIMPO_SUITE(Accuracy), F16AndF32InputsMeetTheirBar) {
  SKIP_WITHOUT_BACKEND();
  for (DType dtype : {DType::F16, DType::F32})
    for (double scale : {2.0, 30.0}) {
      SCOPED_TRACE(input_dtype_name(dtype) + " inputs, logit scale " + std::to_string(scale));
      CaseSpec spec = spec_of(bar_shape, scale, 15);
      spec.dtype = dtype;
      spec.bias = true;
      spec.ignore = IgnorePattern::random;
      spec.hp.label_smoothing = 0.2;
      spec.hp.grad_scale = 0.37;
      Options options = backend_options();
      options.max_chunk_rows = 3 * 128 + 5;  // chunk boundaries inside sequences
      check_case(spec, options);
      options.grad_weight_f32 = true;
      check_case(spec, options);
    }
}

// ---- SPEC features one at a time, smaller shapes ----

const Shape feature_shape{.B = 4, .T = 64, .H = 96, .V = 300};

TEST(SIMPO_SUITE(Features), Bias) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of(feature_shape, 2.0, 21);
  spec.bias = true;
  check_case(spec, backend_options());
}

// A frozen input (Options::grad_x / grad_weight false) gets no gradient output, and the outputs that remain are the
// full step's bits (the skipped GEMMs feed nothing else); asking for gradients of neither is an InputError.
TEST(SIMPO_SUITE(Features), FrozenInputsGetNoGradientAndChangeNothingElse) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of(feature_shape, 2.0, 29);
  spec.bias = true;
  const Problem problem = generate(spec);
  const Options full = backend_options();
  const TensorMap all = compute(problem, full);
  for (const bool x_only : {false, true}) {
    SCOPED_TRACE(x_only ? "frozen LM head" : "frozen x");
    Options frozen = full;
    frozen.grad_x = x_only;
    frozen.grad_weight = !x_only;
    const TensorMap out = compute(problem, frozen);
    expect_dtypes(out, problem, frozen);
    for (const auto& [name, t] : out) EXPECT_EQ(t.bytes, all.at(name).bytes) << name;
  }
  Options neither = full;
  neither.grad_x = neither.grad_weight = false;
  EXPECT_THROW(compute(problem, neither), InputError);
}

TEST(SIMPO_SUITE(Features), LabelSmoothing) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of(feature_shape, 2.0, 22);
  spec.hp.label_smoothing = 0.5;
  check_case(spec, backend_options());
}

TEST(SIMPO_SUITE(Features), NllOffGivesZeroNll) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of(feature_shape, 2.0, 23);
  spec.hp.compute_nll_loss = false;
  spec.hp.alpha = 3.0;  // must not matter
  const TensorMap out = check_case(spec, backend_options());
  EXPECT_EQ(out.at(output_name::nll_loss).value(0), 0.0);
}

TEST(SIMPO_SUITE(Features), AlphaZero) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of(feature_shape, 2.0, 24);
  spec.hp.alpha = 0.0;
  check_case(spec, backend_options());
}

TEST(SIMPO_SUITE(Features), CustomIgnoreIndex) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of(feature_shape, 2.0, 25);
  spec.hp.ignore_index = -1;
  spec.ignore = IgnorePattern::random;
  check_case(spec, backend_options());
}

TEST(SIMPO_SUITE(Features), GradScale) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of(feature_shape, 2.0, 26);
  spec.hp.grad_scale = -2.5;
  check_case(spec, backend_options());
}

TEST(SIMPO_SUITE(Features), AllButOneTokenIgnored) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of(feature_shape, 2.0, 27);
  spec.ignore = IgnorePattern::all_but_one;
  check_case(spec, backend_options());
}

TEST(SIMPO_SUITE(Features), EmptySequenceTreatedAsZero) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of(feature_shape, 2.0, 28);
  spec.ignore = IgnorePattern::empty_sequence;
  spec.hp.empty_sequence = EmptySequence::zero;
  check_case(spec, backend_options());
}

TEST(SIMPO_SUITE(Features), EmptySequenceIsAnErrorByDefault) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of(feature_shape, 2.0, 28);
  spec.ignore = IgnorePattern::empty_sequence;
  EXPECT_THROW(compute(generate(spec), backend_options()), InputError);
}

TEST(SIMPO_SUITE(Features), ForwardOnlyHasNoGradientsAndTheSameForward) {
  SKIP_WITHOUT_BACKEND();
  const CaseSpec spec = spec_of(feature_shape, 2.0, 29);
  Options forward = backend_options();
  forward.gradients = false;
  const TensorMap fwd = check_case(spec, forward);
  const TensorMap full = compute(generate(spec), backend_options());
  // Forward-only uses bigger chunks (no dz or grad_x per row): the same forward up to fp32 noise.
  expect_same_to_fp32_noise(fwd, full);  // fwd has no gradients to compare
}

TEST(SIMPO_SUITE(Features), GradWeightF32RoundsToTheBf16Output) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of(feature_shape, 2.0, 30);
  spec.bias = true;
  Options f32 = backend_options();
  f32.grad_weight_f32 = true;
  const TensorMap wide = check_case(spec, f32);
  const TensorMap narrow = compute(generate(spec), backend_options());
  // Both are one fp32 sum rounded once, so rounding the F32 one must give the bf16 one: bitwise on the cpu; on
  // cuda up to the run-to-run order of the fp32 atomics of the target term, which may move a value across a
  // rounding boundary (at most 1 in 1000 elements). On sm_90 the bf16 grad_weight accumulates in the hi/lo pair
  // (fused/cuda/hilo_gemm.h) instead: each addition after the first rounding carries the sum to 2^-16 of itself,
  // so an element lands on the other neighbour when it lies within that of a rounding tie, a fraction
  // <= 2 * 2^-16 / 2^-8 = 2^-7 of the elements per addition; here one chunk, then the target term: one addition.
  // Every mismatch must still be a neighbour (one bf16 ulp).
  for (const char* name : {output_name::grad_weight, output_name::grad_bias}) {
    const auto a = wide.at(name).as<float>();
    const auto b = narrow.at(name).as<bf16>();
    ASSERT_EQ(a.size(), b.size());
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (bf16(a[i]) == b[i]) continue;
      ++mismatches;
      const float x = static_cast<float>(bf16(a[i])), y = static_cast<float>(b[i]);
      EXPECT_LE(std::abs(x - y), std::ldexp(std::abs(x), -7)) << name << "[" << i << "]: not a neighbour";
    }
    const std::size_t hilo = kBackend == Backend::cuda && name == std::string(output_name::grad_weight) ? a.size() / 128 : 0;
    EXPECT_LE(mismatches, kBackend == Backend::cuda ? a.size() / 1000 + hilo : 0) << name;
  }
}

TEST(SIMPO_SUITE(Features), OddSizesBothSchedules) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of({.B = 6, .T = 37, .H = 31, .V = 123}, 2.0, 31);
  spec.bias = true;
  spec.hp.label_smoothing = 0.1;
  for (std::int64_t rows : {0, 1, 50, 73, 74, 75, 111, 149}) {  // 2T = 74: below it two_pass, from it three_pass
    SCOPED_TRACE("max_chunk_rows " + std::to_string(rows));
    Options options = backend_options();
    options.max_chunk_rows = rows;
    check_case(spec, options);
  }
}

TEST(SIMPO_SUITE(Features), IgnoredRowsOfGradXAreExactlyZero) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of(feature_shape, 2.0, 32);
  spec.ignore = IgnorePattern::random;
  const Problem problem = generate(spec);
  Options options = backend_options();
  options.max_chunk_rows = 50;
  const TensorMap out = compute(problem, options);  // held: as<bf16>() is a view into it
  const auto grad_x = out.at(output_name::grad_x).as<bf16>();
  std::int64_t ignored = 0;
  for (std::int64_t b = 0; b < problem.shape.B; ++b)
    for (std::int64_t t = 0; t < problem.shape.T; ++t) {
      if (problem.is_completion(b, t)) continue;
      ++ignored;
      for (std::int64_t h = 0; h < problem.shape.H; ++h)
        ASSERT_EQ(static_cast<float>(grad_x[static_cast<std::size_t>((b * problem.shape.T + t) * problem.shape.H + h)]),
                  0.f);
    }
  EXPECT_GT(ignored, 0);
}

// Options::logit_distances: dz from 16-bit distances below each 192-column tile's row max (fused/simpo_math.h). The
// bar at both logit scales (at 30 many distances saturate) with the features that reach dz (bias, ignored rows,
// label smoothing), V a multiple of the tile, not one, and not a multiple of 8 (cuda then keeps fp32 logits), 33 tiles
// to a row with 130-row sequences (cuda: chunks of two pairs, tiles of rows cut by the parts), in
// both schedules, with bf16 and fp32 weight gradients (cuda: the hi/lo pair or the fp32 accumulator); and agreement
// with fp32 logits to fp32 noise: the rounding moves each softmax value by <= 2^-12 relative, an eighth of dz's own
// bf16 rounding, and leaves the scalars alone.
TEST(SIMPO_SUITE(Features), LogitDistancesMeetTheBarAndAgreeWithFp32Logits) {
  SKIP_WITHOUT_BACKEND();
  for (Shape shape : {Shape{.B = 4, .T = 100, .H = 256, .V = 384}, Shape{.B = 4, .T = 100, .H = 256, .V = 1000},
                      Shape{.B = 4, .T = 100, .H = 264, .V = 389}, Shape{.B = 4, .T = 130, .H = 200, .V = 6152}}) {
    for (double scale : {2.0, 30.0}) {
      CaseSpec spec = spec_of(shape, scale, 33);
      spec.bias = true;
      spec.ignore = IgnorePattern::random;
      spec.hp.label_smoothing = 0.1;
      const Problem problem = generate(spec);
      const TensorMap exact = reference::compute(problem);
      // three_pass with bf16 and with fp32 weight gradients, two_pass
      for (const auto& [rows, grad_weight_f32] :
           {std::pair{std::int64_t{0}, false}, std::pair{std::int64_t{0}, true}, std::pair{shape.T - 1, false}}) {
        SCOPED_TRACE(shape.to_string() + ", scale " + std::to_string(scale) + ", max_chunk_rows " +
                     std::to_string(rows) + (grad_weight_f32 ? ", fp32 grad_weight" : ""));
        Options distances = backend_options();
        distances.max_chunk_rows = rows;
        distances.grad_weight_f32 = grad_weight_f32;
        distances.logit_distances = true;
        Options fp32 = distances;
        fp32.logit_distances = false;
        const TensorMap out = compute(problem, distances);
        expect_meets_bar(out, exact, scale);
        expect_same_to_fp32_noise(out, compute(problem, fp32), &exact);
      }
    }
  }
}

// ---- schedules: one result up to fp32 noise ----

TEST(SIMPO_SUITE(Schedules), TwoPassAgreesWithThreePass) {
  SKIP_WITHOUT_BACKEND();
  CaseSpec spec = spec_of({.B = 4, .T = 50, .H = 48, .V = 200}, 30.0, 42);
  spec.hp.label_smoothing = 0.25;
  const Problem problem = generate(spec);
  Options three = backend_options(), two = backend_options();
  three.max_chunk_rows = 100;  // one pair per chunk
  two.max_chunk_rows = 99;     // one row short of a pair: the fallback
  ASSERT_EQ(plan(problem.shape, three).mode, Mode::three_pass);
  ASSERT_EQ(plan(problem.shape, two).mode, Mode::two_pass);
  const TensorMap exact = reference::compute(problem);
  expect_same_to_fp32_noise(compute(problem, two), compute(problem, three), &exact);
}

TEST(SIMPO_SUITE(Schedules), TooSmallABudgetIsAnInputErrorNamingTheBytes) {
  SKIP_WITHOUT_BACKEND();
  const Problem problem = generate(spec_of({.B = 2, .T = 4, .H = 8, .V = 1000}, 2.0, 43));
  Options options = backend_options();
  options.workspace_bytes = 1000;
  try {
    compute(problem, options);
    FAIL() << "no error";
  } catch (const InputError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("1000 bytes"), std::string::npos) << message;
    EXPECT_NE(message.find("cannot hold one token row"), std::string::npos) << message;
  }
}

TEST(SIMPO_SUITE(Errors), InvalidProblemsAreInputErrors) {
  SKIP_WITHOUT_BACKEND();
  Problem problem = generate(spec_of({.B = 2, .T = 4, .H = 8, .V = 16}, 2.0, 48));
  problem.target[3] = 16;  // outside [0, V)
  EXPECT_THROW(compute(problem, backend_options()), InputError);
}

// SPEC's NaN/Inf rule names the first non-finite element in validate()'s order (x, weight, bias), in every input
// dtype. V H = 37 x 13 is no multiple of a 16-byte vector: the scan's last elements are read one at a time.
TEST(SIMPO_SUITE(Errors), NonFiniteInputsNameTheFirstOne) {
  SKIP_WITHOUT_BACKEND();
  for (const DType dtype : {DType::BF16, DType::F16, DType::F32}) {
    CaseSpec spec = spec_of({.B = 2, .T = 4, .H = 13, .V = 37}, 2.0, 49);
    spec.dtype = dtype;
    spec.bias = true;
    SCOPED_TRACE(input_dtype_name(dtype));
    auto set = [](InputValues& values, std::size_t i, float value) {
      values.visit([&](auto& v) { v[i] = static_cast<std::decay_t<decltype(v[0])>>(value); });
    };
    auto message_of = [&](const Problem& p) {
      try {
        compute(p, backend_options());
      } catch (const InputError& e) {
        return std::string(e.what());
      }
      return std::string("no InputError");
    };
    const Problem clean = generate(spec);
    Problem p = clean;
    set(p.weight, 37 * 13 - 1, INFINITY);  // the last element (a scalar tail)
    EXPECT_NE(message_of(p).find("non-finite input: weight(36, 12) = inf"), std::string::npos) << message_of(p);
    set(p.weight, 1000 % (37 * 13), NAN);  // an earlier one, inside a vector: the lowest index is named
    set(p.weight, 5, -INFINITY);
    EXPECT_NE(message_of(p).find("non-finite input: weight(0, 5) = -inf"), std::string::npos) << message_of(p);
    set(p.x, 2 * 4 * 13 - 2, NAN);  // x is scanned before weight
    EXPECT_NE(message_of(p).find("non-finite input: x(1, 3, 11)"), std::string::npos) << message_of(p);
    p = clean;
    set(*p.bias, 20, NAN);
    EXPECT_NE(message_of(p).find("non-finite input: bias(20)"), std::string::npos) << message_of(p);
  }
}

// The cuda backend scans the inputs only where the row statistics are not finite (its proof that they are: every
// logit enters a row sum). These are the infinities whose logits are least visible: W[v, h] = Inf where hidden unit
// h is 0 in every row (Inf times 0: NaN logits) or negative in every row (a column of -Inf logits, whose
// probabilities are 0); each must still be named.
TEST(SIMPO_SUITE(Errors), InfinitiesTimesZeroOrNegativeUnitsAreNamed) {
  SKIP_WITHOUT_BACKEND();
  for (const DType dtype : {DType::BF16, DType::F16, DType::F32}) {
    SCOPED_TRACE(input_dtype_name(dtype));
    CaseSpec spec = spec_of({.B = 2, .T = 5, .H = 16, .V = 40}, 2.0, 57);
    spec.dtype = dtype;
    const Problem clean = generate(spec);
    const std::int64_t H = clean.shape.H, h = 3, v = 17;
    for (const float unit : {0.0f, -0.5f}) {
      SCOPED_TRACE(unit);
      Problem p = clean;
      p.x.visit([&](auto& x) {
        for (std::int64_t r = 0; r < p.shape.N(); ++r)
          x[static_cast<std::size_t>(r * H + h)] = static_cast<std::decay_t<decltype(x[0])>>(unit);
      });
      p.weight.visit([&](auto& w) {
        w[static_cast<std::size_t>(v * H + h)] = static_cast<std::decay_t<decltype(w[0])>>(INFINITY);
      });
      try {
        compute(p, backend_options());
        ADD_FAILURE() << "no InputError";
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find("non-finite input: weight(17, 3) = inf"), std::string::npos) << e.what();
      }
    }
  }
}

}  // namespace
}  // namespace simpo::fused
