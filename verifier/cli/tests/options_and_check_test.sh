#!/usr/bin/env bash
# One validation of options for every implementation and command (issue 7), and `check` with several candidates
# and a reference outputs file already on disk (issue 11), driven as a user would drive them.
# Usage: options_and_check_test.sh SIMPO_VERIFY FIXTURES_DIR
set -uo pipefail
exe="$1"; fixtures="$2"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
# expect_refusal NAME NEEDLE COMMAND...: exit 2 and a message on stderr containing NEEDLE.
expect_refusal() {
  local name="$1" needle="$2"; shift 2
  local err rc
  err="$("$@" 2>&1 >/dev/null)"; rc=$?
  [[ $rc -eq 2 ]] || fail "$name: exit $rc, expected 2 ($err)"
  [[ "$err" == *"$needle"* ]] || fail "$name: message lacks \"$needle\": $err"
}
in="$fixtures/basic.inputs.safetensors"; ref="$fixtures/basic.reference.safetensors"

# Tolerances: never a silent fall back to the strict profile.
expect_refusal "check --rtol -1 --atol -1" "--rtol must be finite and >= 0" "$exe" check --inputs "$in" --candidate "$ref" --rtol -1 --atol -1
expect_refusal "check --atol nan" "--atol must be finite and >= 0" "$exe" check --inputs "$in" --candidate "$ref" --atol nan
expect_refusal "case --atol -0.5" "--atol must be finite" "$exe" case --impl reference --atol -0.5
# Run options: the same refusal whatever the implementation.
for impl in reference cpu; do
  expect_refusal "compute --impl $impl --max-chunk-rows -3" "--max-chunk-rows must be >= 0" \
    "$exe" compute --impl "$impl" --inputs "$in" --out "$work/o.safetensors" --max-chunk-rows -3
  expect_refusal "case --impl $impl --max-chunk-rows -3" "--max-chunk-rows must be >= 0" "$exe" case --impl "$impl" --max-chunk-rows -3
done
expect_refusal "compute --workspace 0" "--workspace must be a positive" "$exe" compute --impl reference --inputs "$in" --out "$work/o.safetensors" --workspace 0
expect_refusal "sweep --case-timeout 0" "--case-timeout must be" "$exe" sweep --impl "exec:true" --cases 1 --case-timeout 0
expect_refusal "case --beta lots" "--beta" "$exe" case --impl reference --beta lots
# The main job asks for its fixtures before the sweep (a binary carried away from its tree), and takes them from
# SIMPO_FIXTURES_DIR when set.
expect_refusal "main job --fixtures-dir missing" "give --fixtures-dir" "$exe" --impl cpu --fixtures-dir "$work/none" --cases 1
SIMPO_FIXTURES_DIR="$work/none" expect_refusal "main job SIMPO_FIXTURES_DIR missing" "$work/none" "$exe" --impl cpu --cases 1

# check: several candidates, the reference once; --reference-outputs instead of recomputing.
"$exe" compute --impl cpu --inputs "$in" --out "$work/cpu.safetensors" 2>/dev/null || fail "compute cpu"
"$exe" compute --impl cpu+preference_sign_flip --inputs "$in" --out "$work/bad.safetensors" 2>/dev/null || fail "compute mutant"
out="$("$exe" check --inputs "$in" --candidate "$work/cpu.safetensors" --candidate "$work/bad.safetensors" 2>&1)"; rc=$?
[[ $rc -eq 1 ]] || fail "check with a failing candidate: exit $rc"
[[ $(grep -c "profile strict:" <<<"$out") -eq 2 ]] || fail "check: not one table per candidate: $out"
[[ "$out" == *"2 candidates: 1 passed, 1 failed"* ]] || fail "check: no closing line for the candidates: $out"
json="$("$exe" check --inputs "$in" --candidate "$work/cpu.safetensors" --candidate "$work/cpu.safetensors" --json --reference-outputs "$ref")"; rc=$?
[[ $rc -eq 0 ]] || fail "check --reference-outputs: exit $rc"
python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["passed"] and len(d["candidates"]) == 2, d' <<<"$json" || fail "check --json: not one document with two candidates"
expect_refusal "check --reference-outputs of another problem" "--reference-outputs" \
  "$exe" check --inputs "$in" --candidate "$work/cpu.safetensors" --reference-outputs "$fixtures/odd_dims.reference.safetensors"
expect_refusal "check --reference-outputs of a candidate" "not F64" \
  "$exe" check --inputs "$in" --candidate "$work/cpu.safetensors" --reference-outputs "$work/cpu.safetensors"

# --reference (SPEC: every command that judges): a bad name is exit 2; cpu judges as before.
expect_refusal "check --reference gpu" "--reference" "$exe" check --inputs "$in" --candidate "$ref" --reference gpu
"$exe" check --inputs "$in" --candidate "$work/cpu.safetensors" --reference cpu >/dev/null || fail "check --reference cpu"

# The vocab-parallel step from the command line (issue 10): G = 3 ranks with V not divisible by 3 pass strict;
# G beyond V and G = 0 are refused.
"$exe" case --impl cpu --vocab-shards 3 --B 2 --T 5 --H 24 --V 101 --bias >/dev/null 2>&1 || fail "case --vocab-shards 3"
expect_refusal "case --vocab-shards 5 --V 3" "needs 1 <= shards <= V" "$exe" case --impl cpu --vocab-shards 5 --V 3
expect_refusal "case --vocab-shards 0" "--vocab-shards" "$exe" case --impl cpu --vocab-shards 0

# Every input dtype SPEC allows: case --dtype, compute and check of an f32 inputs file (F32 gradients,
# judged against f32 bounds: the bf16 pipeline's result on the same values fails), mixed dtypes refused naming both,
# and a sweep drawing all three dtypes.
"$exe" case --impl cpu --dtype f32 --B 4 --T 6 --H 24 --V 101 --bias --save-inputs "$work/f32.safetensors" >/dev/null 2>&1 \
  || fail "case --dtype f32"
"$exe" case --impl cpu --dtype bf16 --B 4 --T 6 --H 24 --V 101 --bias --save-inputs "$work/bf16.safetensors" >/dev/null 2>&1 \
  || fail "case --dtype bf16"
"$exe" case --impl cpu --dtype f16 --B 4 --T 6 --H 24 --V 101 >/dev/null 2>&1 || fail "case --dtype f16"
expect_refusal "case --dtype f64" "--dtype" "$exe" case --impl cpu --dtype f64
"$exe" compute --impl cpu --inputs "$work/f32.safetensors" --out "$work/f32.out.safetensors" 2>/dev/null || fail "compute f32"
python3 -c 'import json,struct,sys; b=open(sys.argv[1],"rb").read(); h=json.loads(b[8:8+struct.unpack("<Q",b[:8])[0]]); assert all(h[k]["dtype"]=="F32" for k in h if k!="__metadata__"), h' \
  "$work/f32.out.safetensors" || fail "compute f32: outputs not all F32"
"$exe" check --inputs "$work/f32.safetensors" --candidate "$work/f32.out.safetensors" >/dev/null || fail "check f32 candidate"
"$exe" compute --impl cpu --inputs "$work/bf16.safetensors" --out "$work/bf16.out.safetensors" --grad-f32 2>/dev/null || fail "compute bf16"
# Rewrites a safetensors file with its BF16 tensors as F32 (same values) or, given a tensor name, that tensor's F32
# values truncated to BF16: the standard library only (no numpy here).
retype() {
  python3 - "$@" <<'PY'
import json, struct, sys
src, dst = sys.argv[1], sys.argv[2]
to_bf16 = sys.argv[3] if len(sys.argv) > 3 else None
b = open(src, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n]); data = b[8 + n:]
out, off = [], 0
for k in sorted(k for k in h if k != "__metadata__"):
    raw = data[h[k]["data_offsets"][0]:h[k]["data_offsets"][1]]
    if to_bf16 is None and h[k]["dtype"] == "BF16":
        raw = b"".join(b"\0\0" + raw[i:i + 2] for i in range(0, len(raw), 2)); h[k]["dtype"] = "F32"
    elif k == to_bf16:
        raw = b"".join(raw[i + 2:i + 4] for i in range(0, len(raw), 4)); h[k]["dtype"] = "BF16"
    h[k]["data_offsets"] = [off, off + len(raw)]; out.append(raw); off += len(raw)
hb = json.dumps(h).encode()
open(dst, "wb").write(struct.pack("<Q", len(hb)) + hb + b"".join(out))
PY
}
retype "$work/bf16.out.safetensors" "$work/bf16.out32.safetensors" || fail "rewriting grad_x as F32"
"$exe" check --inputs "$work/f32.safetensors" --candidate "$work/bf16.out32.safetensors" >/dev/null 2>&1; rc=$?
[[ $rc -eq 1 ]] || fail "check: the bf16 pipeline's result judged as an f32 candidate: exit $rc, expected 1"
retype "$work/f32.safetensors" "$work/mixed.safetensors" weight || fail "writing a mixed-dtype inputs file"
expect_refusal "compute mixed dtypes" "x is F32 but weight is BF16" \
  "$exe" compute --impl cpu --inputs "$work/mixed.safetensors" --out "$work/o.safetensors"
out="$("$exe" sweep --impl cpu --cases 40 --dtypes bf16,f16,f32 --threads 1 --counterexample-dir "$work/cx" 2>/dev/null)"; rc=$?
[[ $rc -eq 0 ]] || fail "sweep --dtypes bf16,f16,f32: exit $rc: $out"
expect_refusal "sweep --dtypes f8" "--dtypes" "$exe" sweep --impl cpu --cases 1 --dtypes f8

[[ $failures -eq 0 ]] && echo "all passed"
exit $((failures > 0))
