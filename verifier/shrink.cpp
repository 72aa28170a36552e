#include "verifier/shrink.h"

#include "verifier/properties.h"

#include <chrono>

namespace simpo::verifier {

Case shrink(const Case& failing, const Implementation& impl, const std::string& property, int max_attempts,
            double max_seconds, const Profile& profile) {
  const auto start = std::chrono::steady_clock::now();
  auto out_of_time = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > max_seconds;
  };
  auto fails = [&](const Case& c) {
    try {
      validate_shape(c.spec.shape);
      const auto outcomes = check_case(c, impl, {property}, false, profile);
      return !outcomes.empty() && !outcomes.back().passed;
    } catch (const std::exception&) {
      return false;
    }
  };
  Case best = failing;
  int attempts = 0;
  bool progress = true;
  while (progress && attempts < max_attempts && !out_of_time()) {
    progress = false;
    std::vector<Case> candidates;
    auto with = [&](auto&& change) {
      Case c = best;
      change(c);
      if (c.to_string() != best.to_string()) candidates.push_back(c);
    };
    Shape& s0 = best.spec.shape;
    for (std::int64_t P : {std::int64_t{1}, s0.P() / 2, s0.P() - 1})
      if (P >= 1 && P < s0.P()) with([P](Case& c) { c.spec.shape.B = 2 * P; });
    for (std::int64_t T : {std::int64_t{1}, s0.T / 2, s0.T - 1})
      if (T >= 1 && T < s0.T) with([T](Case& c) { c.spec.shape.T = T; });
    for (std::int64_t H : {std::int64_t{1}, s0.H / 2, s0.H - 1})
      if (H >= 1 && H < s0.H) with([H](Case& c) { c.spec.shape.H = H; });
    for (std::int64_t V : {std::int64_t{1}, std::int64_t{2}, s0.V / 2, s0.V - 1})
      if (V >= 1 && V < s0.V) with([V](Case& c) { c.spec.shape.V = V; });
    with([](Case& c) { c.spec.bias = false; });
    with([](Case& c) { c.spec.ignore = IgnorePattern::none; });
    if (impl.takes_chunking) {
      with([](Case& c) { c.max_chunk_rows = 0; });
      if (best.max_chunk_rows > 1) with([](Case& c) { c.max_chunk_rows /= 2; });
      with([](Case& c) { c.workspace_bytes = fused::default_workspace_bytes; });
    }
    const Hyperparameters defaults;
    with([&](Case& c) { c.spec.hp.beta = defaults.beta; });
    with([&](Case& c) { c.spec.hp.gamma = defaults.gamma; });
    with([&](Case& c) { c.spec.hp.alpha = defaults.alpha; });
    with([&](Case& c) { c.spec.hp.label_smoothing = defaults.label_smoothing; });
    with([&](Case& c) { c.spec.hp.compute_nll_loss = defaults.compute_nll_loss; });
    with([&](Case& c) { c.spec.hp.grad_scale = defaults.grad_scale; });
    with([&](Case& c) { c.spec.hp.ignore_index = defaults.ignore_index; });
    with([&](Case& c) { c.spec.hp.empty_sequence = defaults.empty_sequence; });
    with([](Case& c) { c.spec.logit_scale = 2.0; });
    for (std::uint64_t seed : {0, 1, 2}) with([seed](Case& c) { c.spec.seed = seed; });
    for (const Case& c : candidates) {
      if (attempts >= max_attempts || out_of_time()) break;
      ++attempts;
      if (fails(c)) {
        best = c;
        progress = true;
        break;
      }
    }
  }
  best.spec.description = "shrunk counterexample: " + best.to_string();
  return best;
}

}  // namespace simpo::verifier
