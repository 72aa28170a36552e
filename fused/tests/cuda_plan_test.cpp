// The cuda backend's plan (fused/cuda/plan.h), on the host: what it chooses for a device with and without the sm_90a
// kernels, and that its workspace holds every region once, inside the budget, for many shapes and budgets. No GPU
// needed: the runner only allocates and walks what this computes.
#include "fused/cuda/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>

namespace simpo::fused::cuda {
namespace {

const Shape published{.B = 16, .T = 1024, .H = 4096, .V = 128256};
const DeviceFeatures hopper{.sm90_kernels = true}, other{.sm90_kernels = false};
const GradientOutputs bf16_output{.grad_weight_16bit = true}, f32_output{.grad_weight_f32 = true};

// Every region inside the workspace, and no byte in two regions unless one says it shares the other's bytes.
void expect_regions_disjoint(const StepPlan& plan) {
  SCOPED_TRACE(plan.to_string());
  ASSERT_FALSE(plan.regions.empty());
  for (const Region& r : plan.regions) {
    EXPECT_GE(r.offset, 0) << r.name;
    EXPECT_GE(r.bytes, 0) << r.name;
    EXPECT_LE(r.offset + r.bytes, plan.workspace_bytes) << r.name;
    EXPECT_EQ(r.offset % 256, 0) << r.name << " is not 256-byte aligned";
  }
  for (std::size_t i = 0; i < plan.regions.size(); ++i)
    for (std::size_t j = i + 1; j < plan.regions.size(); ++j) {
      const Region &a = plan.regions[i], &b = plan.regions[j];
      if (a.bytes == 0 || b.bytes == 0 || a.shares_with == b.name || b.shares_with == a.name) continue;
      EXPECT_TRUE(a.offset + a.bytes <= b.offset || b.offset + b.bytes <= a.offset) << a.name << " overlaps " << b.name;
    }
}

void expect_rows_covered(const StepPlan& plan, const Shape& s) {
  std::vector<int> seen(static_cast<std::size_t>(s.N()), 0);
  for (const Chunk& c : plan.schedule.chunks)
    for (int i = 0; i < c.part_count; ++i)
      for (std::int64_t r = c.parts[i].begin; r < c.parts[i].end; ++r) ++seen[static_cast<std::size_t>(r)];
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; })) << plan.to_string();
}

TEST(CudaPlan, PublishedStepOnHopper) {
  const StepPlan plan = plan_step(published, DType::BF16, Options{}, hopper, &bf16_output);
  EXPECT_TRUE(plan.logits.promoted);
  EXPECT_EQ(plan.logits.promotion_k, 256);
  EXPECT_EQ(plan.schedule.mode, Mode::three_pass);
  EXPECT_EQ(plan.grad_weight, StepPlan::GradWeight::hilo);
  EXPECT_EQ(plan.accumulator_bytes, published.V * published.H * 2) << "lo of the hi/lo pair";
  EXPECT_FALSE(plan.low_memory);
  EXPECT_LE(plan.workspace_bytes, default_workspace_bytes);
  expect_regions_disjoint(plan);
  expect_rows_covered(plan, published);
  // What the main job's header line says of a Hopper device (fused::describe).
  EXPECT_EQ(plan.logits_form(),
            "promoted GEMM every 256 k, statistics over <= 2048 rows a launch, full step keeps 16-bit logit "
            "distances");
  EXPECT_EQ(plan.grad_weight_form(), "bf16 hi/lo pair");
}

// The sm_90a kernels take bf16: f16 inputs get cuBLAS cut along k (the tensor cores' truncated accumulation), f32
// one fp32 GEMM over all of H; both an fp32 grad_W accumulator, x rows gathered in their own width, small budgets the
// two_pass fallback (the low-memory schedule needs the promoted GEMM).
TEST(CudaPlan, F16AndF32InputsTakeTheCublasPathOnHopper) {
  for (DType dtype : {DType::F16, DType::F32}) {
    SCOPED_TRACE(input_dtype_name(dtype));
    const bool f32 = dtype == DType::F32;
    const StepPlan plan = plan_step(published, dtype, Options{}, hopper, f32 ? &f32_output : &bf16_output);
    EXPECT_FALSE(plan.logits.promoted);
    EXPECT_EQ(plan.logits.k_splits, f32 ? 1 : 16);
    EXPECT_FALSE(plan.epilogue_statistics);
    EXPECT_EQ(plan.kept, StepPlan::Kept::fp32);
    EXPECT_EQ(plan.grad_weight, f32 ? StepPlan::GradWeight::f32_output : StepPlan::GradWeight::f32_own);
    const auto x_rows = std::find_if(plan.regions.begin(), plan.regions.end(),
                                     [](const Region& r) { return r.name == "gathered x rows"; });
    ASSERT_NE(x_rows, plan.regions.end());
    EXPECT_EQ(x_rows->bytes, plan.schedule.max_rows() * published.H * (f32 ? 4 : 2));
    expect_regions_disjoint(plan);
    expect_rows_covered(plan, published);
    Options small;
    small.workspace_bytes = min_workspace_bytes;
    EXPECT_FALSE(plan_step(published, dtype, small, hopper, &bf16_output).low_memory);
  }
}

TEST(CudaPlan, ForwardTakesItsStatisticsFromTheEpilogueInL2SizedChunks) {
  Options forward;
  forward.gradients = false;
  const StepPlan plan = plan_step(published, DType::BF16, forward, hopper, nullptr);
  EXPECT_EQ(plan.schedule.mode, Mode::forward_only);
  EXPECT_TRUE(plan.epilogue_statistics);
  EXPECT_EQ(plan.kept, StepPlan::Kept::none);
  EXPECT_EQ(plan.schedule.max_rows(), 4096) << "x of 4096 rows at H = 4096 is 32 MiB";
  EXPECT_EQ(plan.schedule.bytes_per_row, statistics_tiles(published.V) * 16) << "no logits stored";
  EXPECT_EQ(plan.logits.statistics_launch_rows, 2048) << "each chunk in two launches: 16 MiB of x each";
  expect_regions_disjoint(plan);
  // Tuning: a part per launch (0; a negative count reads as 0), or any other count.
  for (const auto& [asked, planned] : {std::pair<std::int64_t, std::int64_t>{0, 0}, {-5, 0}, {64, 64}}) {
    const StepPlan tuned = plan_step(published, DType::BF16, forward, hopper, nullptr,
                                     Tuning{.statistics_launch_rows = asked});
    EXPECT_EQ(tuned.logits.statistics_launch_rows, planned) << asked;
    EXPECT_EQ(tuned.logits_form().find("statistics over") != std::string::npos, planned > 0) << tuned.logits_form();
  }
}

TEST(CudaPlan, WithoutTheSm90KernelsCublasSlicesAndAnFp32Accumulator) {
  const StepPlan plan = plan_step(published, DType::BF16, Options{}, other, &bf16_output);
  EXPECT_FALSE(plan.logits.promoted);
  EXPECT_EQ(plan.logits.k_splits, 16) << "k = 4096 in slices of 256";
  EXPECT_FALSE(plan.epilogue_statistics);
  EXPECT_EQ(plan.kept, StepPlan::Kept::fp32);
  EXPECT_EQ(plan.grad_weight, StepPlan::GradWeight::f32_own);
  EXPECT_EQ(plan.accumulator_bytes, published.V * published.H * 4);
  EXPECT_EQ(plan.logits_form(), "cuBLAS, k in 16 slice(s)");
  EXPECT_EQ(plan.grad_weight_form(), "fp32 accumulator");
  Options one_gemm;
  one_gemm.logits_k_slice = 0;
  EXPECT_EQ(logits_gemm(published.H, DType::BF16, one_gemm, hopper).k_splits, 1);
  EXPECT_FALSE(logits_gemm(published.H, DType::BF16, one_gemm, hopper).promoted) << "logits_k_slice = 0: one cuBLAS GEMM anywhere";
}

TEST(CudaPlan, DistancesKeepTwoBytesPerLogitWhereVIsAMultipleOf8) {
  Options distances;
  distances.logit_distances = true;
  const StepPlan plan = plan_step(published, DType::BF16, distances, hopper, &bf16_output);
  EXPECT_EQ(plan.kept, StepPlan::Kept::distances);
  EXPECT_TRUE(plan.epilogue_statistics);
  const std::int64_t tiles = statistics_tiles(published.V), ld_h = padded(published.H);
  EXPECT_EQ(plan.schedule.bytes_per_row, published.V * 2 + std::max(ld_h * 4, tiles * 12) + ld_h * 2 + tiles * 4);
  const Shape odd{.B = 4, .T = 64, .H = 96, .V = 300};  // V % 8 != 0: fp32 logits
  EXPECT_EQ(plan_step(odd, DType::BF16, distances, hopper, &bf16_output).kept, StepPlan::Kept::fp32);
  EXPECT_EQ(plan_step(published, DType::BF16, distances, other, &bf16_output).kept, StepPlan::Kept::fp32);
}

// The grad_W slice: the hi/lo pair over a bf16 output (the slice's lo in the workspace, 2 bytes a weight, unless
// the caller gives the lo), fp32 rows in the caller's fp32 output (nothing in the workspace), or the workspace's fp32
// rows where the hi/lo GEMM cannot run (H % 8 != 0). The bytes a slice does not take go to wider slices.
TEST(CudaPlan, SixtyFourMiBTakesTheLowMemorySchedule) {
  Options small;
  small.workspace_bytes = min_workspace_bytes;
  const GradientOutputs bf16_with_lo{.grad_weight_16bit = true, .grad_weight_lo = true};
  const Shape odd_h{.B = 16, .T = 1024, .H = 4100, .V = 128256};
  struct Form {
    const char* what;
    Shape shape;
    const GradientOutputs* outputs;
    StepPlan::GradWeight grad_weight;
    std::int64_t slice_column_bytes;
  };
  std::int64_t bf16_columns = 0, lo_columns = 0, f32_columns = 0;
  for (const Form& f : {Form{"bf16", published, &bf16_output, StepPlan::GradWeight::sliced_hilo, published.H * 2},
                        Form{"bf16 + the caller's lo", published, &bf16_with_lo, StepPlan::GradWeight::sliced_hilo, 0},
                        Form{"fp32", published, &f32_output, StepPlan::GradWeight::sliced, 0},
                        Form{"bf16, H % 8 != 0", odd_h, &bf16_output, StepPlan::GradWeight::sliced,
                             padded(odd_h.H) * 4}}) {
    const StepPlan plan = plan_step(f.shape, DType::BF16, small, hopper, f.outputs);
    SCOPED_TRACE(std::string(f.what) + ": " + plan.to_string());
    EXPECT_TRUE(plan.low_memory);
    EXPECT_EQ(plan.grad_weight, f.grad_weight);
    EXPECT_EQ(plan.vocab_slice_columns % 192, 0);
    EXPECT_EQ(plan.vocab_slices, (f.shape.V + plan.vocab_slice_columns - 1) / plan.vocab_slice_columns);
    EXPECT_LE(plan.workspace_bytes, small.workspace_bytes);
    const auto slice = std::find_if(plan.regions.begin(), plan.regions.end(),
                                    [](const Region& r) { return r.name.rfind("backward: grad_W slice", 0) == 0; });
    EXPECT_EQ(slice == plan.regions.end() ? 0 : slice->bytes, plan.vocab_slice_columns * f.slice_column_bytes);
    expect_regions_disjoint(plan);
    if (f.outputs == &bf16_output && f.shape.H == published.H) bf16_columns = plan.vocab_slice_columns;
    if (f.outputs == &bf16_with_lo) lo_columns = plan.vocab_slice_columns;
    if (f.outputs == &f32_output) f32_columns = plan.vocab_slice_columns;
  }
  EXPECT_EQ(lo_columns, f32_columns) << "neither keeps a grad_W slice in the workspace";
  const StepPlan fp32_rows = plan_step(odd_h, DType::BF16, small, hopper, &bf16_output);
  EXPECT_GT(bf16_columns, fp32_rows.vocab_slice_columns) << "the pair's lo takes half the fp32 slice's bytes";
  EXPECT_EQ(plan_step(published, DType::BF16, small, hopper, &bf16_output).grad_weight_form(),
            "bf16 hi/lo pair per vocabulary slice");
  // Tuning::fp32_grad_w_slices: the fp32 rows where the pair would run (cuda_bench --against-fp32-grad-w-slices).
  const StepPlan fp32_slices = plan_step(published, DType::BF16, small, hopper, &bf16_output,
                                         Tuning{.fp32_grad_w_slices = true});
  EXPECT_EQ(fp32_slices.grad_weight, StepPlan::GradWeight::sliced);
  EXPECT_LT(fp32_slices.vocab_slice_columns, bf16_columns);
  // Without the epilogue statistics: the two_pass fallback.
  const StepPlan fallback = plan_step(published, DType::BF16, small, other, &bf16_output);
  EXPECT_FALSE(fallback.low_memory);
  EXPECT_EQ(fallback.schedule.mode, Mode::two_pass);
}

TEST(CudaPlan, ABudgetBelowOneRowIsAnInputErrorNamingTheBytes) {
  Options tiny;
  tiny.workspace_bytes = 1 << 20;
  try {
    plan_step(published, DType::BF16, tiny, other, &bf16_output);
    FAIL() << "planned in 1 MiB";
  } catch (const InputError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("1048576 bytes cannot hold one token row"), std::string::npos) << message;
  }
}

// A deferred weight finish (fused.h: DeviceCall::defer_weight_finish) where grad_W accumulates in the hi/lo pair,
// and nowhere else: f16 and f32 inputs, a device without the sm_90a kernels, an fp32 output, H % 8 != 0, the
// low-memory schedule, a frozen LM head and the forward keep the whole step. A caller's workspace holds the plan's
// workspace, then the accumulator (lo of the pair, unless the caller gives it); the deferred targets and
// coefficients (12 bytes a row) fit inside grad_x's bytes, which they share.
TEST(CudaPlan, OnlyTheHiLoPairDefersItsLastWeightGemm) {
  const StepPlan plan = plan_step(published, DType::BF16, Options{}, hopper, &bf16_output);
  EXPECT_TRUE(plan.defers_weight_finish());
  EXPECT_EQ(plan.accumulator_offset() % 256, 0);
  EXPECT_GE(plan.accumulator_offset(), plan.workspace_bytes);
  EXPECT_EQ(plan.caller_workspace_bytes(), plan.accumulator_offset() + published.V * published.H * 2);
  const GradientOutputs with_lo{.grad_weight_16bit = true, .grad_weight_lo = true};
  const StepPlan caller_lo = plan_step(published, DType::BF16, Options{}, hopper, &with_lo);
  EXPECT_TRUE(caller_lo.defers_weight_finish());
  EXPECT_EQ(caller_lo.caller_workspace_bytes(), caller_lo.accumulator_offset()) << "lo is the caller's own buffer";
  const auto grad_x = std::find_if(plan.regions.begin(), plan.regions.end(),
                                   [](const Region& r) { return r.name.starts_with("grad_x rows"); });
  const auto targets = std::find_if(plan.regions.begin(), plan.regions.end(),
                                    [](const Region& r) { return r.name.starts_with("deferred weight finish"); });
  ASSERT_NE(grad_x, plan.regions.end());
  ASSERT_NE(targets, plan.regions.end());
  EXPECT_EQ(targets->shares_with, grad_x->name);
  EXPECT_EQ(targets->bytes, plan.schedule.max_rows() * 12);
  EXPECT_GE(targets->offset, grad_x->offset);
  EXPECT_LE(targets->offset + targets->bytes, grad_x->offset + grad_x->bytes);

  Options small;
  small.workspace_bytes = min_workspace_bytes;
  Options forward;
  forward.gradients = false;
  const GradientOutputs frozen_weight{.grad_x = true};
  const struct {
    const char* what;
    StepPlan plan;
  } whole_steps[] = {
      {"f16 inputs", plan_step(published, DType::F16, Options{}, hopper, &bf16_output)},
      {"f32 inputs", plan_step(published, DType::F32, Options{}, hopper, &f32_output)},
      {"no sm_90a kernels", plan_step(published, DType::BF16, Options{}, other, &bf16_output)},
      {"an fp32 output", plan_step(published, DType::BF16, Options{}, hopper, &f32_output)},
      {"H % 8 != 0", plan_step({.B = 4, .T = 64, .H = 100, .V = 304}, DType::BF16, Options{}, hopper, &bf16_output)},
      {"the low-memory schedule", plan_step(published, DType::BF16, small, hopper, &bf16_output)},
      {"a frozen LM head", plan_step(published, DType::BF16, Options{}, hopper, &frozen_weight)},
      {"the forward", plan_step(published, DType::BF16, forward, hopper, nullptr)},
  };
  for (const auto& [what, whole] : whole_steps) {
    EXPECT_FALSE(whole.defers_weight_finish()) << what;
    EXPECT_TRUE(std::none_of(whole.regions.begin(), whole.regions.end(),
                             [](const Region& r) { return r.name.starts_with("deferred weight finish"); }))
        << what;
    EXPECT_EQ(whole.caller_workspace_bytes(), whole.accumulator_offset() + whole.accumulator_bytes) << what;
  }
}

// Many shapes, budgets, devices and outputs: whatever the plan chooses stays inside the budget, holds each region
// once and covers every row once.
TEST(CudaPlan, EveryPlanFitsItsBudgetAndHoldsEachRegionOnce) {
  int plans = 0;
  for (const Shape& s : {Shape{.B = 2, .T = 7, .H = 31, .V = 123}, Shape{.B = 4, .T = 64, .H = 96, .V = 300},
                         Shape{.B = 4, .T = 300, .H = 64, .V = 6000}, Shape{.B = 8, .T = 1024, .H = 4096, .V = 32000},
                         published})
    for (const std::int64_t mib : {1, 16, 64, 256, 2048})
      for (const DeviceFeatures& device : {hopper, other})
        for (const GradientOutputs* outputs : {&bf16_output, &f32_output, static_cast<const GradientOutputs*>(nullptr)})
          for (const bool distances : {false, true}) {
            Options options;
            options.workspace_bytes = mib << 20;
            options.gradients = outputs != nullptr;
            options.logit_distances = distances;
            StepPlan plan;
            try {
              plan = plan_step(s, DType::BF16, options, device, outputs);
            } catch (const InputError&) {
              continue;  // a budget below one row (the test above checks the message)
            }
            SCOPED_TRACE(s.to_string() + ", " + std::to_string(mib) + " MiB: " + plan.to_string());
            EXPECT_LE(plan.workspace_bytes, options.workspace_bytes);
            expect_regions_disjoint(plan);
            if (!plan.low_memory) expect_rows_covered(plan, s);
            ++plans;
          }
  EXPECT_GT(plans, 150);
}

}  // namespace
}  // namespace simpo::fused::cuda
