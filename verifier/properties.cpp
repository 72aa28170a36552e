#include "verifier/properties.h"

#include "problem/problem_io.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

namespace simpo::verifier {

namespace {

std::string num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string short_num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

Outcome pass(const std::string& property) { return {true, property, ""}; }
Outcome fail(const std::string& property, std::string detail) { return {false, property, std::move(detail)}; }

// The problem with every pair duplicated: chosen rows [c_0..c_{P-1}, c_0..c_{P-1}], rejected rows likewise.
Problem duplicate_pairs(const Problem& p) {
  const Shape& s = p.shape;
  Problem d = p;
  d.shape.B = 2 * s.B;
  const std::size_t row_x = static_cast<std::size_t>(s.T * s.H), row_t = static_cast<std::size_t>(s.T);
  d.x.clear();
  d.target.clear();
  for (int half = 0; half < 2; ++half)        // chosen block, then rejected block
    for (int copy = 0; copy < 2; ++copy)
      for (std::int64_t i = 0; i < s.P(); ++i) {
        const std::size_t b = static_cast<std::size_t>(half * s.P() + i);
        d.x.insert(d.x.end(), p.x.begin() + static_cast<std::ptrdiff_t>(b * row_x),
                   p.x.begin() + static_cast<std::ptrdiff_t>((b + 1) * row_x));
        d.target.insert(d.target.end(), p.target.begin() + static_cast<std::ptrdiff_t>(b * row_t),
                        p.target.begin() + static_cast<std::ptrdiff_t>((b + 1) * row_t));
      }
  return d;
}

// Row b of the duplicated problem comes from row source_row(b) of the original.
std::int64_t source_row(const Shape& original, std::int64_t b) {
  const std::int64_t P = original.P();
  const std::int64_t half = b / (2 * P), i = (b % (2 * P)) % P;
  return half * P + i;
}

Outcome check_valid_input_agrees(CaseRun& run) {
  const std::string name = "valid_input_agrees";
  bool candidate_rejects = false;
  std::string candidate_error;
  try {
    (void)run.candidate();
  } catch (const InputError& e) {
    candidate_rejects = true;
    candidate_error = e.what();
  }
  if (run.spec_rejects() && !candidate_rejects)
    return fail(name, "SPEC rejects this input (" + run.spec_error() + ") but " + run.implementation().name +
                          " returned outputs");
  if (!run.spec_rejects() && candidate_rejects)
    return fail(name, run.implementation().name + " rejected a valid input: " + candidate_error);
  return pass(name);
}

Outcome check_matches_reference(CaseRun& run) {
  const std::string name = "matches_reference";
  if (run.spec_rejects()) return pass(name);
  Report report = compare(run.scales(), run.exact(), run.candidate(), strict_profile());
  run.strict_report = report;
  if (report.passed()) return pass(name);
  for (const auto& t : report.tensors)
    if (t.verdict != Verdict::passed) return fail(name, t.name + ": " + verdict_name(t.verdict) + ": " + t.reason);
  return fail(name, "no tensors");
}

// Candidate outputs a and b agree to fp32 noise, tensor by tensor (b may be transformed by `expect`).
std::optional<std::string> maps_disagree(const ProblemScales& scales, const TensorMap& a, const TensorMap& b) {
  for (const auto& [n, ta] : a) {
    auto it = b.find(n);
    if (it == b.end()) return n + ": present in one run only";
    if (auto d = disagreement(scales, n, ta, it->second)) return n + ": " + *d;
  }
  for (const auto& [n, tb] : b)
    if (!a.count(n)) return n + ": present in one run only";
  return std::nullopt;
}

Outcome check_chunking_invariant(CaseRun& run) {
  const std::string name = "chunking_invariant";
  if (run.spec_rejects()) return pass(name);
  // Both runs with F32 weight gradients, so only fp32 summation order can differ.
  RunOptions chunked = run.test_case().run_options();
  chunked.grad_f32 = true;
  RunOptions other = chunked;
  const std::int64_t N = run.problem().shape.N();
  other.max_chunk_rows = chunked.max_chunk_rows == 0 ? std::max<std::int64_t>(1, (N + 2) / 3) : 0;
  other.workspace_bytes = fused::default_workspace_bytes;
  const TensorMap a = run.run(run.problem(), chunked), b = run.run(run.problem(), other);
  if (auto d = maps_disagree(run.scales(), a, b))
    return fail(name, "max_chunk_rows " + std::to_string(chunked.max_chunk_rows) + " vs " +
                          std::to_string(other.max_chunk_rows) + ": " + *d);
  return pass(name);
}

Outcome check_ignored_rows_zero(CaseRun& run) {
  const std::string name = "ignored_rows_zero";
  if (run.spec_rejects()) return pass(name);
  const auto it = run.candidate().find(output_name::grad_x);
  if (it == run.candidate().end()) return fail(name, "no grad_x");
  const Shape& s = run.problem().shape;
  if (it->second.numel() != s.N() * s.H) return fail(name, "grad_x has shape " + shape_string(it->second.shape));
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t t = 0; t < s.T; ++t) {
      if (run.problem().is_completion(b, t)) continue;
      for (std::int64_t h = 0; h < s.H; ++h) {
        const double v = it->second.value((b * s.T + t) * s.H + h);
        if (v != 0)
          return fail(name, "grad_x(" + std::to_string(b) + ", " + std::to_string(t) + ", " + std::to_string(h) +
                                ") = " + short_num(v) + " at an ignored position");
      }
    }
  return pass(name);
}

Outcome check_duplicate_pairs(CaseRun& run) {
  const std::string name = "duplicate_pairs";
  if (run.spec_rejects()) return pass(name);
  const Problem& p = run.problem();
  RunOptions options = run.test_case().run_options();
  options.grad_f32 = true;
  const TensorMap once = run.run(p, options);
  const Problem dup = duplicate_pairs(p);
  const TensorMap twice = run.run(dup, options);
  const ProblemScales& scales = run.scales();
  auto get = [&](const TensorMap& m, const char* n) -> const Tensor* {
    auto it = m.find(n);
    return it == m.end() ? nullptr : &it->second;
  };
  // Unchanged: the loss and its parts, the logits means, and the weight and bias gradients (twice the rows,
  // each with half the weight).
  for (const char* n : {output_name::loss, output_name::nll_loss, output_name::chosen_logits_mean,
                        output_name::rejected_logits_mean, output_name::grad_weight, output_name::grad_bias}) {
    const Tensor *a = get(once, n), *b = get(twice, n);
    if (!a && !b) continue;
    if (!a || !b) return fail(name, std::string(n) + " present in one run only");
    if (auto d = disagreement(scales, n, *a, *b)) return fail(name, std::string(n) + " changed: " + *d);
  }
  // Per pair: the duplicated run's pair i and P+i both equal the original pair i.
  for (const char* n : {output_name::chosen_logps, output_name::rejected_logps, output_name::chosen_rewards,
                        output_name::rejected_rewards}) {
    const Tensor *a = get(once, n), *b = get(twice, n);
    if (!a || !b) return fail(name, std::string(n) + " missing");
    const std::int64_t P = a->numel();
    for (int copy = 0; copy < 2; ++copy) {
      Tensor part(DType::F64, a->shape);
      for (std::int64_t i = 0; i < P; ++i) part.as<double>()[static_cast<std::size_t>(i)] = b->value(copy * P + i);
      if (auto d = disagreement(scales, n, *a, part))
        return fail(name, std::string(n) + " copy " + std::to_string(copy) + ": " + *d);
    }
  }
  // grad_x: each copy of row b is half the original row (halving is exact in binary, so the copies keep the
  // original's bf16 rounding up to fp32 noise).
  const Tensor *gx = get(once, output_name::grad_x), *gx2 = get(twice, output_name::grad_x);
  if (!gx || !gx2) return fail(name, "grad_x missing");
  const Shape& s = p.shape;
  const std::int64_t row = s.T * s.H;
  Tensor expected(DType::F64, gx2->shape);
  for (std::int64_t b = 0; b < 2 * s.B; ++b)
    for (std::int64_t i = 0; i < row; ++i)
      expected.as<double>()[static_cast<std::size_t>(b * row + i)] = 0.5 * gx->value(source_row(s, b) * row + i);
  expected.dtype = DType::F64;
  if (auto d = disagreement(scales, output_name::grad_x, expected, *gx2))
    return fail(name, "grad_x copies are not half the original rows: " + *d);
  return pass(name);
}

Outcome check_loss_only_agrees(CaseRun& run) {
  const std::string name = "loss_only_agrees";
  if (run.spec_rejects()) return pass(name);
  RunOptions forward = run.test_case().run_options();
  forward.gradients = false;
  const TensorMap f = run.run(run.problem(), forward);
  for (const auto& [n, t] : f)
    if (is_gradient_output(n)) return fail(name, "the forward-only run returned " + n);
  for (const auto& [n, t] : run.candidate()) {
    if (is_gradient_output(n)) continue;
    auto it = f.find(n);
    if (it == f.end()) return fail(name, n + " missing from the forward-only run");
    if (auto d = disagreement(run.scales(), n, t, it->second)) return fail(name, n + ": " + *d);
  }
  return pass(name);
}

}  // namespace

// ---- Case ----

RunOptions Case::run_options() const {
  RunOptions r;
  r.max_chunk_rows = max_chunk_rows;
  r.workspace_bytes = workspace_bytes;
  return r;
}

std::string Case::to_string() const {
  const auto& hp = spec.hp;
  std::ostringstream os;
  os << spec.shape.to_string() << " seed=" << spec.seed << " bias=" << (spec.bias ? "on" : "off")
     << " scale=" << short_num(spec.logit_scale) << " ignore=" << ignore_pattern_name(spec.ignore)
     << " beta=" << short_num(hp.beta) << " gamma=" << short_num(hp.gamma) << " alpha=" << short_num(hp.alpha)
     << " ls=" << short_num(hp.label_smoothing) << " nll=" << (hp.compute_nll_loss ? "on" : "off")
     << " ignore_index=" << hp.ignore_index << " grad_scale=" << short_num(hp.grad_scale)
     << (hp.empty_sequence == EmptySequence::zero ? " empty=zero" : "") << " chunk_rows=" << max_chunk_rows;
  if (workspace_bytes != fused::default_workspace_bytes) os << " workspace=" << workspace_bytes;
  return os.str();
}

std::string Case::case_command(const std::string& impl) const {
  const auto& hp = spec.hp;
  std::ostringstream os;
  os << "simpo-verify case --impl " << impl << " --B " << spec.shape.B << " --T " << spec.shape.T << " --H "
     << spec.shape.H << " --V " << spec.shape.V << " --seed " << spec.seed << " --logit-scale "
     << num(spec.logit_scale) << " --ignore-pattern " << ignore_pattern_name(spec.ignore) << " --beta "
     << num(hp.beta) << " --gamma " << num(hp.gamma) << " --alpha " << num(hp.alpha) << " --label-smoothing "
     << num(hp.label_smoothing) << " --ignore-index " << hp.ignore_index << " --grad-scale " << num(hp.grad_scale)
     << " --max-chunk-rows " << max_chunk_rows;
  if (spec.bias) os << " --bias";
  if (!hp.compute_nll_loss) os << " --no-nll";
  if (hp.empty_sequence == EmptySequence::zero) os << " --empty-sequence zero";
  if (workspace_bytes != fused::default_workspace_bytes) os << " --workspace " << workspace_bytes;
  return os.str();
}

Case random_case(Rng& rng) {
  auto pick = [&](std::initializer_list<std::int64_t> values) {
    return *(values.begin() + rng.below(static_cast<std::int64_t>(values.size())));
  };
  auto log_uniform = [&](double lo, double hi) { return lo * std::pow(hi / lo, rng.uniform()); };
  Case c;
  CaseSpec& s = c.spec;
  s.seed = rng.next();
  const std::int64_t P = rng.uniform() < 0.2 ? 1 : 1 + rng.below(8);
  s.shape.B = 2 * P;
  const double t_tier = rng.uniform();
  s.shape.T = t_tier < 0.6 ? 1 + rng.below(16) : t_tier < 0.9 ? 17 + rng.below(48) : 65 + rng.below(236);
  // H and V: half from a list of awkward sizes (primes, 1, multiples of 8 +- 1), half uniform.
  s.shape.H = rng.uniform() < 0.5 ? pick({1, 2, 3, 5, 7, 8, 13, 17, 31, 32, 33, 61, 64, 97, 127, 128, 131})
                                  : 1 + rng.below(160);
  const double v_tier = rng.uniform();
  s.shape.V = v_tier < 0.4   ? 1 + rng.below(32)
              : v_tier < 0.8 ? 33 + rng.below(480)
                             : pick({509, 1021, 1024, 1031, 2039, 2053, 2999, 3001});
  // Keep each case to a few milliseconds: the reference's work is ~6 N H V flops.
  const std::int64_t max_work = 4'000'000;
  while (s.shape.T > 1 && s.shape.N() * s.shape.H * s.shape.V > max_work) s.shape.T = std::max<std::int64_t>(1, s.shape.T / 2);
  while (s.shape.H > 1 && s.shape.N() * s.shape.H * s.shape.V > max_work) s.shape.H = std::max<std::int64_t>(1, s.shape.H / 2);

  Hyperparameters& hp = s.hp;
  hp.beta = rng.uniform() < 0.3 ? 0.1 : log_uniform(0.01, 10);
  hp.gamma = rng.uniform() < 0.3 ? 0.5 : rng.uniform() < 0.2 ? 0.0 : -3 + 6 * rng.uniform();
  hp.alpha = rng.uniform() < 0.2 ? 0.0 : rng.uniform() < 0.4 ? 1.0 : 2 * rng.uniform();
  hp.label_smoothing = rng.uniform() < 0.5 ? 0.0 : rng.uniform() < 0.2 ? 0.5 : 0.5 * rng.uniform();
  hp.compute_nll_loss = rng.uniform() < 0.8;
  hp.grad_scale = rng.uniform() < 0.5 ? 1.0 : rng.uniform() < 0.1 ? 0.0 : (rng.uniform() < 0.5 ? -1 : 1) * log_uniform(0.01, 100);
  const double ii = rng.uniform();
  hp.ignore_index = ii < 0.8 ? -100 : ii < 0.9 ? -1 - rng.below(1000) : rng.below(s.shape.V);
  hp.empty_sequence = rng.uniform() < 0.15 ? EmptySequence::zero : EmptySequence::error;
  s.bias = rng.uniform() < 0.5;
  const double scale = rng.uniform();
  s.logit_scale = scale < 0.15 ? 30.0 : scale < 0.25 ? 0.1 : log_uniform(0.1, 30);
  s.ignore = static_cast<IgnorePattern>(rng.below(5));
  // Chunk caps: none, tiny, or a random count that rarely divides N.
  const double chunk = rng.uniform();
  const std::int64_t N = s.shape.N();
  c.max_chunk_rows = chunk < 0.25 ? 0 : chunk < 0.5 ? 1 + rng.below(std::min<std::int64_t>(N, 4)) : 1 + rng.below(N);
  c.workspace_bytes = rng.uniform() < 0.1 ? fused::min_workspace_bytes : fused::default_workspace_bytes;
  s.description = "random case: " + c.to_string();
  return c;
}

// ---- CaseRun ----

CaseRun::CaseRun(const Case& c, const Implementation& impl) : case_(c), impl_(impl) {}

const Problem& CaseRun::problem() {
  if (!problem_) problem_ = generate(case_.spec);
  return *problem_;
}

const ProblemScales& CaseRun::scales() {
  if (!scales_) scales_ = ProblemScales::of(problem(), spec_rejects() ? nullptr : &exact());
  return *scales_;
}

bool CaseRun::spec_rejects() {
  if (!reference_ran_) {
    reference_ran_ = true;
    try {
      exact_ = reference_implementation().compute(problem(), RunOptions{});
    } catch (const InputError& e) {
      spec_error_ = e.what();
    }
  }
  return spec_error_.has_value();
}

const std::string& CaseRun::spec_error() {
  spec_rejects();
  static const std::string none;
  return spec_error_ ? *spec_error_ : none;
}

const TensorMap& CaseRun::exact() {
  if (spec_rejects()) throw std::logic_error("CaseRun::exact on an input SPEC rejects");
  return *exact_;
}

const TensorMap& CaseRun::candidate() {
  if (!candidate_) candidate_ = run(problem(), case_.run_options());
  return *candidate_;
}

TensorMap CaseRun::run(const Problem& p, const RunOptions& options) const { return impl_.compute(p, options); }

// ---- properties ----

const std::vector<Property>& all_properties() {
  static const std::vector<Property> properties = {
      {"valid_input_agrees", "inputs SPEC rejects are InputErrors, and only those", check_valid_input_agrees},
      {"matches_reference", "every output passes the strict error model against the fp64 reference",
       check_matches_reference},
      {"chunking_invariant", "max_chunk_rows and the workspace change nothing beyond fp32 noise",
       check_chunking_invariant},
      {"ignored_rows_zero", "grad_x rows at ignored positions are exactly zero", check_ignored_rows_zero},
      {"duplicate_pairs", "duplicating every pair keeps the loss and halves each copy's grad_x",
       check_duplicate_pairs},
      {"loss_only_agrees", "the forward-only run gives the full run's forward outputs", check_loss_only_agrees},
  };
  return properties;
}

const Property& property_by_name(const std::string& name) {
  for (const auto& p : all_properties())
    if (p.name == name) return p;
  throw InputError("unknown property \"" + name + "\"");
}

std::vector<Outcome> check_case(const Case& c, const Implementation& impl, const std::vector<std::string>& only,
                                bool stop_at_first_failure) {
  CaseRun run(c, impl);
  std::vector<Outcome> outcomes;
  for (const auto& p : all_properties()) {
    if (!only.empty() && std::find(only.begin(), only.end(), p.name) == only.end()) continue;
    Outcome o;
    try {
      o = p.check(run);
    } catch (const std::exception& e) {  // an InputError the candidate raises on a valid input, or worse
      o = fail(p.name, std::string("threw: ") + e.what());
    }
    outcomes.push_back(o);
    if (!o.passed && stop_at_first_failure) break;
    // An input SPEC rejects has nothing more to check once valid_input_agrees has judged it.
    if (p.name == "valid_input_agrees" && run.spec_rejects()) break;
  }
  return outcomes;
}

std::optional<std::string> disagreement(const ProblemScales& scales, const std::string& name, const Tensor& a,
                                        const Tensor& b) {
  if (a.numel() != b.numel())
    return "shapes " + shape_string(a.shape) + " and " + shape_string(b.shape);
  const std::int64_t n = a.numel();
  if (!is_gradient_output(name)) {
    const StrictBounds bounds = strict_bounds(scales, name, a.dtype);
    for (std::int64_t i = 0; i < n; ++i) {
      const double x = a.value(i), y = b.value(i);
      const double allowed = 2 * (bounds.atol + bounds.rtol * std::fabs(x));
      if (!(std::fabs(x - y) <= allowed))
        return "element " + std::to_string(i) + ": " + num(x) + " vs " + num(y) + " (allowed " + short_num(allowed) + ")";
    }
    return std::nullopt;
  }
  // Gradients: two runs may differ by the internal error budget of each (bf16 operand rounding can flip when
  // fp32 noise in a logit moves dz across a rounding boundary; summation order differs), D = 2 x
  // gradient_internal_error. The outputs then round; a pre-rounding difference d_i flips element i by one ulp
  // with probability ~ d_i / ulp_i, so the flips add ||flips||^2 ~ sum ulp_i d_i <= ||ulp|| D (Cauchy-Schwarz),
  // with ||ulp|| <= 2^-7 ||a|| for bf16 outputs (less for f32).
  const double D = 2 * gradient_internal_error(scales, name);
  const int mantissa = a.dtype == DType::BF16 || b.dtype == DType::BF16 ? 7 : a.dtype == DType::F32 || b.dtype == DType::F32 ? 23 : 52;
  double a_sq = 0, diff_sq = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = a.value(i), y = b.value(i);
    a_sq += x * x;
    diff_sq += (x - y) * (x - y);
  }
  const double allowed = D + 2 * std::sqrt(std::ldexp(1.0, -mantissa) * std::sqrt(a_sq) * D);
  if (!(std::sqrt(diff_sq) <= allowed))
    return "||difference|| " + short_num(std::sqrt(diff_sq)) + " > allowed " + short_num(allowed) + " (||a|| " +
           short_num(std::sqrt(a_sq)) + ")";
  return std::nullopt;
}

// ---- shrinking ----

Case shrink(const Case& failing, const Implementation& impl, const std::string& property, int max_attempts) {
  auto fails = [&](const Case& c) {
    try {
      validate_shape(c.spec.shape);
      const auto outcomes = check_case(c, impl, {property});
      return !outcomes.empty() && !outcomes.back().passed;
    } catch (const std::exception&) {
      return false;
    }
  };
  Case best = failing;
  int attempts = 0;
  bool progress = true;
  while (progress && attempts < max_attempts) {
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
    with([](Case& c) { c.max_chunk_rows = 0; });
    if (best.max_chunk_rows > 1) with([](Case& c) { c.max_chunk_rows /= 2; });
    with([](Case& c) { c.workspace_bytes = fused::default_workspace_bytes; });
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
      if (attempts >= max_attempts) break;
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

std::string write_counterexample(const Case& c, const std::string& impl, const std::string& path) {
  Problem p = generate(c.spec);
  p.description = "counterexample for " + impl + ": " + c.to_string();
  if (auto dir = std::filesystem::path(path).parent_path(); !dir.empty()) std::filesystem::create_directories(dir);
  save_problem(path, p);
  std::ostringstream os;
  os << "  " << c.case_command(impl) << "\n"
     << "  simpo-verify compute --impl " << impl << " --inputs " << path << " --out /tmp/candidate.safetensors"
     << " --max-chunk-rows " << c.max_chunk_rows << " --workspace " << c.workspace_bytes
     << " && simpo-verify check --inputs " << path << " --candidate /tmp/candidate.safetensors";
  return os.str();
}

// ---- the sweep ----

SweepResult run_sweep(const Implementation& impl, const SweepOptions& options) {
  if (options.max_cases <= 0 && options.time_budget_s <= 0)
    throw InputError("a sweep needs a case count or a time budget");
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(clock::now() - start).count(); };
  double last_progress = 0;
  SweepResult result;
  Rng rng(options.seed);
  for (std::int64_t i = 0;; ++i) {
    if (options.max_cases > 0 && i >= options.max_cases) break;
    if (options.time_budget_s > 0 && elapsed() >= options.time_budget_s) break;
    const Case c = random_case(rng);
    CaseRun run(c, impl);
    bool any_failed = false;
    for (const auto& p : all_properties()) {
      Outcome o;
      try {
        o = p.check(run);
      } catch (const std::exception& e) {
        o = {false, p.name, std::string("threw: ") + e.what()};
      }
      (o.passed ? result.passed : result.failed)[p.name]++;
      if (o.passed && p.name == "matches_reference" && run.strict_report)
        for (const auto& t : run.strict_report->tensors)
          result.worst_margin[t.name] = std::max(result.worst_margin[t.name], t.margin);
      if (!o.passed) {
        any_failed = true;
        Counterexample ce;
        ce.case_index = i;
        ce.original = c;
        ce.shrunk = options.shrink ? shrink(c, impl, p.name) : c;
        const auto again = check_case(ce.shrunk, impl, {p.name});
        ce.outcome = again.empty() || again.back().passed ? o : again.back();
        if (!options.counterexample_dir.empty()) {
          ce.inputs_path = options.counterexample_dir + "/" + impl.name + "-" + p.name + "-case" + std::to_string(i) +
                           ".inputs.safetensors";
          ce.replay = write_counterexample(ce.shrunk, impl.name, ce.inputs_path);
        } else {
          ce.replay = "  " + ce.shrunk.case_command(impl.name);
        }
        result.failures.push_back(ce);
        if (options.stop_at_first_failure) break;
      }
      if (p.name == "valid_input_agrees" && run.spec_rejects()) break;
    }
    result.cases = i + 1;
    if (options.progress && elapsed() - last_progress >= 1.0) {
      last_progress = elapsed();
      options.progress(result.cases, static_cast<std::int64_t>(result.failures.size()), last_progress);
    }
    if (any_failed && options.stop_at_first_failure) break;
  }
  result.seconds = elapsed();
  return result;
}

}  // namespace simpo::verifier
