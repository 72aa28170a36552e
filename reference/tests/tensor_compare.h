// Reading the reference's outputs back in tests, and the one error measure they compare with.
#pragma once

#include "problem/tensor.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace simpo::reference::testing {

inline double scalar(const TensorMap& outputs, const std::string& name) { return outputs.at(name).value(0); }
inline std::vector<double> values(const TensorMap& outputs, const std::string& name) {
  return outputs.at(name).to_double();
}

// max |a - b| / max |b|: normwise, so an entry that cancels to nearly zero is judged on the tensor's scale, as
// rounding errors are. Sizes must match; an all-zero b compares absolutely.
inline double normwise_error(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

}  // namespace simpo::reference::testing
