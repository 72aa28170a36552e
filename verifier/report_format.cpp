// The report's two forms: a table for people, JSON for CI.
#include "verifier/error_model.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <sstream>

namespace simpo::verifier {

std::string sci(double v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*e", digits, v);
  return buf;
}

std::string format_table(const Report& report) {
  std::ostringstream os;
  char line[512];
  std::snprintf(line, sizeof line, "%-20s %-5s %-15s %9s %9s %9s %9s %9s %8s  %s\n", "tensor", "dtype", "shape",
                "rel_frob", "floor", "ratio", "bound", "max_abs", "beyond", "verdict");
  os << line;
  for (const auto& t : report.tensors) {
    if (t.verdict == Verdict::not_checked || (t.verdict == Verdict::failed && t.numel == 0 && t.reason.size())) {
      std::snprintf(line, sizeof line, "%-20s %-5s %-15s %9s %9s %9s %9s %9s %8s  %s: %s\n", t.name.c_str(),
                    t.dtype.c_str(), t.shape.empty() && t.dtype.empty() ? "" : shape_string(t.shape).c_str(), "-",
                    "-", "-", "-", "-", "-", verdict_name(t.verdict).c_str(), t.reason.c_str());
      os << line;
      continue;
    }
    std::snprintf(line, sizeof line, "%-20s %-5s %-15s %9.2e %9.2e %9.2f %9s %9.2e %8lld  %s%s%s\n", t.name.c_str(),
                  t.dtype.c_str(), shape_string(t.shape).c_str(), t.rel_frob, t.floor, t.ratio,
                  t.frob_bound >= 0 ? sci(t.frob_bound).c_str() : "-", t.max_abs, static_cast<long long>(t.beyond),
                  verdict_name(t.verdict).c_str(), t.reason.empty() ? "" : ": ", t.reason.c_str());
    os << line;
  }
  os << "profile " << report.profile << ": " << report.count(Verdict::passed) << " passed, "
     << report.count(Verdict::failed) << " failed, " << report.count(Verdict::not_checked) << " not checked -> "
     << (report.passed() ? "PASSED" : "FAILED") << "\n";
  return os.str();
}

std::string format_json(const Report& report) {
  nlohmann::json j;
  j["profile"] = report.profile;
  j["passed"] = report.passed();
  j["tensors"] = nlohmann::json::array();
  auto number = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); };
  for (const auto& t : report.tensors) {
    nlohmann::json e;
    e["name"] = t.name;
    e["verdict"] = t.verdict == Verdict::passed ? "passed" : t.verdict == Verdict::failed ? "failed" : "not_checked";
    e["reason"] = t.reason;
    e["dtype"] = t.dtype;
    e["shape"] = t.shape;
    if (t.verdict != Verdict::not_checked && t.numel > 0) {
      e["rel_frob"] = number(t.rel_frob);
      e["floor"] = number(t.floor);
      e["ratio"] = number(t.ratio);
      e["max_abs"] = number(t.max_abs);
      e["max_abs_at"] = t.max_abs_at;
      e["rtol"] = t.rtol;
      e["atol"] = t.atol;
      e["frob_bound"] = t.frob_bound >= 0 ? number(t.frob_bound) : nlohmann::json(nullptr);
      e["beyond"] = t.beyond;
      e["non_finite"] = t.non_finite;
      e["rows_beyond"] = t.rows_beyond;
      e["margin"] = number(t.margin);
    }
    j["tensors"].push_back(e);
  }
  return j.dump(2) + "\n";
}

}  // namespace simpo::verifier
