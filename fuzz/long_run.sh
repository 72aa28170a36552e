#!/usr/bin/env bash
# The recorded long run: every target for at least RUNS executions (default 2,000,000), as JOBS parallel
# libFuzzer jobs of RUNS/JOBS each sharing one working corpus, all targets at once (4 x JOBS cores).
# Prints one line per target: executions, coverage (cov/ft from the jobs' final stats), crashes.
#   fuzz/long_run.sh build-sanitize/fuzz [RUNS] [JOBS]
set -uo pipefail
dir="$1" runs="${2:-2000000}" jobs="${3:-4}"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
for t in safetensors inputs outputs check; do
  mkdir -p "$work/$t/corpus" "$work/$t/logs"
  cp -r "$here/corpus/$t"/. "$work/$t/corpus/"
  (cd "$work/$t/logs" && "$dir/${t}_fuzzer" -jobs="$jobs" -workers="$jobs" -runs=$((runs / jobs + 1)) -max_len=65536 \
      -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$work/$t/corpus" >/dev/null 2>&1) &
done
wait
status=0
for t in safetensors inputs outputs check; do
  execs=0; cov=0; ft=0
  for log in "$work/$t/logs"/fuzz-*.log; do
    e=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | awk '{print $2}' | tail -1)
    execs=$((execs + ${e:-0}))
    c=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | awk '{print $2}'); [[ ${c:-0} -gt $cov ]] && cov=$c
    f=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | awk '{print $2}'); [[ ${f:-0} -gt $ft ]] && ft=$f
  done
  crashes=$(ls "$work/$t/logs" | grep -c -E '^(crash|leak|timeout|oom)-' || true)
  [[ $crashes -eq 0 ]] || status=1
  echo "$t: $execs executions, cov $cov, ft $ft, corpus $(ls "$work/$t/corpus" | wc -l) files, crashes $crashes"
  [[ $crashes -eq 0 ]] || grep -h -A3 'ERROR' "$work/$t/logs"/fuzz-*.log | head -20
done
rm -rf "$work"
exit $status
