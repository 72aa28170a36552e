// Greedy shrinking for the sweep (the rapidcheck tests use rapidcheck's own): try smaller shapes, default
// hyperparameters, no bias, no ignore pattern, no chunk cap, other seeds, keeping each change under which
// `property` still fails on `impl`; at most `max_attempts` runs and about `max_seconds` (an external program that
// hangs costs a case timeout per attempt).
#pragma once

#include "verifier/case.h"
#include "verifier/error_model.h"

#include <string>

namespace simpo::verifier {

Case shrink(const Case&, const Implementation&, const std::string& property, int max_attempts = 300,
            double max_seconds = 120, const Profile& = strict_profile());

}  // namespace simpo::verifier
