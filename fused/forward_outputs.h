// Host code both fused backends share for everything after the row statistics: the per-sequence averages, the
// pair terms, the scalars of SPEC's forward outputs and the per-row gradient coefficient k. Computing these
// in one place (in double; they are O(N) work) makes the cpu and cuda backends' scalars identical given the
// same row statistics, and keeps the mutants of the pair math in one file.
#pragma once

#include "fused/fused.h"
#include "fused/mutant.h"
#include "problem/problem.h"

#include <cstdint>
#include <span>
#include <vector>

namespace simpo::fused {

// What the forward needs from the targets alone, known before any GEMM.
struct Targets {
  std::vector<std::int64_t> n;  // [B] completion tokens of sequence b (the average's length)
  std::int64_t n_chosen = 0;    // N_c: completion tokens of the chosen sequences
  bool ignored_gather_column0 = false;  // Mutant::sum_includes_ignored (see gathered_column)
};
// Mutant::sum_includes_ignored makes ignored rows gather column 0 (counted in sums, not in n);
// Mutant::length_counts_ignored sets n[b] = T. Other mutants do not change the targets.
Targets read_targets(const Problem&, Mutant = Mutant::none);

// The logit column row r gathers and sums: its target, or -1 off the completion (ignore_index).
inline std::int64_t gathered_column(const Problem& problem, const Targets& targets, std::int64_t r) {
  const std::int64_t target = problem.target[static_cast<std::size_t>(r)];
  if (target != problem.hp.ignore_index) return target;
  return targets.ignored_gather_column0 ? 0 : -1;
}

// The per-row statistics the backends compute from each chunk's logits; all the forward needs of them.
// lse and z_target may carry any common per-row offset: only l = z_target - lse is read. The cpu backend
// stores both relative to the row max (lse = log sum exp(z - max), z_target = z_t - max), which keeps l exact
// to fp32 even when the target is the max logit and l is near 0; unshifted values (lse ~ the logits'
// magnitude) lose up to ulp(lse)/2 there, e.g. 4e-6 absolute at logits of 100.
struct RowStats {
  std::vector<float> lse;       // [N] log sum_v exp(z[r, v]) (up to the row's offset), fp32, max-shifted
  std::vector<float> z_target;  // [N] z[r, gathered_column(r)] (same offset; 0 where that is -1)
  std::vector<double> rowsum;   // [N] sum_v z[r, v] (for the *_logits_mean outputs)
  RowStats() = default;
  explicit RowStats(std::int64_t N) : lse(N, 0.f), z_target(N, 0.f), rowsum(N, 0.0) {}
};

// k[r] for every row of the pairs [pair_begin, pair_end) (chosen and rejected sequences); other entries of k
// are left as they are. Needs the row stats of exactly those rows. k is 0 on ignored rows and empty sequences.
// Mutant::pairs_interleaved pairs sequences (2i, 2i+1), so its caller passes all pairs at once.
void row_coefficients(const Problem&, const Targets&, const RowStats&, std::int64_t pair_begin,
                      std::int64_t pair_end, Mutant, std::span<float> k);

// SPEC's forward outputs from all N rows' stats: loss, nll_loss, chosen/rejected_logps, *_logits_mean,
// *_rewards, every one F32.
TensorMap forward_outputs(const Problem&, const Targets&, const RowStats&, Mutant = Mutant::none);

}  // namespace simpo::fused
