#include "fused/forward_outputs.h"

#include "fused/simpo_math.h"

namespace simpo::fused {

Targets read_targets(const Problem& problem, Mutant mutant) {
  const Shape& s = problem.shape;
  Targets t;
  t.n.assign(static_cast<std::size_t>(s.B), 0);
  for (std::int64_t b = 0; b < s.B; ++b) {
    for (std::int64_t i = 0; i < s.T; ++i) {
      const std::int64_t r = b * s.T + i;
      const std::int64_t target = problem.target[static_cast<std::size_t>(r)];
      const bool completion = target != problem.hp.ignore_index;
      if (completion) ++t.n[static_cast<std::size_t>(b)];
    }
    // MUTANT length_counts_ignored: the average divides by T, ignored positions included.
    if (mutant == Mutant::length_counts_ignored) t.n[static_cast<std::size_t>(b)] = s.T;
  }
  // MUTANT sum_includes_ignored: the ignored position is gathered at column 0 and summed (a masked gather
  // whose mask was forgotten in the sum), while the lengths above stay right.
  t.ignored_gather_column0 = mutant == Mutant::sum_includes_ignored;
  for (std::int64_t b = 0; b < s.P(); ++b) t.n_chosen += t.n[static_cast<std::size_t>(b)];
  return t;
}

namespace {

// The sequence and pair quantities of SPEC, in double, with the mutants that deviate from them.
struct PairMath {
  const Problem& problem;
  const Targets& targets;
  const RowStats& stats;
  Mutant mutant;

  std::int64_t P() const { return problem.shape.P(); }

  // sum_t m l over sequence b, in double (l = z_target - lse from the fp32 stats)
  double logprob_sum(std::int64_t b) const {
    double sum = 0;
    for (std::int64_t r = b * problem.shape.T; r < (b + 1) * problem.shape.T; ++r)
      if (gathered_column(problem, targets, r) >= 0)
        sum += static_cast<double>(stats.z_target[static_cast<std::size_t>(r)]) -
               static_cast<double>(stats.lse[static_cast<std::size_t>(r)]);
    return sum;
  }
  double average(std::int64_t b) const {
    const std::int64_t n = targets.n[static_cast<std::size_t>(b)];
    // MUTANT empty_sequence_nan: no guard for n = 0, so an empty sequence averages to 0/0.
    if (mutant == Mutant::empty_sequence_nan) return logprob_sum(b) / static_cast<double>(n);
    return math::sequence_average(logprob_sum(b), n);
  }
  // The sequences pair i compares: (i, P + i); MUTANT pairs_interleaved reads (2i, 2i + 1).
  std::int64_t chosen_of(std::int64_t i) const { return mutant == Mutant::pairs_interleaved ? 2 * i : i; }
  std::int64_t rejected_of(std::int64_t i) const {
    return mutant == Mutant::pairs_interleaved ? 2 * i + 1 : P() + i;
  }
  math::PairTerm<double> pair(std::int64_t i) const {
    const auto& hp = problem.hp;
    double gamma = hp.gamma, ls = hp.label_smoothing;
    // MUTANT gamma_inside_beta: s = beta (c - r - gamma), i.e. gamma scaled by beta.
    if (mutant == Mutant::gamma_inside_beta) gamma = hp.beta * hp.gamma;
    // MUTANT label_smoothing_wrong_term: ls weights the chosen-wins term, 1 - ls the rejected-wins one.
    if (mutant == Mutant::label_smoothing_wrong_term) ls = 1.0 - hp.label_smoothing;
    auto p = math::pair_term(average(chosen_of(i)), average(rejected_of(i)), hp.beta, gamma, ls);
    // MUTANT preference_sign_flip: +log sigmoid instead of -log sigmoid (the loss and its gradient negated).
    if (mutant == Mutant::preference_sign_flip) {
      p.term = -p.term;
      p.dterm = -p.dterm;
    }
    return p;
  }
  // The NLL's denominator: N_c; MUTANT nll_normalized_by_all_positions: every chosen position, P * T.
  double nll_denominator() const {
    if (mutant == Mutant::nll_normalized_by_all_positions)
      return static_cast<double>(P() * problem.shape.T);
    return static_cast<double>(targets.n_chosen);
  }
  // alpha / N_c, the NLL's share of k on chosen completion rows; 0 when the NLL term is off.
  double nll_weight() const {
    const double denominator = nll_denominator();
    if (!problem.hp.compute_nll_loss || denominator == 0) return 0;
    return problem.hp.alpha / denominator;
  }

  void coefficients(std::int64_t pair_begin, std::int64_t pair_end, std::span<float> k) const {
    const auto& hp = problem.hp;
    const std::int64_t T = problem.shape.T;
    for (std::int64_t i = pair_begin; i < pair_end; ++i) {
      const double dterm = pair(i).dterm;
      for (int side = 0; side < 2; ++side) {
        const bool chosen = side == 0;
        const std::int64_t b = chosen ? chosen_of(i) : rejected_of(i);
        const double avg_grad = math::avg_gradient(dterm, hp.beta, P(), chosen);
        // The NLL term belongs to the stacked chosen half b < P whatever the pairing.
        const double nll = b < P() ? nll_weight() : 0.0;
        const std::int64_t n = targets.n[static_cast<std::size_t>(b)];
        for (std::int64_t r = b * T; r < (b + 1) * T; ++r) {
          const bool counted = gathered_column(problem, targets, r) >= 0;
          const double value = math::row_coefficient(hp.grad_scale, counted, avg_grad, n, nll);
          k[static_cast<std::size_t>(r)] = static_cast<float>(value);
        }
      }
    }
  }
};

}  // namespace

void row_coefficients(const Problem& problem, const Targets& targets, const RowStats& stats,
                      std::int64_t pair_begin, std::int64_t pair_end, Mutant mutant, std::span<float> k) {
  PairMath{problem, targets, stats, mutant}.coefficients(pair_begin, pair_end, k);
}

TensorMap forward_outputs(const Problem& problem, const Targets& targets, const RowStats& stats, Mutant mutant) {
  const PairMath math_{problem, targets, stats, mutant};
  const Shape& s = problem.shape;
  const auto& hp = problem.hp;
  const std::int64_t P = s.P();

  std::vector<float> chosen_logps(P), rejected_logps(P), chosen_rewards(P), rejected_rewards(P);
  double pref = 0;
  for (std::int64_t i = 0; i < P; ++i) {
    const double c = math_.average(math_.chosen_of(i)), r = math_.average(math_.rejected_of(i));
    chosen_logps[i] = static_cast<float>(c);
    rejected_logps[i] = static_cast<float>(r);
    chosen_rewards[i] = static_cast<float>(hp.beta * c);
    rejected_rewards[i] = static_cast<float>(hp.beta * r);
    pref += math_.pair(i).term;
  }
  pref /= static_cast<double>(P);

  double nll = 0;
  if (hp.compute_nll_loss && math_.nll_denominator() > 0) {
    double chosen_sum = 0;
    for (std::int64_t b = 0; b < P; ++b) chosen_sum += math_.logprob_sum(b);
    nll = -chosen_sum / math_.nll_denominator();
  }

  // *_logits_mean: every position of the half, ignored ones included (as Liger does).
  double chosen_z = 0, rejected_z = 0;
  for (std::int64_t r = 0; r < s.N(); ++r) (r < P * s.T ? chosen_z : rejected_z) += stats.rowsum[r];
  const double half_elements = static_cast<double>(P) * static_cast<double>(s.T) * static_cast<double>(s.V);

  TensorMap out;
  out[output_name::loss] = Tensor::scalar(static_cast<float>(hp.alpha * nll + pref));
  out[output_name::nll_loss] = Tensor::scalar(static_cast<float>(nll));
  out[output_name::chosen_logps] = Tensor::from<float>({P}, chosen_logps);
  out[output_name::rejected_logps] = Tensor::from<float>({P}, rejected_logps);
  out[output_name::chosen_rewards] = Tensor::from<float>({P}, chosen_rewards);
  out[output_name::rejected_rewards] = Tensor::from<float>({P}, rejected_rewards);
  out[output_name::chosen_logits_mean] = Tensor::scalar(static_cast<float>(chosen_z / half_elements));
  out[output_name::rejected_logits_mean] = Tensor::scalar(static_cast<float>(rejected_z / half_elements));
  return out;
}

}  // namespace simpo::fused
