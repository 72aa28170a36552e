#!/usr/bin/env bash
# ctest for the bf16_logits profile on examples/numpy_simpo.py with SIMPO_LOGITS=bf16 (logits rounded to bf16
# before the softmax, as TRL's eager loss and Liger do): the program passes bf16_logits on every case while strict
# rejects it; with a planted bug of a real peer's size (grad_weight accumulated in bf16 across chunks) on top,
# bf16_logits still fails it.
# Usage: numpy_bf16_logits_test.sh SIMPO_VERIFY PYTHON [CASES]
set -uo pipefail
exe="$1"; python="$2"; cases="${3:-150}"
here="$(cd "$(dirname "$0")" && pwd)"
impl="exec:$python $here/numpy_simpo.py"
out="$(SIMPO_LOGITS=bf16 "$exe" sweep --impl "$impl" --profile bf16_logits --all-profiles --cases "$cases" --seed 11 \
       --case-timeout 60 --counterexample-dir '' 2>/dev/null)"; rc=$?
echo "$out"
[[ $rc -eq 0 ]] || { echo "FAIL: bf16 logits under bf16_logits: exit $rc, expected 0"; exit 1; }
strict_failed="$(echo "$out" | awk '$1 == "strict" {print $3}')"
[[ -n "$strict_failed" && "$strict_failed" -gt 0 ]] || { echo "FAIL: strict did not reject bf16-rounded logits"; exit 1; }
out="$(SIMPO_LOGITS=bf16 SIMPO_PLANTED_BUG=weight_grad_bf16_chunks "$exe" sweep --impl "$impl" --profile bf16_logits \
       --cases 40 --seed 11 --no-shrink --case-timeout 60 --counterexample-dir '' 2>/dev/null)"; rc=$?
echo "$out" | grep -v "^  simpo-verify"
[[ $rc -eq 1 ]] || { echo "FAIL: planted weight_grad_bf16_chunks passed bf16_logits"; exit 1; }
[[ "$(echo "$out" | awk '$1 == "matches_reference" {print $3}')" -gt 0 ]] || { echo "FAIL: matches_reference did not fail"; exit 1; }
echo "bf16 logits: passes bf16_logits on $cases cases, strict rejects them; the planted bf16 accumulation fails bf16_logits"
