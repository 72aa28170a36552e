#!/usr/bin/env bash
# CI's second build (.ci/run runs it after the README's test command): the whole CPU suite under
# AddressSanitizer + UndefinedBehaviorSanitizer (LeakSanitizer included), built with clang into build-sanitize/,
# then every libFuzzer target of fuzz/ for SIMPO_FUZZ_SECONDS each (default 15: a minute in all).
# Run scripts/setup.sh first (it installs clang and libclang-rt-14-dev).
#   bash scripts/sanitize.sh
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${SIMPO_FUZZ_SECONDS:-15}"
CC=clang CXX=clang++ cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSIMPO_ENABLE_CUDA=OFF \
  -DSIMPO_SANITIZE=ON -DSIMPO_BUILD_FUZZERS=ON -DSIMPO_FUZZ_SECONDS="$seconds" >/dev/null
cmake --build build-sanitize -j"$(nproc)"
# Any report fails its test: halt_on_error for ASan, -fno-sanitize-recover=all for UBSan (CMakeLists.txt).
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# The whole suite runs unshortened: 4 min under the sanitizers on the 2-core development machine.
ctest --test-dir build-sanitize --output-on-failure -j2 -LE "gpu|fuzz"
ctest --test-dir build-sanitize --output-on-failure -L fuzz
