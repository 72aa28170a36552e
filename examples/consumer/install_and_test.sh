#!/usr/bin/env bash
# ctest package_consumer_example: `cmake --install` simpo-verify's package into a temporary prefix, then
# configure, build and test the example consumer project against it, as a user's CI would.
# Usage: install_and_test.sh CMAKE BUILD_DIR CONSUMER_SOURCE_DIR [PYTHON3_NUMPY]
set -euo pipefail
cmake="$1"; build="$2"; consumer="$3"; python="${4:-}"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
"$cmake" --install "$build" --component simpo_verify --prefix "$work/prefix"
test -x "$work/prefix/bin/simpo-verify"
args=(-S "$consumer" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix")
[[ -n "$python" ]] && args+=(-DPYTHON3_NUMPY="$python")
"$cmake" "${args[@]}"
"$cmake" --build "$work/build"
ctest_exe="$(dirname "$cmake")/ctest"
"$ctest_exe" --test-dir "$work/build" --output-on-failure
# The test really ran the installed command (not one found elsewhere on PATH).
grep -q "$work/prefix/bin/simpo-verify" "$work/build/CTestTestfile.cmake"
echo "installed package: configured, built and tested the consumer project"
