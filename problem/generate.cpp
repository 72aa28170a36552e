#include "problem/generate.h"

#include "problem/memory.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <span>

namespace simpo {

namespace {

// out[i] = T(float(scale * normal())) for the next out.size() normals of `rng`, the same bits as the sequential loop,
// on every core: normal() takes two draws, so block j of the array starts from rng skipped 2 * (its offset)
// draws. The published workload's weight is 525M normals (20 s on one core).
template <class T> void fill_normals(Rng& rng, std::span<T> out, double scale) {
  const auto n = static_cast<std::int64_t>(out.size());
  constexpr std::int64_t block = std::int64_t{1} << 16;
  const Rng start = rng;
#pragma omp parallel for schedule(static)
  for (std::int64_t b0 = 0; b0 < n; b0 += block) {
    Rng r = start;
    r.skip(2 * static_cast<std::uint64_t>(b0));
    const std::int64_t b1 = std::min(n, b0 + block);
    for (std::int64_t i = b0; i < b1; ++i) out[static_cast<std::size_t>(i)] = T(static_cast<float>(scale * r.normal()));
  }
  rng.skip(2 * static_cast<std::uint64_t>(n));
}

}  // namespace

std::uint64_t Rng::next() {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

double Rng::normal() {
  const double u1 = 1.0 - uniform();  // (0, 1]: log is finite
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

std::int64_t Rng::below(std::int64_t n) { return static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(n)); }

std::string ignore_pattern_name(IgnorePattern p) {
  switch (p) {
    case IgnorePattern::none: return "none";
    case IgnorePattern::random: return "random";
    case IgnorePattern::prompt_prefix: return "prompt_prefix";
    case IgnorePattern::all_but_one: return "all_but_one";
    case IgnorePattern::empty_sequence: return "empty_sequence";
  }
  return "?";
}

IgnorePattern ignore_pattern_from_name(const std::string& name) {
  for (auto p : {IgnorePattern::none, IgnorePattern::random, IgnorePattern::prompt_prefix, IgnorePattern::all_but_one,
                 IgnorePattern::empty_sequence})
    if (ignore_pattern_name(p) == name) return p;
  throw InputError("unknown ignore pattern \"" + name +
                   "\" (none, random, prompt_prefix, all_but_one, empty_sequence)");
}

Problem generate(const CaseSpec& spec) {
  const Shape& s = spec.shape;
  if (!is_input_dtype(spec.dtype))
    throw InputError("cannot generate " + dtype_name(spec.dtype) + " inputs: SPEC's input dtypes are bf16, f16, f32");
  require_memory(input_bytes(s, spec.bias, spec.dtype), "generating the inputs of " + s.to_string());
  Rng rng(spec.seed);
  Problem p;
  p.shape = s;
  p.hp = spec.hp;
  p.seed = std::to_string(spec.seed);
  p.description = spec.description;

  // Each logit is a sum of H products of unit-variance x and weight of variance scale^2/H: std ~ scale.
  const double w_std = spec.logit_scale / std::sqrt(static_cast<double>(s.H));
  auto inputs = [&]<class T>(T) {
    std::vector<T> x(static_cast<std::size_t>(s.N() * s.H)), weight(static_cast<std::size_t>(s.V * s.H));
    fill_normals<T>(rng, x, 1.0);
    fill_normals<T>(rng, weight, w_std);
    p.x = std::move(x);
    p.weight = std::move(weight);
    if (spec.bias) {
      std::vector<T> bias(static_cast<std::size_t>(s.V));
      fill_normals<T>(rng, bias, spec.logit_scale / 4);
      p.bias = std::move(bias);
    }
  };
  switch (spec.dtype) {
    case DType::F16: inputs(f16()); break;
    case DType::F32: inputs(0.0f); break;
    default: inputs(bf16()); break;
  }

  // Completion targets never equal ignore_index (a custom ignore_index may lie inside [0, V)).
  const std::int64_t ignore = spec.hp.ignore_index;
  const bool ignore_in_vocab = ignore >= 0 && ignore < s.V;
  auto draw_target = [&] {
    if (ignore_in_vocab && s.V == 1) return ignore;
    for (;;) {
      const std::int64_t v = rng.below(s.V);
      if (v != ignore) return v;
    }
  };
  p.target.resize(static_cast<std::size_t>(s.N()));
  for (auto& v : p.target) v = draw_target();

  auto at = [&](std::int64_t b, std::int64_t t) -> std::int64_t& { return p.target[static_cast<std::size_t>(b * s.T + t)]; };
  auto prompt_prefix = [&](std::int64_t b) {
    const std::int64_t prefix = rng.below(s.T);  // 0..T-1: at least one completion token remains
    for (std::int64_t t = 0; t < prefix; ++t) at(b, t) = ignore;
  };
  for (std::int64_t b = 0; b < s.B; ++b) {
    switch (spec.ignore) {
      case IgnorePattern::none: break;
      case IgnorePattern::random: {
        const std::int64_t keep = rng.below(s.T);
        for (std::int64_t t = 0; t < s.T; ++t)
          if (t != keep && rng.uniform() < 0.3) at(b, t) = ignore;
        break;
      }
      case IgnorePattern::prompt_prefix:
      case IgnorePattern::empty_sequence: prompt_prefix(b); break;
      case IgnorePattern::all_but_one: {
        const std::int64_t keep = rng.below(s.T);
        for (std::int64_t t = 0; t < s.T; ++t)
          if (t != keep) at(b, t) = ignore;
        break;
      }
    }
  }
  if (spec.ignore == IgnorePattern::empty_sequence) {
    const std::int64_t b = rng.below(s.B);
    for (std::int64_t t = 0; t < s.T; ++t) at(b, t) = ignore;
  }
  return p;
}

}  // namespace simpo
