#include "verifier/properties.h"

#include <algorithm>
#include <map>
#include <cmath>
#include <cstdio>

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
  d.target.clear();
  p.x.visit([&](const auto& x) {
    std::remove_cvref_t<decltype(x)> dx;
    for (int half = 0; half < 2; ++half)        // chosen block, then rejected block
      for (int copy = 0; copy < 2; ++copy)
        for (std::int64_t i = 0; i < s.P(); ++i) {
          const std::size_t b = static_cast<std::size_t>(half * s.P() + i);
          dx.insert(dx.end(), x.begin() + static_cast<std::ptrdiff_t>(b * row_x),
                    x.begin() + static_cast<std::ptrdiff_t>((b + 1) * row_x));
          d.target.insert(d.target.end(), p.target.begin() + static_cast<std::ptrdiff_t>(b * row_t),
                          p.target.begin() + static_cast<std::ptrdiff_t>((b + 1) * row_t));
        }
    d.x = std::move(dx);
  });
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
  if (run.judged_as_nan_convention()) {  // declared: NaN outputs where SPEC errors (the peers' convention)
    const TensorMap* out = nullptr;
    try {
      out = &run.candidate();
    } catch (const InputError& e) {
      if (run.declared().declares_empty_sequence("error")) return pass(name);  // both declared: SPEC's refusal is one
      return fail(name, run.implementation().name + " declares the nan convention for a sequence with no completion token (" +
                            run.spec_error() + ") but refused the input: " + e.what());
    }
    const auto loss = out->find(output_name::loss);
    if (loss == out->end() || loss->second.numel() != 1)
      return fail(name, run.implementation().name + " declares the nan convention but returned no scalar loss for an empty sequence");
    if (!std::isnan(loss->second.value(0)))
      return fail(name, run.implementation().name + " declares the nan convention for a sequence with no completion token (" +
                            run.spec_error() + ") but its loss is " + num(loss->second.value(0)));
    return pass(name);
  }
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
  Report report = compare(run.scales_for(run.profile()), run.exact(), run.candidate(), run.profile());
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

// Two runs on the same inputs and run options, compared bit for bit. Declared deterministic: any difference
// fails. Otherwise the difference is a finding, recorded per tensor (CaseRun::spread) for the sweep's report.
Outcome check_deterministic(CaseRun& run) {
  const std::string name = "deterministic";
  if (run.spec_rejects()) return pass(name);
  const TensorMap& first = run.candidate();
  const TensorMap again = run.run(run.problem(), run.test_case().run_options());
  std::map<std::string, CaseRun::Spread> spread;
  std::string first_difference;
  for (const auto& [n, a] : first) {
    const auto it = again.find(n);
    if (it == again.end()) {
      if (first_difference.empty()) first_difference = n + " present in the first run only";
      continue;
    }
    const Tensor& b = it->second;
    CaseRun::Spread d;
    if (a.dtype != b.dtype || a.shape != b.shape) {
      if (first_difference.empty()) first_difference = n + ": dtype or shape differs between runs";
      d.elements_differing = std::max(a.numel(), b.numel());
      d.max_abs = d.rel = INFINITY;
      spread[n] = d;
      continue;
    }
    if (a.bytes == b.bytes) {
      spread[n] = d;
      continue;
    }
    const std::size_t size = dtype_size(a.dtype);
    double diff_sq = 0, a_sq = 0;
    for (std::int64_t i = 0; i < a.numel(); ++i) {
      const double x = a.value(i), y = b.value(i);
      a_sq += x * x;
      const bool same_bits = std::equal(a.bytes.begin() + static_cast<std::ptrdiff_t>(i * size), a.bytes.begin() + static_cast<std::ptrdiff_t>((i + 1) * size),
                                        b.bytes.begin() + static_cast<std::ptrdiff_t>(i * size));
      if (same_bits) continue;
      if (d.elements_differing++ == 0 && first_difference.empty())
        first_difference = n + index_string(i, a.shape) + ": " + num(x) + " then " + num(y);
      const double diff = std::isnan(x) && std::isnan(y) ? 0.0 : std::fabs(x - y);
      d.max_abs = std::max(d.max_abs, std::isnan(diff) ? INFINITY : diff);
      diff_sq += diff * diff;
    }
    d.rel = a_sq > 0 ? std::sqrt(diff_sq / a_sq) : (diff_sq > 0 ? INFINITY : 0.0);
    spread[n] = d;
  }
  for (const auto& [n, b] : again)
    if (!first.count(n) && first_difference.empty()) first_difference = n + " present in the second run only";
  run.spread = std::move(spread);
  if (first_difference.empty()) return pass(name);
  if (run.declared().is_deterministic())
    return fail(name, run.implementation().name + " declares deterministic but two runs on the same inputs differ: " + first_difference);
  Outcome o = pass(name);
  o.detail = "two runs differ (a finding, not a failure: not declared deterministic): " + first_difference;
  return o;
}

}  // namespace

// ---- properties ----

const std::vector<Property>& all_properties() {
  static const std::vector<Property> properties = {
      {"valid_input_agrees", "inputs SPEC rejects are InputErrors, and only those", check_valid_input_agrees},
      {"matches_reference", "every output passes the error model (strict, or the sweep's profile) against the fp64 reference",
       check_matches_reference},
      {"chunking_invariant", "max_chunk_rows and the workspace change nothing beyond fp32 noise",
       check_chunking_invariant, /*needs_chunking=*/true},
      {"ignored_rows_zero", "grad_x rows at ignored positions are exactly zero", check_ignored_rows_zero},
      {"duplicate_pairs", "duplicating every pair keeps the loss and halves each copy's grad_x",
       check_duplicate_pairs},
      {"loss_only_agrees", "the forward-only run gives the full run's forward outputs", check_loss_only_agrees},
      {"deterministic", "two runs on the same inputs give identical bits (required where declared; else the spread is reported)",
       check_deterministic},
  };
  return properties;
}

const Property& property_by_name(const std::string& name) {
  for (const auto& p : all_properties())
    if (p.name == name) return p;
  throw InputError("unknown property \"" + name + "\"");
}

std::vector<Outcome> check_case(CaseRun& run, const std::vector<std::string>& only, bool stop_at_first_failure) {
  std::vector<Outcome> outcomes;
  if (run.excluded_by()) return outcomes;  // outside the declaration: not judged (the sweep counts it)
  for (const auto& p : all_properties()) {
    if (!only.empty() && std::find(only.begin(), only.end(), p.name) == only.end()) continue;
    Outcome o;
    if (p.needs_chunking && !run.implementation().takes_chunking) {
      o = {true, p.name, "needs chunk caps and a workspace budget, which " + run.implementation().name + " cannot be given", true};
    } else {
      try {
        o = p.check(run);
      } catch (const ImplementationFault& e) {  // the external program gave no result: the case ends here
        outcomes.push_back(fail(p.name, e.what()));
        break;
      } catch (const std::exception& e) {  // an InputError the candidate raises on a valid input, or worse
        o = fail(p.name, std::string("threw: ") + e.what());
      }
    }
    outcomes.push_back(o);
    if (!o.passed && stop_at_first_failure) break;
    // An input SPEC rejects has nothing more to check once valid_input_agrees has judged it.
    if (p.name == "valid_input_agrees" && run.spec_rejects()) break;
  }
  return outcomes;
}

std::vector<Outcome> check_case(const Case& c, const Implementation& impl, const std::vector<std::string>& only,
                                bool stop_at_first_failure, const Profile& profile) {
  CaseRun run(c, impl, profile);
  return check_case(run, only, stop_at_first_failure);
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
  // with ||ulp|| <= 2^-7 ||a|| for bf16 outputs (2^-10 for f16, less for f32) among normal numbers. Below the
  // smallest normal the ulp is the subnormal spacing s, absolute: ||ulp|| <= 2^-m ||a|| + s sqrt(n), and a
  // subnormal result halved (duplicate_pairs) or summed in another order is off by up to s itself: + s sqrt(n).
  // s matters for f16 only (2^-24: gradients of 1e-6 are subnormal there); bf16's and f32's are below 1e-38.
  const double D = 2 * gradient_internal_error(scales, name);
  auto mantissa_of = [](DType d) { return d == DType::BF16 ? 7 : d == DType::F16 ? 10 : d == DType::F32 ? 23 : 52; };
  const int mantissa = std::min(mantissa_of(a.dtype), mantissa_of(b.dtype));
  auto subnormal_spacing = [](DType d) {
    return d == DType::F16 ? 0x1.0p-24 : d == DType::BF16 ? 0x1.0p-133 : d == DType::F32 ? 0x1.0p-149 : 0.0;
  };
  const double s = std::max(subnormal_spacing(a.dtype), subnormal_spacing(b.dtype));
  double a_sq = 0, diff_sq = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = a.value(i), y = b.value(i);
    a_sq += x * x;
    diff_sq += (x - y) * (x - y);
  }
  const double root_n = std::sqrt(static_cast<double>(n));
  const double ulp_norm = std::ldexp(1.0, -mantissa) * std::sqrt(a_sq) + s * root_n;
  const double allowed = D + 2 * std::sqrt(ulp_norm * D) + s * root_n;
  if (!(std::sqrt(diff_sq) <= allowed))
    return "||difference|| " + short_num(std::sqrt(diff_sq)) + " > allowed " + short_num(allowed) + " (||a|| " +
           short_num(std::sqrt(a_sq)) + ")";
  return std::nullopt;
}

}  // namespace simpo::verifier
