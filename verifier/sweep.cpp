#include "verifier/sweep.h"

#include "reference/reference.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <optional>
#include <sstream>
#include <thread>  // hardware_concurrency
#include <vector>

#include <omp.h>

namespace simpo::verifier {

namespace {
// The flags that give `check` and `case` the sweep's profile, for replay commands.
std::string profile_flags(const Profile& p) {
  char buf[96];
  switch (p.kind) {
    case ProfileKind::strict: return "";
    case ProfileKind::bf16_logits: return " --profile bf16_logits";
    case ProfileKind::peer: return " --profile peer";
    case ProfileKind::user: std::snprintf(buf, sizeof buf, " --rtol %.17g --atol %.17g", p.rtol, p.atol); return buf;
  }
  return "";
}
}  // namespace

SweepResult run_sweep(const Implementation& impl, const SweepOptions& options) {
  if (options.max_cases <= 0 && options.time_budget_s <= 0)
    throw InputError("a sweep needs a case count or a time budget");
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(clock::now() - start).count(); };
  double last_progress = 0;
  SweepResult result;
  Rng rng(options.seed);
  const int threads = !impl.concurrent ? 1
                      : options.threads > 0 ? options.threads
                                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // Cases per parallel batch. Every thread waits at the end of a batch for its slowest case, so a batch of 2 per
  // thread left most of 16 threads idle behind each large case (the H200 host's main job: 217 cases/s with the cuda
  // backend, 287 with 8 per thread); a long batch overruns the time budget by up to one batch. So: about half a
  // second of cases at the rate measured so far, between 2 and 16 per thread.
  auto batch_size = [&]() -> std::int64_t {
    if (threads == 1) return 1;
    const std::int64_t fewest = 2 * std::int64_t{threads}, most = 16 * std::int64_t{threads};
    const double seconds = elapsed();
    if (result.cases == 0 || seconds <= 0) return fewest;
    return std::clamp(static_cast<std::int64_t>(0.5 * static_cast<double>(result.cases) / seconds), fewest, most);
  };
  struct Judged {
    Case c;
    std::optional<std::string> excluded;
    std::vector<Outcome> outcomes;
    std::optional<Report> strict_report;
    std::optional<std::map<std::string, CaseRun::Spread>> spread;
    std::vector<std::pair<std::string, std::string>> profile_verdicts;  // profile name, "" passed or why it failed
    double candidate_seconds = 0;
  };
  result.declared = impl.declared();  // an exec: program's handshake happens here, before the first case
  std::vector<Profile> profiles = {options.profile};
  for (const Profile& p : options.also_profiles)
    if (std::none_of(profiles.begin(), profiles.end(), [&](const Profile& q) { return q.name() == p.name(); })) profiles.push_back(p);
  for (const Profile& p : profiles) result.by_profile[p.name()];
  // Cases in parallel: each reference product on one thread too, restored however the sweep ends.
  struct ProductThreads {
    int previous = 0;
    explicit ProductThreads(bool parallel) : previous(parallel ? reference::set_cpu_product_threads(1) : 0) {}
    ~ProductThreads() {
      if (previous > 0) reference::set_cpu_product_threads(previous);
    }
  } product_threads(threads > 1);
  std::vector<Judged> batch;
  std::size_t next = 0;  // batch[next] is the next case to account for
  for (std::int64_t i = 0;; ++i) {
    if (options.max_cases > 0 && i >= options.max_cases) break;
    if (next == batch.size()) {  // judge the next batch
      if (options.time_budget_s > 0 && elapsed() >= options.time_budget_s) break;
      const std::int64_t n = options.max_cases > 0 ? std::min(batch_size(), options.max_cases - i) : batch_size();
      batch.assign(static_cast<std::size_t>(n), {});
      for (Judged& j : batch) {
        j.c = random_case(rng, options.distribution);
        if (!impl.takes_chunking) {  // drawn anyway, so every implementation sees the same stream of problems
          j.c.max_chunk_rows = 0;
          j.c.workspace_bytes = fused::default_workspace_bytes;
        }
      }
      auto judge = [&](Judged& j) {
        CaseRun run(j.c, impl, options.profile);
        if ((j.excluded = run.excluded_by())) return;
        j.outcomes = check_case(run, {}, options.stop_at_first_failure);
        j.strict_report = std::move(run.strict_report);
        j.spread = std::move(run.spread);
        j.candidate_seconds = run.candidate_seconds;
        // matches_reference's verdict under every profile, on the outputs it judged (no extra run).
        if (j.strict_report && !run.spec_rejects())
          for (const Profile& p : profiles) {
            const Report report = p.name() == options.profile.name() ? *j.strict_report
                                                                     : compare(run.scales_for(p), run.exact(), run.candidate(), p);
            std::string why;
            if (!report.passed())
              for (const auto& t : report.tensors)
                if (t.verdict != Verdict::passed) {
                  why = t.name + ": " + verdict_name(t.verdict) + ": " + t.reason;
                  break;
                }
            if (report.tensors.empty()) why = "no tensors";
            j.profile_verdicts.emplace_back(p.name(), why);
          }
      };
      if (threads == 1) {
        // One case at a time: a small case still runs on one thread (a machine-wide OpenMP team and BLAS threads
        // for products of a few thousand elements cost more than they save: 9 cases/s on the H200's 16-core host
        // against 397 for the parallel sweep); a large one keeps every core.
        const Shape& shape = batch[0].c.spec.shape;
        const bool small = double(shape.N()) * double(shape.V) * double(shape.H) <= double(std::int64_t{1} << 26);
        const int omp_threads = omp_get_max_threads();
        const ProductThreads one_product_thread(small);
        if (small) omp_set_num_threads(1);
        try {
          judge(batch[0]);
        } catch (...) {
          omp_set_num_threads(omp_threads);
          throw;
        }
        omp_set_num_threads(omp_threads);
      } else {
        // Exceptions other than a property's verdict (check_case catches those) end the sweep, as before. OpenMP's
        // team persists from batch to batch, so per-thread state (reference-cuda's stream and cuBLAS handle) is
        // made once per thread, not once per batch. Inside a case, OpenMP loops run on the case's thread alone
        // (no nested teams: small cases would drown in fork/join and spinning).
        std::vector<std::exception_ptr> errors(batch.size());
        const auto count = static_cast<std::int64_t>(batch.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (std::int64_t k = 0; k < count; ++k) {
          omp_set_num_threads(1);
          try {
            judge(batch[static_cast<std::size_t>(k)]);
          } catch (...) {
            errors[static_cast<std::size_t>(k)] = std::current_exception();
          }
        }
        for (const auto& e : errors)
          if (e) std::rethrow_exception(e);
      }
      next = 0;
    }
    const Case& c = batch[next].c;
    const Judged& judged = batch[next];
    const std::vector<Outcome>& outcomes = batch[next].outcomes;
    const std::optional<Report>& strict_report = batch[next].strict_report;
    ++next;
    result.cases = i + 1;
    if (judged.excluded) {
      result.excluded[*judged.excluded]++;
      continue;
    }
    if (judged.candidate_seconds > 0) {
      result.candidate_seconds += judged.candidate_seconds;
      result.candidate_runs++;
    }
    if (judged.spread)
      for (const auto& [tensor, d] : *judged.spread) {
        SpreadFinding& f = result.spread[tensor];
        f.cases_compared++;
        if (d.elements_differing == 0) continue;
        if (f.cases_differing++ == 0) f.first_case = i;
        f.max_elements_differing = std::max(f.max_elements_differing, d.elements_differing);
        f.max_abs = std::max(f.max_abs, d.max_abs);
        f.max_rel = std::max(f.max_rel, d.rel);
      }
    for (const auto& [pname, why] : judged.profile_verdicts) {
      ProfileTally& tally = result.by_profile[pname];
      if (why.empty()) {
        tally.passed++;
        continue;
      }
      tally.failed++;
      Counterexample ce;
      ce.case_index = i;
      ce.original = ce.shrunk = c;
      ce.outcome = {false, "matches_reference", why};
      if (tally.first_failure.empty()) tally.first_failure.push_back(ce);
      const auto size = [](const Case& k) { return k.spec.shape.N() * k.spec.shape.H * k.spec.shape.V; };
      if (tally.smallest_failure.empty() || size(c) < size(tally.smallest_failure[0].original)) tally.smallest_failure = {ce};
    }
    bool any_failed = false;
    for (const Outcome& o : outcomes) {
      (o.skipped ? result.skipped : o.passed ? result.passed : result.failed)[o.property]++;
      if (o.passed && !o.skipped && o.property == "matches_reference" && strict_report)
        for (const auto& t : strict_report->tensors)
          if (t.margin > result.worst_margin[t.name]) {
            result.worst_margin[t.name] = t.margin;
            result.worst_margin_case[t.name] = c;
          }
      if (o.passed) continue;
      any_failed = true;
      Counterexample ce;
      ce.case_index = i;
      ce.original = c;
      ce.outcome = o;
      if (options.shrink) {  // the outcome on the shrunk case (without shrinking it is o)
        ce.shrunk = shrink(c, impl, o.property, options.shrink_attempts, options.shrink_seconds, options.profile);
        const auto again = check_case(ce.shrunk, impl, {o.property}, false, options.profile);
        if (!again.empty() && !again.back().passed) ce.outcome = again.back();
      } else {
        ce.shrunk = c;
      }
      if (!options.counterexample_dir.empty()) {
        ce.inputs_path = options.counterexample_dir + "/" + file_name_part(impl.name) + "-" + o.property + "-case" +
                         std::to_string(i) + ".inputs.safetensors";
        ce.replay = write_counterexample(ce.shrunk, impl.name, ce.inputs_path, profile_flags(options.profile));
      } else {
        ce.replay = "  " + ce.shrunk.case_command(impl.name) + profile_flags(options.profile);
      }
      result.failures.push_back(ce);
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

std::int64_t SweepResult::excluded_cases() const {
  std::int64_t n = 0;
  for (const auto& [key, count] : excluded) n += count;
  return n;
}

std::string format_sweep(const SweepResult& r, const std::string& impl) {
  auto get = [](const std::map<std::string, std::int64_t>& m, const std::string& k) {
    auto it = m.find(k);
    return static_cast<long long>(it == m.end() ? 0 : it->second);
  };
  std::ostringstream os;
  char line[512];
  std::snprintf(line, sizeof line, "%-34s %10s %8s %8s\n", ("sweep: " + impl).c_str(), "passed", "failed", "skipped");
  os << line;
  std::string skip_note;
  for (const auto& p : all_properties()) {
    std::snprintf(line, sizeof line, "  %-32s %10lld %8lld %8lld\n", p.name.c_str(), get(r.passed, p.name),
                  get(r.failed, p.name), get(r.skipped, p.name));
    os << line;
    if (get(r.skipped, p.name) > 0) skip_note += (skip_note.empty() ? "" : ", ") + p.name;
  }
  std::snprintf(line, sizeof line, "  (%lld cases in %.1f s)\n", static_cast<long long>(r.cases), r.seconds);
  os << line;
  if (!skip_note.empty())
    os << "  (skipped: " << skip_note << ": it varies chunk caps and the workspace budget, which an external program cannot be given)\n";
  if (!r.declared.all_of_spec()) os << "  declared capabilities: " << r.declared.to_json() << "\n";
  if (!r.excluded.empty()) {
    os << "  excluded by the declaration (never judged, never failures): " << r.excluded_cases() << " of " << r.cases << " drawn cases:";
    for (const auto& [key, n] : r.excluded) os << " " << key << " " << n << ";";
    os << "\n";
  }
  bool differs = false;
  for (const auto& [tensor, f] : r.spread) differs = differs || f.cases_differing > 0;
  if (differs) {
    os << "run-to-run spread (determinism: two runs on the same inputs; " << (r.declared.is_deterministic() ? "declared deterministic: failures above" : "not declared deterministic: a finding, not a failure") << "):\n";
    for (const auto& [tensor, f] : r.spread)
      if (f.cases_differing > 0) {
        std::snprintf(line, sizeof line, "  %-22s differs in %lld of %lld cases (first case %lld), up to %lld elements, max |diff| %s, ||diff|| / ||out|| %s\n",
                      tensor.c_str(), static_cast<long long>(f.cases_differing), static_cast<long long>(f.cases_compared),
                      static_cast<long long>(f.first_case), static_cast<long long>(f.max_elements_differing),
                      sci(f.max_abs).c_str(), sci(f.max_rel).c_str());
        os << line;
      }
  }
  if (r.by_profile.size() > 1) {
    os << "matches_reference by profile:\n";
    for (const auto& [pname, t] : r.by_profile) {
      std::snprintf(line, sizeof line, "  %-32s %10lld %8lld\n", pname.c_str(), static_cast<long long>(t.passed), static_cast<long long>(t.failed));
      os << line;
      for (const auto& ce : t.first_failure)
        os << "    first failure, case " << ce.case_index << ": " << ce.outcome.detail << "\n      " << ce.original.to_string() << "\n";
    }
  }
  for (const auto& ce : r.failures) {
    os << "FAILED " << ce.outcome.property << " on case " << ce.case_index << ": " << ce.outcome.detail << "\n"
       << "  shrunk: " << ce.shrunk.to_string() << "\n";
    if (!ce.inputs_path.empty()) os << "  inputs: " << ce.inputs_path << "\n";
    os << "  replay:\n" << ce.replay << "\n";
  }
  return os.str();
}

}  // namespace simpo::verifier
