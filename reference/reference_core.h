// The reference's arithmetic on double inputs. compute() widens the problem's inputs (exactly, any input dtype) and calls this; the
// finite-difference tests call it directly, on inputs perturbed by steps far smaller than any bf16 spacing.
#pragma once

#include "problem/problem.h"
#include "reference/reference.h"

#include <cstdint>
#include <span>
#include <vector>

namespace simpo::reference {

struct DoubleInputs {
  Shape shape;
  Hyperparameters hp;
  std::span<const double> x;             // [B, T, H]
  std::span<const double> weight;        // [V, H]
  std::span<const double> bias;          // [V], or empty: no bias
  std::span<const std::int64_t> target;  // [B, T]
};

// The forward outputs; the rewards are beta times the logps and are formed by compute().
struct ForwardOutputs {
  double loss = 0, nll_loss = 0, chosen_logits_mean = 0, rejected_logits_mean = 0;
  std::vector<double> chosen_logps, rejected_logps;  // [P]
};

// Where the gradients of grad_scale * loss go, each sized like its input (bias: empty without a bias). They are
// overwritten. Leave all three empty when Options::gradients is false.
struct GradientOutputs {
  std::span<double> x, weight, bias;
};

// ---- Shared by the CPU and the CUDA reference: the schedule and the per-pair arithmetic ----
// Only the products and the per-row passes over the logits differ between the two; the rest is this code, so the
// two references compute the same function by construction wherever it is not the logits' arithmetic, and their
// agreement (reference/cuda/tests) tests what differs.

// How the rows are walked. A block is the pairs [first, first + pairs); its rows form two contiguous segments of
// x: chosen rows [first T, (first + pairs) T) and rejected rows [(P + first) T, ...). A piece is a run of rows
// of one segment that goes through the GEMMs together; it lives at row `slot` of the logits buffer.
struct Schedule {
  bool keep_logits;             // every piece of a block in the buffer at once: 3 GEMMs, no recomputation
  std::int64_t pairs_per_block;
  std::int64_t piece_rows;
  std::int64_t buffer_rows;
};
Schedule plan(const Shape&, const Options&);

struct Piece {
  std::int64_t row;   // first global token row (b * T + t)
  std::int64_t rows;
  std::int64_t slot;  // first row in the logits buffer
};
std::vector<Piece> pieces_of_block(const Shape&, const Schedule&, std::int64_t first, std::int64_t pairs);

// The elementary functions of the per-pair terms: libm's, or correctly rounded ones (Options::reproducible).
struct Elementary {
  double (*exp)(double);
  double (*log1p)(double);
  double (*expm1)(double);
};
Elementary elementary(const Options&);

// What the targets decide (n[b], 1/N_c), the numbers each row's logits reduce to, and from a pair's token
// log-probs its averages, preference term and the factor k of dz for each of its rows.
class PairTerms {
 public:
  PairTerms(const Shape&, const Hyperparameters&, std::span<const std::int64_t> target, const Options&);
  bool completion(std::int64_t row) const { return target_[row] != hp_.ignore_index; }
  // Pairs [first, first + pairs), whose rows' logprob are set: their averages, preference terms and k.
  void close_pairs(std::int64_t first, std::int64_t pairs);
  // After every pair is closed and every row's logit_sum set.
  ForwardOutputs finish() const;

  // Per row [N]: log-sum-exp, token log-prob (0 at ignored rows), sum of logits, k (0 at ignored rows).
  std::vector<double> lse, logprob, logit_sum, k;

 private:
  Shape shape_;
  Hyperparameters hp_;
  std::span<const std::int64_t> target_;
  Elementary f_;
  std::vector<std::int64_t> tokens_;  // n[b]
  double nll_weight_;                 // 1/N_c, or 0 without an NLL term or when N_c = 0
  std::vector<double> average_;       // [B]
  double preference_sum_ = 0, chosen_logprob_sum_ = 0;
};

// Precondition: the problem these inputs describe passes simpo::validate (compute() checks it; the tests build
// inputs from validated problems). Only the sizes are checked here (InputError naming the span).
ForwardOutputs compute_core(const DoubleInputs&, const Options&, GradientOutputs = {});

// Every bf16, f16 and f32 value is a float, and every float a double: exact.
std::vector<double> widen(const InputValues&);

}  // namespace simpo::reference
