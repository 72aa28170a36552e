#!/usr/bin/env bash
# ctest for `simpo-verify report`: the cpu backend and the numpy example on one case stream, plus a fixed shape.
# Both pass every property and every profile, declared deterministic with identical reruns; a mutant on the same
# stream fails with a shrunk counterexample; markdown and JSON are written; a malformed --capabilities is exit 2
# naming the key.
# Usage: peer_report_test.sh SIMPO_VERIFY PYTHON
set -uo pipefail
exe="$1"; python="$2"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
"$exe" report --impl cpu --impl "exec:$python $here/numpy_simpo.py" --impl cpu+grad_bias_missing --cases 100 --seed 3 \
  --fixed 2,8,16,40 --out "$work/r" >/dev/null 2>&1; rc=$?
[[ $rc -eq 0 ]] || { echo "FAIL: report exit $rc"; exit 1; }
[[ -s "$work/r.md" && -s "$work/r.json" ]] || { echo "FAIL: no report files"; exit 1; }
cat "$work/r.md"
"$python" - "$work/r.json" <<'PY' || exit 1
import json, sys
doc = json.load(open(sys.argv[1]))
cpu, numpy, mutant = doc["implementations"]
for r in (cpu, numpy):
    for name, p in r["properties"].items():
        assert p["failed"] == 0, (r["implementation"], name, p)
    for name in ("strict", "bf16_logits"):
        assert r["profiles"][name]["failed"] == 0 and r["profiles"][name]["passed"] > 60, (r["implementation"], name)
    assert r["declared"]["deterministic"] is True
    assert all(s["cases_differing"] == 0 for s in r["spread"].values())
    assert all(f["profiles"]["strict"]["passed"] for f in r["fixed"])
assert mutant["profiles"]["strict"]["failed"] > 0
assert any(c["property"] == "matches_reference" and c["shrunk"].startswith("B=2 T=1") for c in mutant["counterexamples"]), mutant["counterexamples"]
print("report: cpu and numpy pass every property and the derived profiles; the mutant's failure is shrunk")
PY
echo '{"max_shape": {"B": 0}}' > "$work/bad.json"
err="$("$exe" sweep --impl cpu --cases 1 --capabilities "$work/bad.json" 2>&1 >/dev/null)"; rc=$?
[[ $rc -eq 2 && "$err" == *'"max_shape.B"'* ]] || { echo "FAIL: malformed capabilities: exit $rc, $err"; exit 1; }
echo "malformed capabilities: exit 2: $err"
