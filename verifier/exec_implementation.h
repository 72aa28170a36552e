// `--impl exec:COMMAND`: any program that reads an inputs file and writes an outputs file, driven as an
// Implementation (SPEC "External implementations").
//
//   persistent form (default): COMMAND runs once through /bin/sh -c, in its own process group, and is kept
//     running; each case is one JSON line on its stdin ({"inputs", "outputs", "gradients"}) and one JSON line
//     back on its stdout ({"ok": true} or {"ok": false, "error": "..."}). Started lazily, stopped when the last
//     copy of the Implementation goes (stdin closed, then killed if it lingers).
//   one-shot form: COMMAND contains {inputs}; it runs once per case with {inputs}, {outputs}, {gradients}
//     replaced (shell-quoted); exit 0 means done, any other exit is a refusal whose message is its stderr.
//
// A refusal is an InputError (the valid_input_agrees property compares it with SPEC's verdict). Everything else
// that keeps a result from arriving is an ImplementationFault naming which of these happened: the program died,
// printed something other than one JSON answer, answered ok without an outputs file, wrote a malformed one, or
// did not answer within ImplementationOptions::case_timeout_s. After a fault the program's whole process group
// is killed and reaped, and the next case starts it afresh. Nothing here blocks without a deadline (poll()).
#pragma once

#include "verifier/implementation.h"

#include <string>

namespace simpo::verifier {

// COMMAND is what follows "exec:". InputError for an empty command.
Implementation exec_implementation(const std::string& command, const ImplementationOptions& = {});

}  // namespace simpo::verifier
