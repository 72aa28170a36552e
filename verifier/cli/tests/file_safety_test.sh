#!/usr/bin/env bash
# The CLI never loses a file and refuses what cannot fit (issue 7), driven as a user would drive it.
# Usage: cli_file_safety_test.sh SIMPO_VERIFY FIXTURES_DIR
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

in="$work/in.safetensors"
cp "$fixtures/basic.inputs.safetensors" "$in"
mkdir -p "$work/sub"
ln "$in" "$work/hard.safetensors"
ln -s "$in" "$work/soft.safetensors"
for out in "$in" "$work/sub/../in.safetensors" "$work/hard.safetensors"; do
  expect_refusal "compute --out $out" "same file as the input" "$exe" compute --impl cpu --inputs "$in" --out "$out"
done
expect_refusal "compute --out symlink" "is a symbolic link" "$exe" compute --impl cpu --inputs "$in" --out "$work/soft.safetensors"
cmp -s "$in" "$fixtures/basic.inputs.safetensors" || fail "the inputs file changed"

expect_refusal "compute --out /dev/full" "is a device" "$exe" compute --impl cpu --inputs "$in" --out /dev/full
expect_refusal "compute --out /dev/null" "is a device" "$exe" compute --impl reference --inputs "$in" --out /dev/null
[[ -c /dev/null && -c /dev/full ]] || fail "a device node was replaced"
mkfifo "$work/fifo"
expect_refusal "compute --out FIFO" "is a FIFO" timeout 20 "$exe" compute --impl cpu --inputs "$in" --out "$work/fifo"
[[ -p "$work/fifo" ]] || fail "the FIFO was replaced"

# A stranger's OUT.tmp survives, and no temporary is left behind.
echo "not ours" > "$work/out.safetensors.tmp"
"$exe" compute --impl cpu --inputs "$in" --out "$work/out.safetensors" 2>/dev/null || fail "a plain compute failed"
[[ "$(cat "$work/out.safetensors.tmp")" == "not ours" ]] || fail "OUT.tmp was consumed"
leftovers="$(find "$work" -name '.out.safetensors.*')"
[[ -z "$leftovers" ]] || fail "temporary left behind: $leftovers"

# Runs too large for the machine are refused with their bytes, before allocating.
expect_refusal "case V=2^40" "needs 2199023255572 bytes" "$exe" case --B 2 --T 1 --H 1 --V 1099511627776
expect_refusal "reference over the memory cap" "on B=2 T=8 H=16 V=64 needs" env SIMPO_MEMORY_LIMIT_BYTES=10000 \
  "$exe" compute --impl reference --inputs "$in" --out "$work/ref.safetensors"

# A directory given as a file.
expect_refusal "directory as inputs" "is a directory" "$exe" compute --impl cpu --inputs "$work" --out "$work/x.safetensors"

if [[ $failures -gt 0 ]]; then echo "$failures failure(s)"; exit 1; fi
echo "all CLI file-safety checks passed"
