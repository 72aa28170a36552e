#!/usr/bin/env bash
# ctest for examples/numpy_simpo.py: the correct implementation passes a short sweep; with a planted bug the
# sweep fails, shrinks the case and prints a replay command that names the same --impl exec:... .
# Usage: numpy_example_test.sh SIMPO_VERIFY PYTHON [PLANTED_BUG]
set -uo pipefail
exe="$1"; python="$2"; bug="${3:-}"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
impl="exec:$python $here/numpy_simpo.py"
if [[ -z "$bug" ]]; then
  "$exe" sweep --impl "$impl" --cases 25 --seed 11 --case-timeout 60 --counterexample-dir "$work" 2>/dev/null
  exit $?
fi
out="$(SIMPO_PLANTED_BUG="$bug" "$exe" sweep --impl "$impl" --time-budget 60 --stop-at-first-failure \
       --case-timeout 60 --counterexample-dir "$work" 2>/dev/null)"; rc=$?
echo "$out"
[[ $rc -eq 1 ]] || { echo "FAIL: planted bug $bug: exit $rc, expected 1"; exit 1; }
[[ "$out" == *"shrunk: B="* ]] || { echo "FAIL: no shrunk case"; exit 1; }
[[ "$out" == *"simpo-verify case --impl 'exec:"* ]] || { echo "FAIL: the replay command does not name the exec implementation"; exit 1; }
ls "$work"/*.inputs.safetensors >/dev/null 2>&1 || { echo "FAIL: no counterexample file"; exit 1; }
echo "planted bug $bug found, shrunk, replayable"
