#!/usr/bin/env bash
# Runs one libFuzzer target for SECONDS over a copy of its committed seed corpus (the committed corpus is
# never modified; new inputs the run finds stay in the temporary copy). Exit 0: no crash, leak or timeout.
#   fuzz/run.sh build-sanitize/fuzz/check_fuzzer fuzz/corpus/check 60
# A crash leaves its input as crash-* in the current directory, and libFuzzer prints how to reproduce it.
set -euo pipefail
if [[ $# -ne 3 ]]; then echo "usage: fuzz/run.sh FUZZER CORPUS_DIR SECONDS" >&2; exit 2; fi
fuzzer="$1" corpus="$2" seconds="$3"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r "$corpus"/. "$work"/
# -rss_limit_mb: every allocation must be asked for (problem/memory.h) long before this; -timeout: a hang is a bug.
"$fuzzer" -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$work"
