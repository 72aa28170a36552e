#include "verifier/sweep.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

namespace simpo::verifier {

namespace {
// The flags that give `check` and `case` the sweep's profile, for replay commands.
std::string profile_flags(const Profile& p) {
  char buf[96];
  switch (p.kind) {
    case ProfileKind::strict: return "";
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
  for (std::int64_t i = 0;; ++i) {
    if (options.max_cases > 0 && i >= options.max_cases) break;
    if (options.time_budget_s > 0 && elapsed() >= options.time_budget_s) break;
    Case c = random_case(rng, options.distribution);
    if (!impl.takes_chunking) {  // drawn anyway, so every implementation sees the same stream of problems
      c.max_chunk_rows = 0;
      c.workspace_bytes = fused::default_workspace_bytes;
    }
    CaseRun run(c, impl, options.profile);
    const std::vector<Outcome> outcomes = check_case(run, {}, options.stop_at_first_failure);
    bool any_failed = false;
    for (const Outcome& o : outcomes) {
      (o.skipped ? result.skipped : o.passed ? result.passed : result.failed)[o.property]++;
      if (o.passed && !o.skipped && o.property == "matches_reference" && run.strict_report)
        for (const auto& t : run.strict_report->tensors)
          result.worst_margin[t.name] = std::max(result.worst_margin[t.name], t.margin);
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
  for (const auto& ce : r.failures) {
    os << "FAILED " << ce.outcome.property << " on case " << ce.case_index << ": " << ce.outcome.detail << "\n"
       << "  shrunk: " << ce.shrunk.to_string() << "\n";
    if (!ce.inputs_path.empty()) os << "  inputs: " << ce.inputs_path << "\n";
    os << "  replay:\n" << ce.replay << "\n";
  }
  return os.str();
}

}  // namespace simpo::verifier
