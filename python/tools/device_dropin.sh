#!/usr/bin/env bash
# The torch drop-in's device proofs in one call (python/README.md, "Device proofs"): install the carried wheels,
# then
#   1. this package's torch tests (python/tests/test_torch.py: every dtype, frozen inputs, grad_output, no_grad);
#   2. Liger-Kernel's test_simpo_loss.py with our module (test_simpo_ours.py: its two imports replaced) and, in
#      the same call, as Liger ships it;
#   3. bench_peers.py: ours against the floor and at grad_output 1/3 against 1, each timed in turns (bf16; the
#      drop-in bars' ratios), and ours against torch eager in float32 (torch's fp32 GEMMs, TF32 off).
# Carried (ignored folders): .whl (simpo_verify cp312 wheel, liger-kernel), .pylibs (the extension's Debian shared
# libraries: OpenBLAS, MPFR, ...; libopenblas gzipped), .liger-test (Liger-Kernel's test files). Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
. scripts/device_libraries.sh
unpack_carried_libraries .pylibs /tmp/pylibs
export PYTHONPATH=/tmp/site:$PWD/python/tools LD_LIBRARY_PATH=/tmp/pylibs:${LD_LIBRARY_PATH:-}
date -u; nvidia-smi -L
python3 -c "import simpo_verify as sv, torch; print('simpo_verify', sv.__file__, 'cuda', sv.cuda_available(), 'torch', torch.__version__)" || exit 1

echo "== python/tests/test_torch.py"
timeout 240 python3 -m pytest -q -p no:cacheprovider python/tests/test_torch.py 2>&1 | tail -15
echo "== Liger's test_simpo_loss.py: with our module, then with Liger's"
(cd .liger-test && timeout 300 python3 -m pytest -q -p no:cacheprovider test/chunked_loss/test_simpo_ours.py \
   --junitxml=$OUT/liger-ours.xml 2>&1 | tail -8)
(cd .liger-test && timeout 300 python3 -m pytest -q -p no:cacheprovider test/chunked_loss/test_simpo_loss.py \
   --junitxml=$OUT/liger-liger.xml 2>&1 | tail -4)
echo "== bench: bf16, in turns: ours against the floor, grad_output 1/3 against 1"
timeout 200 python3 python/tools/bench_peers.py $OUT/dropin-bf16.json --impls "" --batches ${BATCHES:-2,4,8,16} \
  --paired floor:ours,ours:ours_third --reps ${REPS:-15} 2>&1 | grep -E "^B="
echo "== bench: float32, ours and torch eager"
timeout 200 python3 python/tools/bench_peers.py $OUT/dropin-f32.json --dtype f32 --impls ours,torch_eager \
  --batches ${F32_BATCHES:-2,4} --reps 3 2>&1 | grep -E "^B="
