// A case and the one distribution over cases. The sweep (sweep.h) draws from it with the project's Rng; the
// rapidcheck tests (property_tests/case_generator.h) draw from the same functions through rapidcheck's
// generators, so both explore one space and rapidcheck shrinks each choice toward 0.
//
// The distribution is built from small named pieces (a shape, hyperparameters, an ignore pattern, a logit
// scale, a chunking), and a case's fields are one list (case_fields()) from which the CLI's `case` flags, the
// one-line description and the replay command are all written.
#pragma once

#include "problem/generate.h"
#include "verifier/implementation.h"

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace simpo::verifier {

// A generated case: the problem (a CaseSpec, deterministic in itself) and how the implementation is run.
struct Case {
  CaseSpec spec;
  std::int64_t max_chunk_rows = 0;
  std::int64_t workspace_bytes = fused::default_workspace_bytes;

  RunOptions run_options() const;
  std::string to_string() const;                            // one line: every field of case_fields(), short
  std::string case_command(const std::string& impl) const;  // `simpo-verify case ...` that replays it exactly
};

// One field of a case, as the CLI, the description and the replay command see it.
struct CaseField {
  std::string flag;  // "--beta"
  std::string key;   // "beta", in the description
  std::string help;
  bool is_switch = false;  // a flag without a value: given means the description value `switched`
  std::string switched;    // switches: "on" for --bias, "off" for --no-nll
  std::string hidden;      // the description leaves the field out at this value ("" shows it always)
  bool real = false;       // a double: the description rounds it to 4 digits, the replay command keeps 17
  std::function<std::string(const Case&)> get;              // exact value ("on"/"off" for switches)
  std::function<void(Case&, const std::string&)> set;       // InputError naming the flag on a bad value
};
const std::vector<CaseField>& case_fields();
// Applies flag -> value pairs (value ignored for switches) to `c`, in case_fields() order.
void apply_case_fields(Case& c, const std::map<std::string, std::string>& given);

// Where the distribution's randomness comes from. Every piece asks only these; 0 (uniform() = 0, below() = 0)
// is the choice a shrinker should head for.
class Chooser {
 public:
  virtual ~Chooser() = default;
  virtual double uniform() = 0;                    // [0, 1)
  virtual std::int64_t below(std::int64_t n) = 0;  // [0, n)
  virtual std::uint64_t seed() = 0;                // a generator seed for the problem's tensors
};

class RngChooser : public Chooser {
 public:
  explicit RngChooser(Rng& rng) : rng_(rng) {}
  double uniform() override { return rng_.uniform(); }
  std::int64_t below(std::int64_t n) override { return rng_.below(n); }
  std::uint64_t seed() override { return rng_.next(); }

 private:
  Rng& rng_;
};

// The pieces. Cases stay small (N H V <= 4e6: milliseconds each) and reach the awkward places: primes and
// non-multiples of 8, every hyperparameter over SPEC's range, every ignore pattern, logit scales 0.1..30, chunk
// caps that put boundaries anywhere.
Shape draw_shape(Chooser&);
Hyperparameters draw_hyperparameters(Chooser&, const Shape&);  // ignore_index may fall inside [0, V)
bool draw_bias(Chooser&);
double draw_logit_scale(Chooser&);
IgnorePattern draw_ignore_pattern(Chooser&);
void draw_chunking(Chooser&, std::int64_t N, Case&);  // max_chunk_rows and workspace_bytes
// The inputs' dtype, uniform over `dtypes`: bf16 when empty and no draw at all (nor with one dtype), so a sweep
// that asks for no other dtype draws the stream it always drew. Drawn last in a case, so with several dtypes
// the rest of each case is drawn as before.
DType draw_dtype(Chooser&, const std::vector<DType>& dtypes);

// Narrowings of the distribution for implementations that pay for every distinct shape or hyperparameter value
// (a JIT compiler: torch.compile, Triton). The defaults narrow nothing. Values, bias, logit scale, ignore pattern
// and chunking are drawn as always.
struct CaseDistribution {
  // Non-empty: each case's shape is one of these, picked uniformly (instead of draw_shape).
  std::vector<Shape> shapes;
  // > 0: each case's hyperparameters are one of this many fixed draws per shape (draw_hyperparameters from a
  // seed of the set's index and the shape, so the same sets in every sweep); 0: drawn afresh for every case.
  int hyperparameter_sets = 0;
  // The input dtypes cases draw from (draw_dtype); empty: bf16 only.
  std::vector<DType> dtypes;
};

Case random_case(Chooser&, const CaseDistribution& = {});
Case random_case(Rng&, const CaseDistribution& = {});

}  // namespace simpo::verifier
