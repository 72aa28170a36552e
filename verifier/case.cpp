#include "verifier/case.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace simpo::verifier {

namespace {

// The shortest decimal that reads back as exactly v (replay commands carry exact values, briefly: 0.1, not
// 0.10000000000000001).
std::string num(double v) {
  char buf[40];
  for (int digits = 15; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string short_num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

double parse_real(const std::string& flag, const std::string& s) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end || errno == ERANGE) throw InputError(flag + ": \"" + s + "\" is not a number");
  return v;
}

std::int64_t parse_int(const std::string& flag, const std::string& s) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end || errno == ERANGE) throw InputError(flag + ": \"" + s + "\" is not an integer");
  return v;
}

std::uint64_t parse_seed(const std::string& flag, const std::string& s) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (s.empty() || s[0] == '-' || *end || errno == ERANGE) throw InputError(flag + ": \"" + s + "\" is not a seed (0..2^64-1)");
  return v;
}

CaseField named(std::string flag, std::string key, std::string help, bool is_switch = false, std::string switched = "") {
  CaseField f;
  f.flag = std::move(flag);
  f.key = std::move(key);
  f.help = std::move(help);
  f.is_switch = is_switch;
  f.switched = std::move(switched);
  return f;
}

CaseField real_field(std::string flag, std::string key, std::string help, double Hyperparameters::* hp) {
  CaseField f;
  f.flag = flag;
  f.key = std::move(key);
  f.help = std::move(help);
  f.real = true;
  f.get = [hp](const Case& c) { return num(c.spec.hp.*hp); };
  f.set = [hp, flag](Case& c, const std::string& v) { c.spec.hp.*hp = parse_real(flag, v); };
  return f;
}

CaseField shape_field(std::string flag, std::string key, std::int64_t Shape::* dim, std::string help) {
  CaseField f;
  f.flag = flag;
  f.key = std::move(key);
  f.help = std::move(help);
  f.get = [dim](const Case& c) { return std::to_string(c.spec.shape.*dim); };
  f.set = [dim, flag](Case& c, const std::string& v) { c.spec.shape.*dim = parse_int(flag, v); };
  return f;
}

std::vector<CaseField> make_fields() {
  std::vector<CaseField> fields;
  fields.push_back(shape_field("--B", "B", &Shape::B, "sequences (even: B/2 chosen, B/2 rejected)"));
  fields.push_back(shape_field("--T", "T", &Shape::T, "tokens per sequence"));
  fields.push_back(shape_field("--H", "H", &Shape::H, "hidden size"));
  fields.push_back(shape_field("--V", "V", &Shape::V, "vocabulary size"));
  {
    CaseField f = named("--dtype", "dtype", "dtype of x, weight and bias: bf16, f16 or f32");
    f.hidden = "bf16";  // bf16 cases read and replay as they always did
    f.get = [](const Case& c) { return input_dtype_name(c.spec.dtype); };
    f.set = [](Case& c, const std::string& v) {
      try {
        c.spec.dtype = input_dtype_from_name(v);
      } catch (const InputError& e) {
        throw InputError(std::string("--dtype: ") + e.what());
      }
    };
    fields.push_back(f);
  }
  {
    CaseField f = named("--seed", "seed", "generator seed of the inputs");
    f.get = [](const Case& c) { return std::to_string(c.spec.seed); };
    f.set = [](Case& c, const std::string& v) { c.spec.seed = parse_seed("--seed", v); };
    fields.push_back(f);
  }
  {
    CaseField f = named("--bias", "bias", "with an LM-head bias", true, "on");
    f.get = [](const Case& c) { return std::string(c.spec.bias ? "on" : "off"); };
    f.set = [](Case& c, const std::string&) { c.spec.bias = true; };
    fields.push_back(f);
  }
  {
    CaseField f = named("--logit-scale", "scale", "standard deviation of the logits");
    f.real = true;
    f.get = [](const Case& c) { return num(c.spec.logit_scale); };
    f.set = [](Case& c, const std::string& v) { c.spec.logit_scale = parse_real("--logit-scale", v); };
    fields.push_back(f);
  }
  {
    CaseField f = named("--ignore-pattern", "ignore", "none, random, prompt_prefix, all_but_one or empty_sequence");
    f.get = [](const Case& c) { return ignore_pattern_name(c.spec.ignore); };
    f.set = [](Case& c, const std::string& v) { c.spec.ignore = ignore_pattern_from_name(v); };
    fields.push_back(f);
  }
  fields.push_back(real_field("--beta", "beta", "SimPO beta", &Hyperparameters::beta));
  fields.push_back(real_field("--gamma", "gamma", "SimPO gamma", &Hyperparameters::gamma));
  fields.push_back(real_field("--alpha", "alpha", "weight of the NLL term", &Hyperparameters::alpha));
  fields.push_back(real_field("--label-smoothing", "ls", "label smoothing in [0, 0.5]", &Hyperparameters::label_smoothing));
  {
    CaseField f = named("--no-nll", "nll", "compute_nll_loss = false", true, "off");
    f.get = [](const Case& c) { return std::string(c.spec.hp.compute_nll_loss ? "on" : "off"); };
    f.set = [](Case& c, const std::string&) { c.spec.hp.compute_nll_loss = false; };
    fields.push_back(f);
  }
  {
    CaseField f = named("--ignore-index", "ignore_index", "the target value that marks a non-completion position");
    f.get = [](const Case& c) { return std::to_string(c.spec.hp.ignore_index); };
    f.set = [](Case& c, const std::string& v) { c.spec.hp.ignore_index = parse_int("--ignore-index", v); };
    fields.push_back(f);
  }
  fields.push_back(real_field("--grad-scale", "grad_scale", "upstream gradient of the loss", &Hyperparameters::grad_scale));
  {
    CaseField f = named("--empty-sequence", "empty", "error or zero: a sequence with no completion token");
    f.hidden = "error";
    f.get = [](const Case& c) { return std::string(c.spec.hp.empty_sequence == EmptySequence::zero ? "zero" : "error"); };
    f.set = [](Case& c, const std::string& v) {
      if (v != "error" && v != "zero") throw InputError("--empty-sequence: \"" + v + "\" is not error or zero");
      c.spec.hp.empty_sequence = v == "zero" ? EmptySequence::zero : EmptySequence::error;
    };
    fields.push_back(f);
  }
  {
    CaseField f = named("--max-chunk-rows", "chunk_rows", "cap on token rows per chunk (0: the implementation decides)");
    f.get = [](const Case& c) { return std::to_string(c.max_chunk_rows); };
    f.set = [](Case& c, const std::string& v) { c.max_chunk_rows = parse_int("--max-chunk-rows", v); };
    fields.push_back(f);
  }
  {
    CaseField f = named("--workspace", "workspace", "fused: workspace budget in bytes");
    f.hidden = std::to_string(fused::default_workspace_bytes);
    f.get = [](const Case& c) { return std::to_string(c.workspace_bytes); };
    f.set = [](Case& c, const std::string& v) { c.workspace_bytes = parse_int("--workspace", v); };
    fields.push_back(f);
  }
  return fields;
}

}  // namespace

const std::vector<CaseField>& case_fields() {
  static const std::vector<CaseField> fields = make_fields();
  return fields;
}

void apply_case_fields(Case& c, const std::map<std::string, std::string>& given) {
  for (const auto& f : case_fields())
    if (auto it = given.find(f.flag); it != given.end()) f.set(c, it->second);
}

RunOptions Case::run_options() const {
  RunOptions r;
  r.max_chunk_rows = max_chunk_rows;
  r.workspace_bytes = workspace_bytes;
  return r;
}

std::string Case::to_string() const {
  std::ostringstream os;
  bool first = true;
  for (const auto& f : case_fields()) {
    const std::string v = f.get(*this);
    if (!f.hidden.empty() && v == f.hidden) continue;
    os << (first ? "" : " ") << f.key << "=" << (f.real ? short_num(std::strtod(v.c_str(), nullptr)) : v);
    first = false;
  }
  return os.str();
}

std::string Case::case_command(const std::string& impl) const {
  std::ostringstream os;
  os << "simpo-verify case --impl " << shell_quote(impl);
  for (const auto& f : case_fields()) {
    const std::string v = f.get(*this);
    if (f.is_switch) {
      if (v == f.switched) os << " " << f.flag;
    } else if (f.hidden.empty() || v != f.hidden) {
      os << " " << f.flag << " " << v;
    }
  }
  return os.str();
}

// ---- the distribution ----
// The draw order is the sweep's stream: changing it changes every seeded sweep (and the mutant table).

namespace {
template <class T> T pick(Chooser& ch, std::initializer_list<T> values) {
  return *(values.begin() + ch.below(static_cast<std::int64_t>(values.size())));
}
double log_uniform(Chooser& ch, double lo, double hi) { return lo * std::pow(hi / lo, ch.uniform()); }
}  // namespace

Shape draw_shape(Chooser& ch) {
  Shape s;
  const std::int64_t P = ch.uniform() < 0.2 ? 1 : 1 + ch.below(8);
  s.B = 2 * P;
  const double t_tier = ch.uniform();
  s.T = t_tier < 0.6 ? 1 + ch.below(16) : t_tier < 0.9 ? 17 + ch.below(48) : 65 + ch.below(236);
  // H and V: half from a list of awkward sizes (primes, 1, multiples of 8 +- 1), half uniform.
  s.H = ch.uniform() < 0.5 ? pick<std::int64_t>(ch, {1, 2, 3, 5, 7, 8, 13, 17, 31, 32, 33, 61, 64, 97, 127, 128, 131})
                           : 1 + ch.below(160);
  const double v_tier = ch.uniform();
  s.V = v_tier < 0.4   ? 1 + ch.below(32)
        : v_tier < 0.8 ? 33 + ch.below(480)
                       : pick<std::int64_t>(ch, {509, 1021, 1024, 1031, 2039, 2053, 2999, 3001});
  // Keep each case to a few milliseconds: the reference's work is ~6 N H V flops.
  const std::int64_t max_work = 4'000'000;
  while (s.T > 1 && s.N() * s.H * s.V > max_work) s.T = std::max<std::int64_t>(1, s.T / 2);
  while (s.H > 1 && s.N() * s.H * s.V > max_work) s.H = std::max<std::int64_t>(1, s.H / 2);
  return s;
}

Hyperparameters draw_hyperparameters(Chooser& ch, const Shape& s) {
  Hyperparameters hp;
  hp.beta = ch.uniform() < 0.3 ? 0.1 : log_uniform(ch, 0.01, 10);
  hp.gamma = ch.uniform() < 0.3 ? 0.5 : ch.uniform() < 0.2 ? 0.0 : -3 + 6 * ch.uniform();
  hp.alpha = ch.uniform() < 0.2 ? 0.0 : ch.uniform() < 0.4 ? 1.0 : 2 * ch.uniform();
  hp.label_smoothing = ch.uniform() < 0.5 ? 0.0 : ch.uniform() < 0.2 ? 0.5 : 0.5 * ch.uniform();
  hp.compute_nll_loss = ch.uniform() < 0.8;
  hp.grad_scale = ch.uniform() < 0.5   ? 1.0
                  : ch.uniform() < 0.1 ? 0.0
                                       : (ch.uniform() < 0.5 ? -1 : 1) * log_uniform(ch, 0.01, 100);
  const double ii = ch.uniform();
  hp.ignore_index = ii < 0.8 ? -100 : ii < 0.9 ? -1 - ch.below(1000) : ch.below(s.V);
  hp.empty_sequence = ch.uniform() < 0.15 ? EmptySequence::zero : EmptySequence::error;
  return hp;
}

bool draw_bias(Chooser& ch) { return ch.uniform() < 0.5; }

double draw_logit_scale(Chooser& ch) {
  const double scale = ch.uniform();
  return scale < 0.15 ? 30.0 : scale < 0.25 ? 0.1 : log_uniform(ch, 0.1, 30);
}

IgnorePattern draw_ignore_pattern(Chooser& ch) { return static_cast<IgnorePattern>(ch.below(5)); }

void draw_chunking(Chooser& ch, std::int64_t N, Case& c) {
  // Chunk caps: none, tiny, or a random count that rarely divides N.
  const double chunk = ch.uniform();
  c.max_chunk_rows = chunk < 0.25 ? 0 : chunk < 0.5 ? 1 + ch.below(std::min<std::int64_t>(N, 4)) : 1 + ch.below(N);
  c.workspace_bytes = ch.uniform() < 0.1 ? fused::min_workspace_bytes : fused::default_workspace_bytes;
}

DType draw_dtype(Chooser& ch, const std::vector<DType>& dtypes) {
  if (dtypes.empty()) return DType::BF16;
  if (dtypes.size() == 1) return dtypes[0];
  return dtypes[static_cast<std::size_t>(ch.below(static_cast<std::int64_t>(dtypes.size())))];
}

Case random_case(Chooser& ch, const CaseDistribution& d) {
  Case c;
  CaseSpec& s = c.spec;
  s.seed = ch.seed();
  s.shape = d.shapes.empty() ? draw_shape(ch)
                             : d.shapes[static_cast<std::size_t>(ch.below(static_cast<std::int64_t>(d.shapes.size())))];
  if (d.hyperparameter_sets > 0) {  // set j of this shape, from its own stream: the sweep's seed does not move it
    const auto j = static_cast<std::uint64_t>(ch.below(d.hyperparameter_sets));
    const auto dim = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
    Rng hash(j ^ (dim(s.shape.B) << 48) ^ (dim(s.shape.T) << 32) ^ (dim(s.shape.H) << 16) ^ dim(s.shape.V));
    Rng set_rng(hash.next());  // splitmix's output as the seed: sets of nearby keys do not share a stream
    RngChooser set_chooser(set_rng);
    s.hp = draw_hyperparameters(set_chooser, s.shape);
  } else {
    s.hp = draw_hyperparameters(ch, s.shape);
  }
  s.bias = draw_bias(ch);
  s.logit_scale = draw_logit_scale(ch);
  s.ignore = draw_ignore_pattern(ch);
  draw_chunking(ch, s.shape.N(), c);
  s.dtype = draw_dtype(ch, d.dtypes);
  s.description = "random case: " + c.to_string();
  return c;
}

Case random_case(Rng& rng, const CaseDistribution& d) {
  RngChooser ch(rng);
  return random_case(ch, d);
}

}  // namespace simpo::verifier
