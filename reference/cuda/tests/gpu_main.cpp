// main() of reference_cuda_tests and verifier_device_tests (both need reference-cuda): where it cannot run (a machine without a CUDA device, as CI is), no
// test runs and the binary says why in the line ctest reads as "skipped" (gtest_discover_tests' skip pattern), so
// the binary builds and lists its tests everywhere and never reports a pass it did not earn.
#include "reference/reference.h"

#include <gtest/gtest.h>

#include <cstdio>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!GTEST_FLAG_GET(list_tests) && !simpo::reference::cuda_available()) {
    std::printf("[  SKIPPED ] reference-cuda cannot run here: %s\n", simpo::reference::cuda_unavailable_reason().c_str());
    return 0;
  }
  return RUN_ALL_TESTS();
}
