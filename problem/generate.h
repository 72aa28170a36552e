// Seeded random problems: one generator for fixtures, property tests, the sweep and `simpo-verify case`, so
// a seed printed anywhere replays everywhere. Portable: splitmix64 and Box-Muller, no std distributions.
#pragma once

#include "problem/problem.h"

#include <cstdint>
#include <string>

namespace simpo {

enum class IgnorePattern {
  none,           // every position is a completion token
  random,         // each position ignored with probability 0.3 (at least one completion token kept per row)
  prompt_prefix,  // each row: a random-length prompt prefix is ignored, the rest is the completion
  all_but_one,    // each row has exactly one completion token
  empty_sequence  // like prompt_prefix, but one sequence has no completion token at all
};
std::string ignore_pattern_name(IgnorePattern);
IgnorePattern ignore_pattern_from_name(const std::string&);  // throws InputError

struct CaseSpec {
  Shape shape;
  Hyperparameters hp;
  bool bias = false;
  double logit_scale = 2.0;  // target standard deviation of the logits (x and weight drawn to give it)
  IgnorePattern ignore = IgnorePattern::prompt_prefix;
  DType dtype = DType::BF16;  // of x, weight and bias: BF16, F16 or F32 (the same draws, rounded to it)
  std::uint64_t seed = 0;
  std::string description;
};

// Deterministic in the spec alone. x ~ N(0,1), weight ~ N(0, logit_scale^2 / H), bias ~ N(0, (logit_scale/4)^2),
// all rounded to the spec's dtype (through float: a bf16 case has the bits it always had); targets uniform in [0, V) with the ignore pattern applied. The problem's `seed`
// metadata records the seed. Throws InputError for a shape validate_shape rejects or a dtype that is not an input
// dtype.
Problem generate(const CaseSpec&);

// splitmix64: the project's one random source.
struct Rng {
  std::uint64_t state;
  explicit Rng(std::uint64_t seed) : state(seed) {}
  std::uint64_t next();
  // As if `draws` calls of next() had been made: splitmix64's state only counts, so this is one multiply.
  void skip(std::uint64_t draws) { state += draws * 0x9E3779B97F4A7C15ull; }
  double uniform();                 // [0, 1)
  double normal();                  // N(0, 1), Box-Muller: two draws of next()
  std::int64_t below(std::int64_t n);  // [0, n)
};

}  // namespace simpo
