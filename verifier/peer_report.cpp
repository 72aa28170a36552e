#include "verifier/peer_report.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <sstream>

namespace simpo::verifier {

namespace {

std::int64_t get(const std::map<std::string, std::int64_t>& m, const std::string& k) {
  const auto it = m.find(k);
  return it == m.end() ? 0 : it->second;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

FixedCaseResult run_fixed(const Implementation& impl, const Shape& shape, const std::vector<Profile>& profiles) {
  FixedCaseResult out;
  out.shape = shape;
  Case c;
  c.spec.shape = shape;
  c.spec.seed = 1;
  c.spec.description = "peer report fixed case: " + c.to_string();
  CaseRun run(c, impl);
  try {
    if (run.spec_rejects()) {
      out.error = "SPEC rejects it: " + run.spec_error();
      return out;
    }
    (void)run.candidate();
    out.candidate_seconds = run.candidate_seconds;
    for (const Profile& p : profiles) out.by_profile.emplace_back(p.name(), compare(run.scales_for(p), run.exact(), run.candidate(), p));
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  return out;
}

std::string first_failure(const Report& r) {
  for (const auto& t : r.tensors)
    if (t.verdict != Verdict::passed) return t.name + ": " + verdict_name(t.verdict) + ": " + t.reason;
  return "";
}

}  // namespace

std::vector<PeerResult> run_peer_report(const std::vector<Implementation>& impls, const PeerReportOptions& options) {
  SweepOptions sweep = options.sweep;
  sweep.profile = strict_profile();
  sweep.also_profiles = named_profiles();
  sweep.shrink = false;  // only the first failure of each property and profile, below
  sweep.stop_at_first_failure = false;
  std::vector<PeerResult> results;
  for (const Implementation& impl : impls) {
    PeerResult r;
    r.implementation = impl.name;
    r.sweep = run_sweep(impl, sweep);
    std::map<std::string, bool> seen;
    for (const Counterexample& ce : r.sweep.failures) {
      if (seen[ce.outcome.property]) continue;
      seen[ce.outcome.property] = true;
      Counterexample s = ce;
      if (options.shrink) {
        s.shrunk = shrink(ce.original, impl, ce.outcome.property, sweep.shrink_attempts, sweep.shrink_seconds);
        const auto again = check_case(s.shrunk, impl, {ce.outcome.property});
        if (!again.empty() && !again.back().passed) s.outcome = again.back();
      }
      s.replay = "  " + s.shrunk.case_command(impl.name);
      r.shrunk.push_back(s);
    }
    for (const auto& [pname, tally] : r.sweep.by_profile)
      for (const Counterexample& ce : tally.first_failure) {
        Counterexample s = ce;
        const Profile p = profile_from_name(pname);
        if (options.shrink) {
          s.shrunk = shrink(ce.original, impl, "matches_reference", sweep.shrink_attempts, sweep.shrink_seconds, p);
          const auto again = check_case(s.shrunk, impl, {"matches_reference"}, false, p);
          if (!again.empty() && !again.back().passed) s.outcome = again.back();
        }
        s.outcome.property = "profile:" + pname;
        s.replay = "  " + s.shrunk.case_command(impl.name) + " --profile " + pname;
        r.shrunk.push_back(s);
      }
    for (const Shape& shape : options.fixed) r.fixed.push_back(run_fixed(impl, shape, named_profiles()));
    results.push_back(std::move(r));
  }
  return results;
}

std::string format_peer_markdown(const std::vector<PeerResult>& results, const PeerReportOptions& options) {
  std::ostringstream os;
  os << "## Peer report\n\nSame case stream for every implementation: seed " << options.sweep.seed << ", "
     << (options.sweep.max_cases > 0 ? std::to_string(options.sweep.max_cases) + " cases" : "a time budget")
     << ". Excluded: drawn cases outside the implementation's declaration (never judged, never failures).\n\n";
  os << "| implementation | declared | cases | excluded | ";
  for (const Profile& p : named_profiles()) os << p.name() << " passed / failed | ";
  os << "other properties failed | deterministic | ms per case |\n|---|---|---|---|";
  for (std::size_t i = 0; i < named_profiles().size(); ++i) os << "---|";
  os << "---|---|---|\n";
  for (const PeerResult& r : results) {
    const SweepResult& s = r.sweep;
    std::string excluded = std::to_string(s.excluded_cases());
    if (!s.excluded.empty()) {
      excluded += " (";
      bool first = true;
      for (const auto& [k, n] : s.excluded) excluded += (first ? "" : ", ") + k + " " + std::to_string(n), first = false;
      excluded += ")";
    }
    os << "| `" << r.implementation << "` | `" << s.declared.to_json() << "` | " << s.cases << " | " << excluded << " | ";
    for (const Profile& p : named_profiles()) {
      const auto it = s.by_profile.find(p.name());
      os << (it == s.by_profile.end() ? std::string("-") : std::to_string(it->second.passed) + " / " + std::to_string(it->second.failed)) << " | ";
    }
    std::string others;
    for (const auto& pr : all_properties())
      if (pr.name != "matches_reference" && get(s.failed, pr.name) > 0)
        others += (others.empty() ? "" : ", ") + pr.name + " " + std::to_string(get(s.failed, pr.name));
    std::string det = s.declared.is_deterministic() ? "declared; " : "not declared; ";
    std::int64_t differing = 0;
    double worst = 0;
    for (const auto& [t, f] : s.spread) {
      differing = std::max(differing, f.cases_differing);
      worst = std::max(worst, f.max_rel);
    }
    det += differing == 0 ? "identical reruns" : std::to_string(differing) + " cases differ (rel up to " + sci(worst) + ")";
    os << (others.empty() ? "none" : others) << " | " << det << " | "
       << (s.candidate_runs > 0 ? fixed(1e3 * s.candidate_seconds / static_cast<double>(s.candidate_runs), 2) : "-") << " |\n";
  }
  for (const PeerResult& r : results) {
    os << "\n### `" << r.implementation << "`\n\n";
    for (const auto& [t, f] : r.sweep.spread)
      if (f.cases_differing > 0)
        os << "- run-to-run spread of " << t << ": " << f.cases_differing << " of " << f.cases_compared << " cases, up to "
           << f.max_elements_differing << " elements, max |diff| " << sci(f.max_abs) << ", ||diff|| / ||out|| " << sci(f.max_rel)
           << (r.sweep.declared.is_deterministic() ? " (declared deterministic: a failure)" : " (a finding)") << "\n";
    if (r.shrunk.empty()) os << "- no disagreement\n";
    for (const Counterexample& ce : r.shrunk)
      os << "- first `" << ce.outcome.property << "` failure (case " << ce.case_index << "), shrunk to `" << ce.shrunk.to_string()
         << "`: " << ce.outcome.detail.substr(0, 400) << "\n  replay: `" << ce.replay.substr(2) << "`\n";
    for (const FixedCaseResult& f : r.fixed) {
      os << "- fixed case " << f.shape.to_string() << ": ";
      if (!f.error.empty()) {
        os << f.error << "\n";
        continue;
      }
      os << fixed(f.candidate_seconds, 3) << " s;";
      for (const auto& [pname, rep] : f.by_profile) {
        os << " " << pname << " " << (rep.passed() ? "passed" : "FAILED");
        double ratio = 0;
        for (const auto& t : rep.tensors)
          if (is_gradient_output(t.name)) ratio = std::max(ratio, t.ratio);
        if (ratio > 0) os << " (gradients up to " << fixed(ratio, 2) << "x the floor)";
        os << ";";
      }
      os << "\n";
      for (const auto& [pname, rep] : f.by_profile)
        if (!rep.passed()) os << "  - " << pname << ": " << first_failure(rep).substr(0, 300) << "\n";
    }
  }
  return os.str();
}

std::string format_peer_json(const std::vector<PeerResult>& results, const PeerReportOptions& options) {
  using json = nlohmann::json;
  json doc = {{"seed", options.sweep.seed}, {"cases", options.sweep.max_cases}, {"implementations", json::array()}};
  for (const PeerResult& r : results) {
    const SweepResult& s = r.sweep;
    json j = {{"implementation", r.implementation},
              {"declared", json::parse(s.declared.to_json())},
              {"cases", s.cases},
              {"seconds", s.seconds},
              {"seconds_per_case", s.candidate_runs > 0 ? s.candidate_seconds / static_cast<double>(s.candidate_runs) : 0.0},
              {"excluded", s.excluded},
              {"properties", json::object()},
              {"profiles", json::object()},
              {"spread", json::object()},
              {"counterexamples", json::array()},
              {"fixed", json::array()}};
    for (const auto& p : all_properties())
      j["properties"][p.name] = {{"passed", get(s.passed, p.name)}, {"failed", get(s.failed, p.name)}, {"skipped", get(s.skipped, p.name)},
                                 {"excluded", s.excluded_cases()}};
    for (const auto& [pname, t] : s.by_profile) j["profiles"][pname] = {{"passed", t.passed}, {"failed", t.failed}, {"excluded", s.excluded_cases()}};
    for (const auto& [t, f] : s.spread)
      j["spread"][t] = {{"cases_compared", f.cases_compared}, {"cases_differing", f.cases_differing},
                        {"max_elements_differing", f.max_elements_differing}, {"max_abs", f.max_abs}, {"max_rel", f.max_rel}};
    for (const Counterexample& ce : r.shrunk)
      j["counterexamples"].push_back({{"property", ce.outcome.property}, {"case_index", ce.case_index}, {"original", ce.original.to_string()},
                                      {"shrunk", ce.shrunk.to_string()}, {"detail", ce.outcome.detail}, {"replay", ce.replay.substr(2)}});
    for (const FixedCaseResult& f : r.fixed) {
      json fj = {{"shape", f.shape.to_string()}, {"candidate_seconds", f.candidate_seconds}, {"error", f.error}, {"profiles", json::object()}};
      for (const auto& [pname, rep] : f.by_profile) fj["profiles"][pname] = {{"passed", rep.passed()}, {"first_failure", first_failure(rep)}};
      j["fixed"].push_back(fj);
    }
    doc["implementations"].push_back(j);
  }
  return doc.dump(2) + "\n";
}

}  // namespace simpo::verifier
