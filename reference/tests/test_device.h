// Which float64 reference a test binary exercises. reference_tests: the CPU one. reference_cuda_tests (built where
// CUDA is found, label gpu): the same test files compiled with SIMPO_TEST_REFERENCE_CUDA, so every closed form,
// finite difference and invariance runs against reference-cuda too.
#pragma once

#include "reference/reference.h"

namespace simpo::reference::testing {

inline Options test_options() {
  Options options;
#ifdef SIMPO_TEST_REFERENCE_CUDA
  options.device = Device::cuda;
#endif
  return options;
}

}  // namespace simpo::reference::testing
