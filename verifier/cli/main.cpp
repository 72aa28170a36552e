// simpo-verify: SPEC's command-line table. Exit codes: 0 passed, 1 a check failed, 2 bad input (with a message
// on stderr naming the problem). Tables go to stdout, progress to stderr.
#include "fixtures/fixtures.h"
#include "problem/problem_io.h"
#include "reference/reference.h"
#include "verifier/error_model.h"
#include "verifier/implementation.h"
#include "verifier/properties.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>

namespace sv = simpo::verifier;
using simpo::InputError;

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void print_progress(const char* what, std::int64_t cases, std::int64_t failures, double seconds) {
  std::fprintf(stderr, "\r%s: %lld cases, %lld failures, %.0f s   ", what, static_cast<long long>(cases),
               static_cast<long long>(failures), seconds);
  std::fflush(stderr);
}

// The per-property table of a sweep and its counterexamples; returns the failure count.
std::int64_t print_sweep(const sv::SweepResult& r, const std::string& impl) {
  std::printf("%-34s %10s %8s\n", ("sweep: " + impl).c_str(), "passed", "failed");
  std::int64_t failed = 0;
  for (const auto& p : sv::all_properties()) {
    const std::int64_t ok = r.passed.count(p.name) ? r.passed.at(p.name) : 0;
    const std::int64_t bad = r.failed.count(p.name) ? r.failed.at(p.name) : 0;
    failed += bad;
    std::printf("  %-32s %10lld %8lld\n", p.name.c_str(), static_cast<long long>(ok), static_cast<long long>(bad));
  }
  std::printf("  (%lld cases in %.1f s)\n", static_cast<long long>(r.cases), r.seconds);
  for (const auto& ce : r.failures) {
    std::printf("FAILED %s on case %lld: %s\n  shrunk: %s\n", ce.outcome.property.c_str(),
                static_cast<long long>(ce.case_index), ce.outcome.detail.c_str(), ce.shrunk.to_string().c_str());
    if (!ce.inputs_path.empty()) std::printf("  inputs: %s\n", ce.inputs_path.c_str());
    std::printf("  replay:\n%s\n", ce.replay.c_str());
  }
  return failed;
}

std::int64_t total(const std::map<std::string, std::int64_t>& m) {
  std::int64_t n = 0;
  for (const auto& [k, v] : m) n += v;
  return n;
}

// ---- main job ----
struct MainJob {
  std::uint64_t seed = sv::SweepOptions{}.seed;
  std::int64_t cases = 0;
  double time_budget = 60;
  std::string impl = "auto";
  std::string fixtures_dir = simpo::fixtures::default_directory();
  std::string counterexample_dir = "simpo-counterexamples";
  bool no_fixtures = false;
};

int run_main_job(const MainJob& job) {
  const sv::Implementation impl = sv::implementation_by_name(job.impl);
  sv::SweepOptions options;
  options.seed = job.seed;
  options.max_cases = job.cases;
  options.time_budget_s = job.cases > 0 && job.time_budget == 60 ? 0 : job.time_budget;
  options.counterexample_dir = job.counterexample_dir;
  options.progress = [](std::int64_t c, std::int64_t f, double s) { print_progress("sweep", c, f, s); };
  std::fprintf(stderr, "simpo-verify: random sweep of %s against the float64 reference (seed %llu, %s)\n",
               impl.name.c_str(), static_cast<unsigned long long>(job.seed),
               options.max_cases > 0 ? (std::to_string(options.max_cases) + " cases").c_str()
                                     : ("~" + std::to_string(static_cast<int>(job.time_budget)) + " s").c_str());
  const sv::SweepResult r = sv::run_sweep(impl, options);
  std::fprintf(stderr, "\n");
  print_sweep(r, impl.name);
  std::int64_t passed = total(r.passed), failed = total(r.failed);

  if (!job.no_fixtures) {
    std::printf("%-34s %10s %8s  %s\n", ("fixtures: " + impl.name).c_str(), "worst", "verdict", "");
    for (const auto& f : simpo::fixtures::catalog()) {
      std::string verdict, detail;
      double margin = 0;
      try {
        const simpo::Problem problem = simpo::load_problem(simpo::fixtures::inputs_path(job.fixtures_dir, f.name));
        const simpo::TensorMap exact = simpo::load_outputs(simpo::fixtures::reference_path(job.fixtures_dir, f.name));
        const sv::Report report = sv::compare(problem, exact, impl.compute(problem, sv::RunOptions{}), sv::strict_profile());
        margin = report.worst_margin();
        verdict = report.passed() ? "passed" : "FAILED";
        if (!report.passed())
          for (const auto& t : report.tensors)
            if (t.verdict != sv::Verdict::passed) {
              detail = t.name + ": " + t.reason;
              break;
            }
      } catch (const std::exception& e) {
        verdict = "FAILED";
        detail = e.what();
      }
      (verdict == "passed" ? passed : failed)++;
      std::printf("  %-32s %10.3f %8s  %s\n", f.name.c_str(), margin, verdict.c_str(), detail.c_str());
    }
    std::printf("  (worst = largest error / strict bound over the outputs; < 1 passes)\n");
  }
  std::printf("%lld passed, %lld failed\n", static_cast<long long>(passed), static_cast<long long>(failed));
  return failed > 0 ? 1 : 0;
}

// ---- compute ----
struct ComputeArgs {
  std::string impl, inputs, out;
  bool no_grad = false, grad_f32 = false;
  std::int64_t workspace = simpo::fused::default_workspace_bytes, max_chunk_rows = 0;
};

int run_compute(const ComputeArgs& a) {
  const sv::Implementation impl = sv::implementation_by_name(a.impl);
  simpo::check_writable(a.out, {a.inputs});  // before the minutes a large reference run can take
  const simpo::Problem problem = simpo::load_problem(a.inputs);
  sv::RunOptions options;
  options.gradients = !a.no_grad;
  options.grad_f32 = a.grad_f32;
  options.workspace_bytes = a.workspace;
  options.max_chunk_rows = a.max_chunk_rows;
  const auto start = std::chrono::steady_clock::now();
  const simpo::TensorMap outputs = impl.compute(problem, options);
  const double seconds = seconds_since(start);
  simpo::save_outputs(a.out, outputs, {{"implementation", impl.name}, {"inputs", a.inputs}}, {a.inputs});
  std::fprintf(stderr, "%s: %s in %.3f s -> %s\n", impl.name.c_str(), problem.shape.to_string().c_str(), seconds,
               a.out.c_str());
  return 0;
}

// ---- check / case: profile flags ----
struct ProfileArgs {
  std::string profile = "strict";
  double rtol = -1, atol = -1;
  sv::Profile resolve() const {
    if (rtol >= 0 || atol >= 0) return sv::user_profile(std::max(rtol, 0.0), std::max(atol, 0.0));
    return sv::profile_from_name(profile);
  }
};

void add_profile_options(CLI::App* app, ProfileArgs& p) {
  app->add_option("--profile", p.profile, "strict (bounds derived from dtypes and shapes) or peer (atol = rtol = 5e-3)")
      ->check(CLI::IsMember({"strict", "peer"}));
  app->add_option("--rtol", p.rtol, "user tolerance: |candidate - exact| <= atol + rtol |exact| (replaces --profile)");
  app->add_option("--atol", p.atol, "user tolerance, see --rtol");
}

struct CheckArgs {
  std::string inputs, candidate;
  ProfileArgs profile;
  bool json = false, forward_only = false;
};

int run_check(const CheckArgs& a) {
  const sv::Profile profile = a.profile.resolve();
  const simpo::Problem problem = simpo::load_problem(a.inputs);
  const simpo::TensorMap candidate = simpo::load_outputs(a.candidate);
  simpo::reference::Options ro;
  ro.gradients = !a.forward_only;
  if (problem.shape.N() * problem.shape.V > (std::int64_t{1} << 26))
    ro.progress = [](double f) { std::fprintf(stderr, "\rreference: %3.0f%%", 100 * f); };
  const simpo::TensorMap exact = simpo::reference::compute(problem, ro);
  if (ro.progress) std::fprintf(stderr, "\n");
  const sv::Report report = sv::compare(problem, exact, candidate, profile);
  if (a.json)
    std::cout << sv::format_json(report);
  else
    std::cout << a.candidate << " vs the reference for " << a.inputs << " (" << problem.shape.to_string() << ")\n"
              << sv::format_table(report);
  return report.passed() ? 0 : 1;
}

struct CaseArgs {
  std::int64_t B = 2, T = 8, H = 16, V = 32;
  std::uint64_t seed = 0;
  std::string impl = "auto", ignore_pattern = "prompt_prefix", empty_sequence = "error", save_inputs;
  bool bias = false, no_nll = false, no_grad = false, grad_f32 = false, json = false;
  double beta = 0.1, gamma = 0.5, alpha = 1.0, label_smoothing = 0.0, grad_scale = 1.0, logit_scale = 2.0;
  std::int64_t ignore_index = -100, workspace = simpo::fused::default_workspace_bytes, max_chunk_rows = 0;
  ProfileArgs profile;
};

int run_case(const CaseArgs& a) {
  sv::Case c;
  c.spec.shape = {a.B, a.T, a.H, a.V};
  c.spec.seed = a.seed;
  c.spec.bias = a.bias;
  c.spec.logit_scale = a.logit_scale;
  c.spec.ignore = simpo::ignore_pattern_from_name(a.ignore_pattern);
  c.spec.hp.beta = a.beta;
  c.spec.hp.gamma = a.gamma;
  c.spec.hp.alpha = a.alpha;
  c.spec.hp.label_smoothing = a.label_smoothing;
  c.spec.hp.compute_nll_loss = !a.no_nll;
  c.spec.hp.ignore_index = a.ignore_index;
  c.spec.hp.grad_scale = a.grad_scale;
  c.spec.hp.empty_sequence = a.empty_sequence == "zero" ? simpo::EmptySequence::zero : simpo::EmptySequence::error;
  c.max_chunk_rows = a.max_chunk_rows;
  c.workspace_bytes = a.workspace;
  c.spec.description = "simpo-verify case: " + c.to_string();
  const sv::Profile profile = a.profile.resolve();
  const sv::Implementation impl = sv::implementation_by_name(a.impl);

  std::fprintf(stderr, "case: %s\n", c.to_string().c_str());
  auto start = std::chrono::steady_clock::now();
  const simpo::Problem problem = simpo::generate(c.spec);
  std::fprintf(stderr, "generated inputs in %.2f s\n", seconds_since(start));
  if (!a.save_inputs.empty()) simpo::save_problem(a.save_inputs, problem);

  sv::RunOptions options = c.run_options();
  options.gradients = !a.no_grad;
  options.grad_f32 = a.grad_f32;
  start = std::chrono::steady_clock::now();
  const simpo::TensorMap candidate = impl.compute(problem, options);
  const double candidate_s = seconds_since(start);
  std::fprintf(stderr, "%s: %.3f s\n", impl.name.c_str(), candidate_s);

  simpo::reference::Options ro;
  ro.gradients = !a.no_grad;
  ro.progress = [](double f) { std::fprintf(stderr, "\rreference: %3.0f%%", 100 * f); };
  start = std::chrono::steady_clock::now();
  const simpo::TensorMap exact = simpo::reference::compute(problem, ro);
  const double reference_s = seconds_since(start);
  std::fprintf(stderr, "\rreference: %.3f s\n", reference_s);

  const sv::Report report = sv::compare(problem, exact, candidate, profile);
  if (a.json) {
    std::cout << sv::format_json(report);
  } else {
    std::cout << problem.shape.to_string() << "  " << impl.name << " " << candidate_s << " s, reference " << reference_s
              << " s\n"
              << sv::format_table(report);
  }
  return report.passed() ? 0 : 1;
}

// ---- mutants ----
struct MutantArgs {
  std::uint64_t seed = sv::SweepOptions{}.seed;
  std::int64_t cases = 400;
  double time_budget = 60;
  std::string backend = "cpu", only;
  bool no_shrink = false;
};

int run_mutants(const MutantArgs& a) {
  const simpo::fused::Backend backend = simpo::fused::resolve(simpo::fused::backend_from_name(a.backend));
  std::vector<simpo::fused::Mutant> mutants = simpo::fused::all_mutants();
  if (!a.only.empty()) mutants = {simpo::fused::mutant_from_name(a.only)};
  std::printf("%-32s %-7s %-20s %6s  %s\n", "mutant", "killed", "by property", "cases", "shrunk counterexample");
  int survivors = 0;
  for (const auto m : mutants) {
    const sv::Implementation impl = sv::fused_implementation(backend, m);
    sv::SweepOptions options;
    options.seed = a.seed;
    options.max_cases = a.cases;
    options.time_budget_s = a.time_budget;
    options.stop_at_first_failure = true;
    options.shrink = !a.no_shrink;
    std::fprintf(stderr, "mutant %s ...\n", simpo::fused::mutant_name(m).c_str());
    const sv::SweepResult r = sv::run_sweep(impl, options);
    if (r.failures.empty()) {
      ++survivors;
      std::printf("%-32s %-7s %-20s %6lld  %s\n", simpo::fused::mutant_name(m).c_str(), "NO", "-",
                  static_cast<long long>(r.cases), "-");
    } else {
      const auto& ce = r.failures.front();
      std::printf("%-32s %-7s %-20s %6lld  %s\n", simpo::fused::mutant_name(m).c_str(), "yes",
                  ce.outcome.property.c_str(), static_cast<long long>(ce.case_index + 1), ce.shrunk.to_string().c_str());
      std::printf("%-32s %-7s %-20s %6s    %s\n", "", "", "", "", ce.outcome.detail.substr(0, 160).c_str());
    }
  }
  std::printf("%zu mutants: %zu killed, %d survived\n", mutants.size(), mutants.size() - survivors, survivors);
  return survivors > 0 ? 1 : 0;
}

// ---- sweep ----
struct SweepArgs {
  std::uint64_t seed = sv::SweepOptions{}.seed;
  std::int64_t cases = 0;
  double time_budget = 0;
  std::string impl = "auto", counterexample_dir = "simpo-counterexamples";
  bool stop = false;
};

int run_sweep_command(const SweepArgs& a) {
  if (a.cases <= 0 && a.time_budget <= 0) throw InputError("sweep: give --cases or --time-budget");
  const sv::Implementation impl = sv::implementation_by_name(a.impl);
  sv::SweepOptions options;
  options.seed = a.seed;
  options.max_cases = a.cases;
  options.time_budget_s = a.time_budget;
  options.stop_at_first_failure = a.stop;
  options.counterexample_dir = a.counterexample_dir;
  options.progress = [](std::int64_t c, std::int64_t f, double s) { print_progress("sweep", c, f, s); };
  const sv::SweepResult r = sv::run_sweep(impl, options);
  std::fprintf(stderr, "\n");
  print_sweep(r, impl.name);
  std::printf("worst strict margin by tensor (error / bound, < 1 passes):\n");
  for (const auto& [name, m] : r.worst_margin) std::printf("  %-22s %.3f\n", name.c_str(), m);
  std::printf("%lld passed, %lld failed\n", static_cast<long long>(total(r.passed)), static_cast<long long>(total(r.failed)));
  return r.failures.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"simpo-verify: checks that an implementation of the fused linear + SimPO loss computes SPEC's\n"
               "function to the precision its dtypes allow. With no subcommand: a bounded random sweep of the best\n"
               "available fused backend against the float64 reference, plus the committed fixtures."};
  app.require_subcommand(0, 1);

  MainJob job;
  app.add_option("--seed", job.seed, "sweep seed");
  app.add_option("--cases", job.cases, "stop after this many cases (default: the time budget decides)");
  app.add_option("--time-budget", job.time_budget, "sweep seconds (default 60)");
  app.add_option("--impl", job.impl, "implementation: auto, cpu, cuda, reference");
  app.add_option("--fixtures-dir", job.fixtures_dir, "committed fixtures");
  app.add_option("--counterexample-dir", job.counterexample_dir, "where failing cases' inputs files go");
  app.add_flag("--no-fixtures", job.no_fixtures, "skip the committed fixtures");

  ComputeArgs compute;
  auto* c = app.add_subcommand("compute", "run one implementation on an inputs file and write an outputs file");
  c->add_option("--impl", compute.impl, "reference, cpu, cuda (or <backend>+<mutant>)")->required();
  c->add_option("--inputs", compute.inputs, "inputs safetensors file")->required();
  c->add_option("--out", compute.out, "outputs safetensors file to write")->required();
  c->add_flag("--no-grad", compute.no_grad, "forward only: loss and auxiliary outputs");
  c->add_option("--workspace", compute.workspace, "fused: workspace budget in bytes");
  c->add_flag("--grad-f32", compute.grad_f32, "fused: grad_weight and grad_bias in F32");
  c->add_option("--max-chunk-rows", compute.max_chunk_rows, "fused: cap on token rows per chunk (0: the budget decides)");

  CheckArgs check;
  auto* k = app.add_subcommand("check", "judge any implementation's outputs file against the reference");
  k->add_option("--inputs", check.inputs, "inputs safetensors file")->required();
  k->add_option("--candidate", check.candidate, "the candidate's outputs safetensors file")->required();
  add_profile_options(k, check.profile);
  k->add_flag("--json", check.json, "JSON report for CI");
  k->add_flag("--forward-only", check.forward_only, "expect no gradients (a --no-grad candidate)");

  CaseArgs cs;
  auto* g = app.add_subcommand("case", "one generated case of any size: per-tensor errors and timings");
  g->add_option("--B", cs.B, "sequences (even)");
  g->add_option("--T", cs.T, "tokens per sequence");
  g->add_option("--H", cs.H, "hidden size");
  g->add_option("--V", cs.V, "vocabulary size");
  g->add_option("--seed", cs.seed, "generator seed");
  g->add_option("--impl", cs.impl, "implementation: auto, cpu, cuda, reference, <backend>+<mutant>");
  g->add_flag("--bias", cs.bias, "with an LM-head bias");
  g->add_option("--beta", cs.beta);
  g->add_option("--gamma", cs.gamma);
  g->add_option("--alpha", cs.alpha);
  g->add_option("--label-smoothing", cs.label_smoothing);
  g->add_flag("--no-nll", cs.no_nll, "compute_nll_loss = false");
  g->add_option("--ignore-index", cs.ignore_index);
  g->add_option("--grad-scale", cs.grad_scale);
  g->add_option("--empty-sequence", cs.empty_sequence, "error or zero")->check(CLI::IsMember({"error", "zero"}));
  g->add_option("--ignore-pattern", cs.ignore_pattern, "none, random, prompt_prefix, all_but_one, empty_sequence");
  g->add_option("--logit-scale", cs.logit_scale, "standard deviation of the logits");
  g->add_option("--max-chunk-rows", cs.max_chunk_rows, "fused: cap on token rows per chunk");
  g->add_option("--workspace", cs.workspace, "fused: workspace budget in bytes");
  g->add_flag("--grad-f32", cs.grad_f32, "fused: grad_weight and grad_bias in F32");
  g->add_flag("--no-grad", cs.no_grad, "forward only");
  g->add_option("--save-inputs", cs.save_inputs, "also write the generated inputs file here");
  g->add_flag("--json", cs.json, "JSON report");
  add_profile_options(g, cs.profile);

  std::string fixtures_dir = simpo::fixtures::default_directory();
  auto* f = app.add_subcommand("fixtures", "the golden fixtures: regenerate them from their seeds, or verify the committed ones");
  f->require_subcommand(1);
  auto* fr = f->add_subcommand("regenerate", "rewrite every fixture file from the catalogue");
  auto* fv = f->add_subcommand("verify", "regenerate in memory and compare with the committed bytes");
  for (auto* sub : {fr, fv}) sub->add_option("--dir", fixtures_dir, "fixtures directory");

  MutantArgs mutants;
  auto* m = app.add_subcommand("mutants", "run the sweep against every fault-injected mutant of the fused backend");
  m->add_option("--seed", mutants.seed, "sweep seed");
  m->add_option("--cases", mutants.cases, "case budget per mutant");
  m->add_option("--time-budget", mutants.time_budget, "seconds per mutant");
  m->add_option("--backend", mutants.backend, "cpu or cuda");
  m->add_option("--mutant", mutants.only, "only this mutant");
  m->add_flag("--no-shrink", mutants.no_shrink, "report the first failing case as found");

  SweepArgs sweep;
  auto* s = app.add_subcommand("sweep", "a random sweep of one implementation (e.g. 10,000 cases on a correct one)");
  s->add_option("--impl", sweep.impl, "implementation");
  s->add_option("--seed", sweep.seed, "sweep seed");
  s->add_option("--cases", sweep.cases, "case count");
  s->add_option("--time-budget", sweep.time_budget, "seconds");
  s->add_option("--counterexample-dir", sweep.counterexample_dir, "where failing cases' inputs files go");
  s->add_flag("--stop-at-first-failure", sweep.stop);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);  // prints the message on stderr
    return 2;
  }

  try {
    if (*c) return run_compute(compute);
    if (*k) return run_check(check);
    if (*g) return run_case(cs);
    if (*fr) {
      simpo::fixtures::regenerate(fixtures_dir, [](const std::string& n) { std::fprintf(stderr, "fixture %s\n", n.c_str()); });
      std::printf("regenerated %zu fixtures in %s\n", simpo::fixtures::catalog().size(), fixtures_dir.c_str());
      return 0;
    }
    if (*fv) {
      const auto results = simpo::fixtures::verify(fixtures_dir);
      std::size_t failed = 0;
      for (const auto& r : results) {
        std::printf("  %-32s %-7s %s\n", r.name.c_str(), r.passed ? "passed" : "FAILED", r.message.c_str());
        failed += !r.passed;
      }
      // A stale file adds a result beyond the catalogue, so count results, not catalogue entries.
      std::printf("%zu passed, %zu failed\n", results.size() - failed, failed);
      return failed ? 1 : 0;
    }
    if (*m) return run_mutants(mutants);
    if (*s) return run_sweep_command(sweep);
    return run_main_job(job);
  } catch (const InputError& e) {
    std::fprintf(stderr, "simpo-verify: error: %s\n", e.what());
    return 2;
  } catch (const std::filesystem::filesystem_error& e) {  // an unwritable --out or directory: the caller's input
    std::fprintf(stderr, "simpo-verify: error: %s\n", e.what());
    return 2;
  }
}
