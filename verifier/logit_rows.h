// The bf16_logits profile's per-row pass over a problem's logits (ProblemScales::add_logit_rounding needs it): O(N H V),
// on a CUDA device where one is present and the problem is large, else on the host. The rest of the profile's
// derivation is O(N H) host code in error_bounds.cpp.
#pragma once

#include "problem/problem.h"
#include "verifier/device_logit_rows.h"

#include <optional>
#include <vector>

namespace simpo::verifier {

using LogitRow = device::LogitRow;

// The host pass: the logits and every row term in float64 (Eigen).
std::vector<LogitRow> logit_rows_on_host(const Problem&, bool gradients);
// The device pass (device_logit_rows.h): nullopt where this build has no CUDA, no device is present, or its memory
// cannot hold the pass.
std::optional<std::vector<LogitRow>> logit_rows_on_device(const Problem&, bool gradients, int device = 0);
// The device pass where the problem is large enough to repay starting it, else (or where it cannot run) the host's.
std::vector<LogitRow> logit_rows(const Problem&, bool gradients);

}  // namespace simpo::verifier
