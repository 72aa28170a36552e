// simpo-verify: SPEC's command-line table. Exit codes: 0 passed, 1 a check failed, 2 bad input (with a message
// on stderr naming the problem). Tables go to stdout, progress to stderr.
#include "fixtures/src/fixtures.h"
#include "problem/problem_io.h"
#include "reference/reference.h"
#include "verifier/check.h"
#include "verifier/error_model.h"
#include "verifier/implementation.h"
#include "verifier/peer_report.h"
#include "verifier/properties.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <future>
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

std::int64_t total(const std::map<std::string, std::int64_t>& m) {
  std::int64_t n = 0;
  for (const auto& [k, v] : m) n += v;
  return n;
}

// SPEC: every command that judges takes --reference auto|cpu|cuda (which float64 reference). Given, it becomes
// the reference's default device, so every reference run of the command follows it.
std::string reference_device = "auto";
void add_reference_option(CLI::App* app) {
  app->add_option("--reference", reference_device, "the float64 reference judged against: auto (default: the GPU one where a device is present and the problem "
                  "has at least 2^28 logit multiply-adds, N V H; the CPU one below that, where it is faster), cpu or cuda. "
                  "cpu needs about 16 (N H + V H) + 16 T V bytes of host memory (10.6 GB at the published B = 2, 11.6 GB at "
                  "B = 16); cuda about the same in device memory plus 8 (N H + V H) bytes of host memory for the float64 "
                  "gradients (4.3 GB at B = 2)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
}

// `--capabilities FILE.json` wherever --impl is taken: the declaration the implementation is held to (SPEC
// "External implementations"), read after parsing so a malformed file is exit 2 naming the key.
std::string capabilities_path;
void add_timeout_option(CLI::App* app, sv::ImplementationOptions& options) {
  app->add_option("--case-timeout", options.case_timeout_s,
                  "exec: seconds one case may take before the program is killed and the case fails (default 120)");
  app->add_option("--capabilities", capabilities_path,
                  "FILE.json: what the implementation declares it supports (keys dtypes, bias, label_smoothing, "
                  "empty_sequence, invalid_inputs, max_shape, deterministic; SPEC \"External implementations\"): cases "
                  "outside it are excluded and counted, never failures. For one-shot exec: programs and any --impl; a "
                  "persistent exec: program is otherwise asked through the capabilities handshake");
}

void add_threads_option(CLI::App* app, int& threads) {
  app->add_option("--threads", threads,
                  "cases judged at once, one per thread (default 0: every hardware thread; exec: programs always 1); "
                  "the result of N cases does not depend on it")
      ->check(CLI::Range(0, 4096));
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
  int threads = 0;
  sv::ImplementationOptions impl_options;
};

int run_main_job(const MainJob& job) {
  const sv::Implementation impl = sv::implementation_by_name(job.impl, job.impl_options);
  // Asked before the sweep, not after a minute of it: a binary carried away from its build tree finds no fixtures.
  if (!job.no_fixtures && !std::filesystem::is_directory(job.fixtures_dir))
    throw InputError("the committed fixtures are not at " + job.fixtures_dir +
                     " (this binary's source tree, or SIMPO_FIXTURES_DIR): give --fixtures-dir DIR (fixtures/cases of a "
                     "checkout) or --no-fixtures");
  sv::SweepOptions options;
  options.seed = job.seed;
  options.max_cases = job.cases;
  options.time_budget_s = job.cases > 0 && job.time_budget == 60 ? 0 : job.time_budget;
  options.counterexample_dir = job.counterexample_dir;
  options.threads = job.threads;
  options.progress = [](std::int64_t c, std::int64_t f, double s) { print_progress("sweep", c, f, s); };
  std::fprintf(stderr, "simpo-verify: random sweep of %s against the float64 reference (seed %llu, %s)\n",
               impl.name.c_str(), static_cast<unsigned long long>(job.seed),
               options.max_cases > 0 ? (std::to_string(options.max_cases) + " cases").c_str()
                                     : ("~" + std::to_string(static_cast<int>(job.time_budget)) + " s").c_str());
  if (impl.describe) std::fprintf(stderr, "simpo-verify: %s\n", impl.describe().c_str());
  const sv::SweepResult r = sv::run_sweep(impl, options);
  std::fprintf(stderr, "\n");
  std::cout << sv::format_sweep(r, impl.name) << std::flush;
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
  sv::ImplementationOptions impl_options;
};

int run_compute(const ComputeArgs& a) {
  sv::RunOptions options;
  options.gradients = !a.no_grad;
  options.grad_f32 = a.grad_f32;
  options.workspace_bytes = a.workspace;
  options.max_chunk_rows = a.max_chunk_rows;
  sv::validate(options);  // before any file is read
  const sv::Implementation impl = sv::implementation_by_name(a.impl, a.impl_options);
  simpo::check_writable(a.out, {a.inputs});  // before the minutes a large reference run can take
  const simpo::Problem problem = simpo::load_problem(a.inputs);
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
  double rtol = 0, atol = 0;
  CLI::Option *rtol_option = nullptr, *atol_option = nullptr;
  // One resolution for every command (so --rtol -1 cannot fall back to strict silently).
  sv::Profile resolve() const {
    return sv::profile_from_flags(profile, rtol_option && rtol_option->count() ? &rtol : nullptr,
                                  atol_option && atol_option->count() ? &atol : nullptr);
  }
};

void add_profile_options(CLI::App* app, ProfileArgs& p) {
  app->add_option("--profile", p.profile,
                  "strict (bounds derived from dtypes and shapes, fp32 logits), bf16_logits (the same derivation for logits "
                  "rounded to bf16 before the softmax, as TRL's eager loss and Liger do) or peer (atol = rtol = 5e-3)")
      ->check(CLI::IsMember({"strict", "bf16_logits", "peer"}));
  p.rtol_option = app->add_option("--rtol", p.rtol, "user tolerance: |candidate - exact| <= atol + rtol |exact| (replaces --profile)");
  p.atol_option = app->add_option("--atol", p.atol, "user tolerance, see --rtol");
}

struct CheckArgs {
  std::string inputs, reference_outputs;
  std::vector<std::string> candidates;
  ProfileArgs profile;
  bool json = false, forward_only = false;
};

int run_check(const CheckArgs& a) {
  const sv::Profile profile = a.profile.resolve();
  const simpo::Problem problem = simpo::load_problem(a.inputs);
  std::function<void(double)> progress;
  if (a.reference_outputs.empty() && problem.shape.N() * problem.shape.V > (std::int64_t{1} << 26))
    progress = [](double f) { std::fprintf(stderr, "\rreference: %3.0f%%", 100 * f); };
  // The reference once, for every candidate.
  simpo::reference::OffTargetSoftmax off_target;
  const simpo::TensorMap exact = sv::reference_outputs_for(problem, !a.forward_only, a.reference_outputs, progress, &off_target);
  if (progress) std::fprintf(stderr, "\n");
  sv::ProblemScales scales = sv::ProblemScales::of(problem, &exact, off_target.norm.empty() ? nullptr : &off_target);
  scales.prepare_for(profile, problem, exact);
  bool all_passed = true;
  std::size_t passed_count = 0;
  nlohmann::json documents = nlohmann::json::array();
  for (const auto& candidate : a.candidates) {
    const sv::Report report = sv::check_candidate_file(scales, exact, candidate, profile);
    all_passed = all_passed && report.passed();
    passed_count += report.passed();
    if (a.json) {
      nlohmann::json doc = nlohmann::json::parse(sv::format_json(report));
      doc["candidate"] = candidate;
      documents.push_back(doc);
    } else {
      std::cout << candidate << " vs the reference for " << a.inputs << " (" << problem.shape.to_string() << ")\n"
                << sv::format_table(report) << (a.candidates.size() > 1 ? "\n" : "");
    }
  }
  if (a.json) {
    // One candidate: the report itself (as before); several: {"passed", "candidates": [report, ...]}.
    if (documents.size() == 1)
      std::cout << documents[0].dump(2) << "\n";
    else
      std::cout << nlohmann::json{{"passed", all_passed}, {"inputs", a.inputs}, {"candidates", documents}}.dump(2) << "\n";
  } else if (a.candidates.size() > 1) {
    std::cout << a.candidates.size() << " candidates: " << passed_count << " passed, "
              << a.candidates.size() - passed_count << " failed\n";
  }
  return all_passed ? 0 : 1;
}

struct CaseArgs {
  std::string impl = "auto", save_inputs;
  std::map<std::string, std::string> fields;  // flag -> value, from sv::case_fields()
  bool no_grad = false, grad_f32 = false, json = false;
  int vocab_shards = 0;  // 0: no split
  ProfileArgs profile;
  sv::ImplementationOptions impl_options;
};

// The `case` command's defaults: a small case (the rest are CaseSpec's and SPEC's defaults).
sv::Case default_case() {
  sv::Case c;
  c.spec.shape = {2, 8, 16, 32};
  return c;
}

int run_case(const CaseArgs& a) {
  sv::Case c = default_case();
  sv::apply_case_fields(c, a.fields);
  c.spec.description = "simpo-verify case: " + c.to_string();
  const sv::Profile profile = a.profile.resolve();
  sv::validate(c.run_options());
  const sv::Implementation impl =
      a.vocab_shards > 0
          ? sv::vocab_parallel_implementation(simpo::fused::resolve(simpo::fused::backend_from_name(a.impl)), a.vocab_shards)
          : sv::implementation_by_name(a.impl, a.impl_options);

  std::fprintf(stderr, "case: %s\n", c.to_string().c_str());
  auto start = std::chrono::steady_clock::now();
  const simpo::Problem problem = simpo::generate(c.spec);
  std::fprintf(stderr, "generated inputs in %.2f s\n", seconds_since(start));
  if (!a.save_inputs.empty()) simpo::save_problem(a.save_inputs, problem);

  sv::RunOptions options = c.run_options();
  options.gradients = !a.no_grad;
  options.grad_f32 = a.grad_f32;
  simpo::reference::Options ro;
  simpo::reference::OffTargetSoftmax off_target;
  ro.gradients = !a.no_grad;
  ro.off_target = &off_target;
  ro.progress = [](double f) { std::fprintf(stderr, "\rreference: %3.0f%%", 100 * f); };
  // The candidate and the reference share nothing but the (read-only) problem, so they run at once: on a GPU
  // machine two streams, and each one's uploads and downloads overlap the other's work (the published case:
  // 0.9 s and 1.2 s, one after the other). Each reports its own wall time.
  start = std::chrono::steady_clock::now();
  double reference_s = 0;
  auto reference_run = std::async(std::launch::async, [&] {
    const auto t = std::chrono::steady_clock::now();
    simpo::TensorMap out = simpo::reference::compute(problem, ro);
    reference_s = seconds_since(t);
    return out;
  });
  simpo::TensorMap candidate;
  std::exception_ptr candidate_error;
  try {
    candidate = impl.compute(problem, options);
  } catch (...) {
    candidate_error = std::current_exception();
  }
  const double candidate_s = seconds_since(start);
  if (candidate_error) {
    reference_run.wait();
    std::rethrow_exception(candidate_error);  // the candidate's refusal or fault is what the user asked about
  }
  std::fprintf(stderr, "\n%s: %.3f s\n", impl.name.c_str(), candidate_s);
  const simpo::TensorMap exact = reference_run.get();
  std::fprintf(stderr, "\rreference (%s): %.3f s (both done %.3f s after the start)\n",
               simpo::reference::device_name(simpo::reference::resolve(ro.device, problem.shape)).c_str(), reference_s,
               seconds_since(start));

  start = std::chrono::steady_clock::now();
  sv::ProblemScales scales = sv::ProblemScales::of(problem, &exact, a.no_grad ? nullptr : &off_target);
  scales.prepare_for(profile, problem, exact);
  const sv::Report report = sv::compare(scales, exact, candidate, profile);
  std::fprintf(stderr, "judged in %.3f s\n", seconds_since(start));
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
  int threads = 0;
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
    options.threads = a.threads;
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
  bool stop = false, no_shrink = false, all_profiles = false;
  int threads = 0;
  sv::ImplementationOptions impl_options;
  ProfileArgs profile;
  std::vector<std::string> dtypes;  // input dtypes the cases draw from (empty: bf16)
};

int run_sweep_command(const SweepArgs& a) {
  if (a.cases <= 0 && a.time_budget <= 0) throw InputError("sweep: give --cases or --time-budget");
  const sv::Implementation impl = sv::implementation_by_name(a.impl, a.impl_options);
  sv::SweepOptions options;
  options.seed = a.seed;
  options.max_cases = a.cases;
  options.time_budget_s = a.time_budget;
  options.stop_at_first_failure = a.stop;
  options.shrink = !a.no_shrink;
  options.profile = a.profile.resolve();
  options.counterexample_dir = a.counterexample_dir;
  options.threads = a.threads;
  if (a.all_profiles) options.also_profiles = sv::named_profiles();
  for (const std::string& d : a.dtypes) {
    try {
      options.distribution.dtypes.push_back(simpo::input_dtype_from_name(d));
    } catch (const InputError& e) {
      throw InputError(std::string("--dtypes: ") + e.what());
    }
  }
  options.progress = [](std::int64_t c, std::int64_t f, double s) { print_progress("sweep", c, f, s); };
  const sv::SweepResult r = sv::run_sweep(impl, options);
  std::fprintf(stderr, "\n");
  std::cout << sv::format_sweep(r, impl.name);
  std::printf("worst %s margin by tensor (error / bound, < 1 passes):\n", options.profile.name().c_str());
  for (const auto& [name, m] : r.worst_margin)
    std::printf("  %-22s %.3f%s\n", name.c_str(), m,
                m >= 0.5 && r.worst_margin_case.count(name) ? ("  (" + r.worst_margin_case.at(name).to_string() + ")").c_str() : "");
  std::printf("%lld passed, %lld failed\n", static_cast<long long>(total(r.passed)), static_cast<long long>(total(r.failed)));
  return r.failures.empty() ? 0 : 1;
}

// ---- report ----
struct ReportArgs {
  std::vector<std::string> impls;
  std::vector<std::string> fixed;  // "B,T,H,V"
  std::uint64_t seed = sv::SweepOptions{}.seed;
  std::int64_t cases = 200;
  std::string out = "simpo-peer-report";
  bool no_shrink = false;
  int threads = 0;
  sv::ImplementationOptions impl_options;
};

int run_report(const ReportArgs& a) {
  if (a.cases <= 0) throw InputError("report: --cases must be > 0");
  sv::PeerReportOptions options;
  options.sweep.seed = a.seed;
  options.sweep.max_cases = a.cases;
  options.sweep.time_budget_s = 0;
  options.sweep.threads = a.threads;
  options.shrink = !a.no_shrink;
  for (const std::string& f : a.fixed) {
    simpo::Shape s;
    if (std::sscanf(f.c_str(), "%ld,%ld,%ld,%ld", &s.B, &s.T, &s.H, &s.V) != 4)
      throw InputError("--fixed \"" + f + "\": expected B,T,H,V (e.g. 2,1024,4096,128256)");
    simpo::validate_shape(s);
    options.fixed.push_back(s);
  }
  std::vector<sv::Implementation> impls;
  for (const std::string& name : a.impls) impls.push_back(sv::implementation_by_name(name, a.impl_options));
  options.sweep.progress = [](std::int64_t c, std::int64_t f, double s) { print_progress("report", c, f, s); };
  const auto results = sv::run_peer_report(impls, options);
  std::fprintf(stderr, "\n");
  const std::string markdown = sv::format_peer_markdown(results, options);
  simpo::check_writable(a.out + ".md", {});
  std::ofstream(a.out + ".md") << markdown;
  std::ofstream(a.out + ".json") << sv::format_peer_json(results, options);
  std::cout << markdown;
  std::fprintf(stderr, "wrote %s.md and %s.json\n", a.out.c_str(), a.out.c_str());
  return 0;
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
  app.add_option("--impl", job.impl, "implementation: auto, cpu, cuda, reference, exec:COMMAND");
  add_timeout_option(&app, job.impl_options);
  add_reference_option(&app);
  app.add_option("--fixtures-dir", job.fixtures_dir, "committed fixtures");
  app.add_option("--counterexample-dir", job.counterexample_dir, "where failing cases' inputs files go");
  app.add_flag("--no-fixtures", job.no_fixtures, "skip the committed fixtures");
  add_threads_option(&app, job.threads);

  ComputeArgs compute;
  auto* c = app.add_subcommand("compute", "run one implementation on an inputs file and write an outputs file");
  c->add_option("--impl", compute.impl, "reference, reference-cuda, cpu, cuda, cpu+<mutant>, exec:COMMAND")->required();
  add_timeout_option(c, compute.impl_options);
  c->add_option("--inputs", compute.inputs, "inputs safetensors file")->required();
  c->add_option("--out", compute.out, "outputs safetensors file to write")->required();
  c->add_flag("--no-grad", compute.no_grad, "forward only: loss and auxiliary outputs");
  c->add_option("--workspace", compute.workspace, "fused: workspace budget in bytes");
  c->add_flag("--grad-f32", compute.grad_f32, "fused: grad_weight and grad_bias in F32");
  c->add_option("--max-chunk-rows", compute.max_chunk_rows, "fused: cap on token rows per chunk (0: the budget decides)");

  CheckArgs check;
  auto* k = app.add_subcommand("check", "judge any implementation's outputs file against the reference");
  k->add_option("--inputs", check.inputs, "inputs safetensors file")->required();
  k->add_option("--candidate", check.candidates, "a candidate's outputs safetensors file (repeat it: the reference runs once)")->required();
  k->add_option("--reference-outputs", check.reference_outputs,
                "the reference's outputs for these inputs, already on disk (a fixture's, or compute --impl reference's)");
  add_profile_options(k, check.profile);
  add_reference_option(k);
  k->add_flag("--json", check.json, "JSON report for CI");
  k->add_flag("--forward-only", check.forward_only, "expect no gradients (a --no-grad candidate)");

  CaseArgs cs;
  auto* g = app.add_subcommand("case", "one generated case of any size: per-tensor errors and timings");
  // The case's fields, from the one list that also writes the description and the replay command.
  for (const auto& field : sv::case_fields()) {
    const std::string flag = field.flag;
    if (field.is_switch)
      g->add_flag_callback(flag, [&cs, flag] { cs.fields[flag] = ""; }, field.help);
    else
      g->add_option_function<std::string>(flag, [&cs, flag](const std::string& v) { cs.fields[flag] = v; }, field.help)
          ->type_name(field.real ? "FLOAT" : flag == "--ignore-pattern" || flag == "--empty-sequence" ? "NAME" : "INT");
  }
  g->add_option("--impl", cs.impl, "implementation: auto, cpu, cuda, reference, cpu+<mutant>, exec:COMMAND");
  add_timeout_option(g, cs.impl_options);
  add_reference_option(g);
  g->add_flag("--grad-f32", cs.grad_f32, "fused: grad_weight and grad_bias in F32");
  g->add_flag("--no-grad", cs.no_grad, "forward only");
  g->add_option("--save-inputs", cs.save_inputs, "also write the generated inputs file here");
  g->add_flag("--json", cs.json, "JSON report");
  g->add_option("--vocab-shards", cs.vocab_shards,
                "split the LM head by vocabulary rows over G ranks (Megatron's vocab-parallel layout), gather the ranks' "
                "outputs and judge them; --impl cpu runs the G ranks in one process; --impl cuda runs one GPU per rank through "
                "NCCL when there are G GPUs, else all G on one GPU with in-process collectives (the report names which)")
      ->check(CLI::Range(1, 1 << 20));
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
  m->add_option("--backend", mutants.backend, "cpu (the mutants are planted in the cpu backend: fused/mutant.h)");
  m->add_option("--mutant", mutants.only, "only this mutant");
  m->add_flag("--no-shrink", mutants.no_shrink, "report the first failing case as found");
  add_threads_option(m, mutants.threads);

  SweepArgs sweep;
  auto* s = app.add_subcommand("sweep", "a random sweep of one implementation (e.g. 10,000 cases on a correct one)");
  s->add_option("--impl", sweep.impl, "implementation: auto, cpu, cuda, reference, cpu+<mutant>, exec:COMMAND");
  add_timeout_option(s, sweep.impl_options);
  add_reference_option(s);
  s->add_option("--seed", sweep.seed, "sweep seed");
  s->add_option("--cases", sweep.cases, "case count");
  s->add_option("--time-budget", sweep.time_budget, "seconds");
  add_threads_option(s, sweep.threads);
  s->add_option("--counterexample-dir", sweep.counterexample_dir, "where failing cases' inputs files go");
  s->add_flag("--stop-at-first-failure", sweep.stop);
  s->add_flag("--no-shrink", sweep.no_shrink, "report failing cases as found");
  s->add_flag("--all-profiles", sweep.all_profiles,
              "also judge every case's outputs under every named profile (strict, bf16_logits, peer): one row per profile");
  s->add_option("--dtypes", sweep.dtypes, "input dtypes the cases draw from, uniformly: bf16, f16, f32 (default bf16)")
      ->delimiter(',');
  add_profile_options(s, sweep.profile);

  ReportArgs report;
  auto* rp = app.add_subcommand("report", "the peer report: several implementations on the same case stream, judged under every "
                                          "profile (strict, bf16_logits, peer), with exclusions, determinism, time per case and "
                                          "each first disagreement shrunk; markdown and JSON");
  rp->add_option("--impl", report.impls, "an implementation (repeat it): cpu, cuda, exec:COMMAND, ...")->required();
  add_timeout_option(rp, report.impl_options);
  add_reference_option(rp);
  rp->add_option("--seed", report.seed, "sweep seed (the same stream for every implementation)");
  rp->add_option("--cases", report.cases, "cases per implementation (default 200)");
  rp->add_option("--fixed", report.fixed, "B,T,H,V: also judge this shape once (repeat it; the published case is 2,1024,4096,128256)");
  rp->add_option("--out", report.out, "writes OUT.md and OUT.json (default simpo-peer-report)");
  rp->add_flag("--no-shrink", report.no_shrink, "report first failures as found");
  add_threads_option(rp, report.threads);

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
    // auto stays auto (each problem picks by size, reference.h); cuda where it cannot run is an error now, not later.
    const simpo::reference::Device reference = simpo::reference::device_from_name(reference_device);
    if (reference == simpo::reference::Device::cuda) simpo::reference::resolve(reference);
    simpo::reference::set_default_device(reference);
    if (!capabilities_path.empty()) {
      const sv::Capabilities declared = sv::capabilities_from_file(capabilities_path);
      for (sv::ImplementationOptions* o : {&job.impl_options, &compute.impl_options, &cs.impl_options, &sweep.impl_options, &report.impl_options})
        o->capabilities = declared;
    }
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
    if (*rp) return run_report(report);
    return run_main_job(job);
  } catch (const InputError& e) {
    std::fprintf(stderr, "simpo-verify: error: %s\n", e.what());
    return 2;
  } catch (const sv::ImplementationFault& e) {  // compute --impl exec: the program failed to give a result
    std::fprintf(stderr, "simpo-verify: error: %s\n", e.what());
    return 2;
  } catch (const std::filesystem::filesystem_error& e) {  // an unwritable --out or directory: the caller's input
    std::fprintf(stderr, "simpo-verify: error: %s\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {  // memory is asked for before large allocations; this is what slipped past
    std::fprintf(stderr, "simpo-verify: error: out of host memory (std::bad_alloc): the run needs more memory than "
                         "this machine gives it\n");
    return 2;
  } catch (const std::exception& e) {  // never an abort: any other failure is reported with its message
    std::fprintf(stderr, "simpo-verify: error: %s\n", e.what());
    return 2;
  }
}
