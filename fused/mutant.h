// The verifier's mutation catalogue: deliberate faults of the fused algorithm, one per bug class a peer shipped
// (../shared/ANCHORS.md) plus the verifier's own, each a small marked deviation in the cpu backend. Test-only: the
// product's Options know nothing of them; `simpo-verify mutants`, the `cpu+MUTANT` implementations and the
// mutation tests reach them through compute_mutant.
#pragma once

#include "fused/fused.h"

#include <string>
#include <vector>

namespace simpo::fused {

enum class Mutant {
  none,
  weight_grad_bf16_accumulation,    // grad_weight accumulated across chunks in bf16
  softmax_rounded_before_onehot,    // softmax rounded to bf16 before the one-hot label is subtracted
  narrow_row_accumulator,           // sum of exp accumulated in bf16 (the "wider accumulators" class)
  empty_sequence_nan,               // no check for n[b] = 0: 0/0 in the average
  grad_x_in_input_buffer,           // grad_x partial sums parked in a bf16 buffer between GEMMs
  pairs_split_across_chunks,        // chunks cut by rows: a pair's partner outside the chunk reads as 0
  preference_sign_flip,             // +log sigmoid instead of -log sigmoid
  gamma_inside_beta,                // s = beta * (c - r - gamma) instead of beta * (c - r) - gamma
  chunk_drops_tail,                 // the last partial token chunk is skipped
  chunk_double_counts_tail,         // the last partial token chunk is added twice
  length_counts_ignored,            // n[b] = T: ignored tokens counted in the average's length
  sum_includes_ignored,             // ignored tokens summed into the average, length correct
  pairs_interleaved,                // chosen/rejected read as rows 2i/2i+1 instead of i/P+i
  grad_bias_missing,                // grad_bias left at zero
  label_smoothing_wrong_term,       // ls weights the chosen-wins term instead of the rejected-wins one
  nll_normalized_by_all_positions,  // nll divided by P*T instead of N_c
  lse_without_max_shift,            // log sum exp without subtracting the row max (overflows at large logits)
};
std::string mutant_name(Mutant);
Mutant mutant_from_name(const std::string&);  // throws InputError
const std::vector<Mutant>& all_mutants();     // every value but none

// The cpu backend with `mutant` planted (Mutant::none: cpu::compute itself). Validates first, as every entry point.
TensorMap compute_mutant(const Problem&, const Options&, Mutant);

}  // namespace simpo::fused
