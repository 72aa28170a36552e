// The peer report: several implementations swept on the same case stream (one seed, one distribution), each
// judged under every named profile, with its declaration, its exclusions, the determinism finding, the time per
// case and the shrunk counterexample of each property's and each profile's first disagreement; optionally fixed
// shapes (the published case) run once each. Written as markdown (for the README) and JSON (for CI).
#pragma once

#include "verifier/sweep.h"

#include <string>
#include <vector>

namespace simpo::verifier {

struct PeerReportOptions {
  SweepOptions sweep;          // seed, case count or time budget, threads; profile and also_profiles are set here
  std::vector<Shape> fixed;    // shapes judged once each (seed 1, logit scale 2, SPEC's default hyperparameters)
  bool shrink = true;          // the first failure of each property and of each profile
};

struct FixedCaseResult {
  Shape shape;
  double candidate_seconds = 0;
  std::string error;  // the implementation refused or faulted
  std::vector<std::pair<std::string, Report>> by_profile;
};

struct PeerResult {
  std::string implementation;
  SweepResult sweep;
  std::vector<Counterexample> shrunk;  // first failure of each property, then of each profile (property "profile:NAME")
  std::vector<FixedCaseResult> fixed;
};

std::vector<PeerResult> run_peer_report(const std::vector<Implementation>&, const PeerReportOptions&);
std::string format_peer_markdown(const std::vector<PeerResult>&, const PeerReportOptions&);
std::string format_peer_json(const std::vector<PeerResult>&, const PeerReportOptions&);

}  // namespace simpo::verifier
