// The names of Backend and Mutant values (CLI flags, tables, error messages). In simpo_fused_common so the
// cuda backend can name a mutant without linking the dispatcher.
#include "fused/fused.h"
#include "fused/mutant.h"

#include <utility>

namespace simpo::fused {

std::string backend_name(Backend backend) {
  switch (backend) {
    case Backend::automatic: return "auto";
    case Backend::cpu: return "cpu";
    case Backend::cuda: return "cuda";
  }
  return "?";
}

Backend backend_from_name(const std::string& name) {
  for (Backend b : {Backend::automatic, Backend::cpu, Backend::cuda})
    if (backend_name(b) == name) return b;
  throw InputError("unknown fused backend \"" + name + "\" (expected auto, cpu or cuda)");
}

namespace {
// One table, so name -> value and value -> name cannot disagree.
const std::vector<std::pair<Mutant, const char*>>& mutant_table() {
  static const std::vector<std::pair<Mutant, const char*>> table = {
      {Mutant::none, "none"},
      {Mutant::weight_grad_bf16_accumulation, "weight_grad_bf16_accumulation"},
      {Mutant::softmax_rounded_before_onehot, "softmax_rounded_before_onehot"},
      {Mutant::narrow_row_accumulator, "narrow_row_accumulator"},
      {Mutant::empty_sequence_nan, "empty_sequence_nan"},
      {Mutant::grad_x_in_input_buffer, "grad_x_in_input_buffer"},
      {Mutant::pairs_split_across_chunks, "pairs_split_across_chunks"},
      {Mutant::preference_sign_flip, "preference_sign_flip"},
      {Mutant::gamma_inside_beta, "gamma_inside_beta"},
      {Mutant::chunk_drops_tail, "chunk_drops_tail"},
      {Mutant::chunk_double_counts_tail, "chunk_double_counts_tail"},
      {Mutant::length_counts_ignored, "length_counts_ignored"},
      {Mutant::sum_includes_ignored, "sum_includes_ignored"},
      {Mutant::pairs_interleaved, "pairs_interleaved"},
      {Mutant::grad_bias_missing, "grad_bias_missing"},
      {Mutant::label_smoothing_wrong_term, "label_smoothing_wrong_term"},
      {Mutant::nll_normalized_by_all_positions, "nll_normalized_by_all_positions"},
      {Mutant::lse_without_max_shift, "lse_without_max_shift"},
  };
  return table;
}
}  // namespace

std::string mutant_name(Mutant mutant) {
  for (const auto& [m, name] : mutant_table())
    if (m == mutant) return name;
  return "?";
}

Mutant mutant_from_name(const std::string& name) {
  for (const auto& [m, n] : mutant_table())
    if (n == name) return m;
  std::string known;
  for (const auto& [m, n] : mutant_table()) known += (known.empty() ? "" : ", ") + std::string(n);
  throw InputError("unknown mutant \"" + name + "\" (expected one of: " + known + ")");
}

const std::vector<Mutant>& all_mutants() {
  static const std::vector<Mutant> mutants = [] {
    std::vector<Mutant> v;
    for (const auto& [m, name] : mutant_table())
      if (m != Mutant::none) v.push_back(m);
    return v;
  }();
  return mutants;
}

}  // namespace simpo::fused
