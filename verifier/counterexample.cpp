#include "verifier/counterexample.h"

#include "problem/problem_io.h"

#include <cctype>
#include <filesystem>
#include <sstream>

namespace simpo::verifier {

std::string write_counterexample(const Case& c, const std::string& impl, const std::string& path,
                                 const std::string& profile_flags) {
  Problem p = generate(c.spec);
  p.description = "counterexample for " + impl + ": " + c.to_string();
  if (auto dir = std::filesystem::path(path).parent_path(); !dir.empty()) std::filesystem::create_directories(dir);
  save_problem(path, p);
  std::ostringstream os;
  os << "  " << c.case_command(impl) << profile_flags << "\n"
     << "  simpo-verify compute --impl " << shell_quote(impl) << " --inputs " << shell_quote(path)
     << " --out /tmp/candidate.safetensors";
  if (c.max_chunk_rows != 0) os << " --max-chunk-rows " << c.max_chunk_rows;
  if (c.workspace_bytes != fused::default_workspace_bytes) os << " --workspace " << c.workspace_bytes;
  os << " && simpo-verify check --inputs " << shell_quote(path) << " --candidate /tmp/candidate.safetensors" << profile_flags;
  return os.str();
}

std::string file_name_part(const std::string& impl) {
  std::string out;
  for (char ch : impl) {
    const bool keep = std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '+' || ch == '-';
    if (keep)
      out += ch;
    else if (out.empty() || out.back() != '_')
      out += '_';
  }
  if (out.size() > 60) out.resize(60);
  return out;
}

}  // namespace simpo::verifier
