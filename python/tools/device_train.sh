#!/usr/bin/env bash
# The training-loop proof of the torch drop-in (python/README.md, "A training loop"): a small Llama model trained
# with SimPO three ways in one process per configuration (TRL's formula, Liger-Kernel, ours;
# python/examples/train_simpo.py): bf16, fp32, bf16 with gradient accumulation 3, bf16 under torch.compile; with
# ASYNC=1 also bf16 and fp32 with ours at validate=False (the asynchronous call: no host synchronization).
# Carried (ignored folders): .whl (the simpo_verify cp312 wheel, liger-kernel), .pylibs where the wheel is not
# self-contained (Debian's shared libraries; libopenblas gzipped). The machine's torch, transformers, triton and
# matplotlib are used as they are. Results in $OUT: per configuration train_simpo_<tag>.json, .png and the full
# log train_<tag>.log; the judged steps and the summary table are printed.
# STEPS (50), JUDGE_EVERY (25: steps 0, 25 and the last are judged by the verifier) and PAIRS (2) override;
# CONFIGS (space-separated tags, e.g. "f32 f32_async") runs only those configurations.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
. scripts/device_libraries.sh
unpack_carried_libraries .pylibs /tmp/pylibs
export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=/tmp/pylibs:${LD_LIBRARY_PATH:-}
date -u; nvidia-smi -L
python3 -c "
import torch, transformers, matplotlib, liger_kernel, simpo_verify as sv
print('torch', torch.__version__, 'transformers', transformers.__version__, 'matplotlib', matplotlib.__version__,
      'simpo_verify', sv.__file__, 'cuda', sv.cuda_available())" || exit 1

run() {  # run TAG TIMEOUT_S ARGS...: one configuration, its log in $OUT, the lines that matter printed
  local tag=$1 limit=$2; shift 2
  [ -z "${CONFIGS:-}" ] || [[ " $CONFIGS " == *" $tag "* ]] || return 0
  echo "== $tag: $*"
  local t0=$SECONDS
  timeout "$limit" python3 python/examples/train_simpo.py --steps "${STEPS:-50}" --judge-every "${JUDGE_EVERY:-25}" \
    --pairs "${PAIRS:-2}" --out "$OUT" --tag "$tag" "$@" > "$OUT/train_$tag.log" 2>&1
  local rc=$?
  grep -E "^Llama|same state|^way |^(trl|liger|ours) |within the verifier|skipp|failed \(|Error|^wrote" \
    "$OUT/train_$tag.log" | grep -v -i "warning" | tail -n 30
  [ $rc -eq 0 ] || { echo "exit $rc (124: timed out after $limit s); last lines:"; tail -n 15 "$OUT/train_$tag.log"; }
  echo "($((SECONDS - t0)) s)"
}

run bf16 120 --dtype bf16
run f32 120 --dtype f32
run bf16_acc3 150 --dtype bf16 --accumulation 3
run bf16_compile 180 --dtype bf16 --compile
if [ "${ASYNC:-0}" = 1 ] || [[ " ${CONFIGS:-} " == *_async* ]]; then
  run bf16_async 120 --dtype bf16 --ours-validate off
  run f32_async 120 --dtype f32 --ours-validate off
fi
