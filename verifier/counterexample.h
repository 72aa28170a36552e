// Counterexample files: a failing case's inputs file (replayable with `simpo-verify check`) and the commands
// that replay it, naming the implementation exactly as the user gave it (an exec: command shell-quoted).
#pragma once

#include "verifier/case.h"

#include <string>

namespace simpo::verifier {

// Writes the case's inputs file and returns the replay commands (`profile_flags`, e.g. " --profile peer", is
// appended to the commands that judge).
std::string write_counterexample(const Case&, const std::string& impl, const std::string& path,
                                 const std::string& profile_flags = "");
// The implementation name made safe for a file name ("exec:python3 x.py" -> "exec_python3_x.py").
std::string file_name_part(const std::string& impl);

}  // namespace simpo::verifier
