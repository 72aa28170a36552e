#!/usr/bin/env bash
# The device proofs of python/README.md in one call (the lent H200): install the carried wheels, then
#   1. in parallel: the five peers' sweeps over the fixed shapes (sweep_peer.py --fixed: one compile per shape and
#      hyperparameter set for Liger and CCE), ours and torch eager over the sweep's own distribution as well,
#      Liger's SimPO tests with our module in place of Liger's, this package's pytest (torch and CUDA tests
#      included), the published workload as one case for every peer, and a one-rep benchmark of Liger and CCE at
#      B = 2, 4 that fills the compile caches (torch.compile's FX graph and Triton caches are on disk) for stage 2;
#   2. the CCE probe, then the benchmark at B = 2, 4, 8, 16, alone on the GPU (bench_peers.py --cce-probe).
# Carried (ignored folders): .whl (simpo_verify cp312 wheel, liger-kernel, cut-cross-entropy), .liger-test (Liger-Kernel's
# test files), and for a wheel not repaired by build_wheel.sh .pylibs (its Debian shared libraries: OpenBLAS, MPFR, ...).
# Every stage has a deadline; what finished is in $OUT whatever happens later.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2
SWEEP_BUDGET=${SWEEP_BUDGET:-75} CASES=${CASES:-300} BENCH_BUDGET=${BENCH_BUDGET:-55} REPS=${REPS:-10}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# The extension's Debian libraries, where the image lacks them; CUDA's from the toolkit or torch's wheels.
. scripts/device_libraries.sh
unpack_carried_libraries .pylibs /tmp/pylibs --skip-present  # none with build_wheel.sh's repaired wheel
cuda_libs=$(dirname "$(find /usr/local/cuda/ /usr/local/lib /opt -name 'libcublasLt.so.13' 2>/dev/null | head -1)" 2>/dev/null)
export PYTHONPATH=/tmp/site:$PWD/python/tools LD_LIBRARY_PATH=/tmp/pylibs:${cuda_libs:-/usr/local/cuda/lib64}:${LD_LIBRARY_PATH:-}
echo "libraries carried: $(ls /tmp/pylibs | tr '\n' ' '); CUDA libraries: $cuda_libs"
R=$OUT/r; mkdir -p $R   # packed into $OUT/results.tgz at the end (at most 8 files come back)
date -u; nvidia-smi -L
python3 -c "import simpo_verify as sv, torch; print('simpo_verify', sv.__file__, 'cuda backend', sv.cuda_available(), 'torch', torch.__version__)" || exit 1

start=$(date +%s)
stage1=$((SWEEP_BUDGET + 55))  # cases, then up to 8 s of shrinking per failing property, then re-judging
if [ -n "${FIXED_ONLY:-}" ]; then  # e.g. FIXED_ONLY="liger cce" SWEEP_BUDGET=240: those fixed-shape sweeps alone
  for p in $FIXED_ONLY; do
    timeout $stage1 python3 python/tools/sweep_peer.py $p $R --fixed --cases $CASES --budget $SWEEP_BUDGET \
      --shrink-seconds 4 > $R/sweep-$p-fixed.log 2>&1 &
  done
  wait
  grep -h -E "cases in|^wall|liger compiles" $R/sweep-*.log
  tar czf $OUT/results.tgz -C $R . && rm -rf $R; ls -la $OUT
  exit 0
fi
if [ -n "${PEER_REPORT:-}" ]; then
  # The peer report alone: PEER_REPORT="ours torch_eager liger cce cce_exact" (or 1: all five) CASES=100
  # SWEEP_BUDGET=60 [PUBLISHED=1]. One process, the peers one after another on the same case stream (sweep_peer.py's
  # fixed shapes and two hyperparameter sets: Liger's and CCE's compiles paid once), each held to its declaration
  # (peers.py) and judged under strict, bf16_logits and peer; `ours` is the cuda backend through the torch module,
  # declared deterministic. PUBLISHED=1: then the published case once for every peer under the three profiles.
  # Keep (number of peers) x (SWEEP_BUDGET + 30) s, plus 240 s with PUBLISHED, under the run's 600 s.
  [ "$PEER_REPORT" = 1 ] && PEER_REPORT="ours torch_eager liger cce cce_exact"
  targets=""; for p in $PEER_REPORT; do targets="$targets peers:$p"; done
  n=$(echo $PEER_REPORT | wc -w)
  timeout $((n * (SWEEP_BUDGET + 30))) python3 -m simpo_verify.report $targets --torch --device cuda --cases $CASES \
    --budget $SWEEP_BUDGET --shrink-seconds 8 --shapes 2,16,64,1021 --shapes 4,13,37,509 --shapes 6,9,96,3 \
    --hyperparameter-sets 2 --counterexample-dir $R/ce --out $R/peer-report > $R/peer-report.log 2>&1
  echo "peer report: exit $?, $(( $(date +%s) - start )) s"
  if [ -n "${PUBLISHED:-}" ]; then
    OMP_NUM_THREADS=16 OPENBLAS_NUM_THREADS=16 timeout 240 python3 python/tools/published_case.py $R \
      $(echo $PEER_REPORT | tr ' ' ',') > $R/published.log 2>&1
    grep -E "^(generate|ours|torch_eager|liger|cce)" $R/published.log
  fi
  cat $R/peer-report.md 2>/dev/null || tail -30 $R/peer-report.log
  cp $R/peer-report.md $R/peer-report.json $OUT/ 2>/dev/null
  tar czf $OUT/results.tgz -C $R . && rm -rf $R; ls -la $OUT
  exit 0
fi
for p in ours torch_eager liger cce cce_exact; do
  timeout $stage1 python3 python/tools/sweep_peer.py $p $R --fixed --cases $CASES --budget $SWEEP_BUDGET \
    --shrink-seconds 8 > $R/sweep-$p-fixed.log 2>&1 &
done
for p in ours torch_eager; do
  timeout $stage1 python3 python/tools/sweep_peer.py $p $R --cases $CASES --budget $SWEEP_BUDGET \
    --shrink-seconds 8 > $R/sweep-$p.log 2>&1 &
done
(cd .liger-test && timeout $stage1 python3 -m pytest -v -p no:cacheprovider --no-header \
   test/chunked_loss/test_simpo_ours.py --junitxml=$R/liger-ours.xml > $R/liger-ours.log 2>&1) &
timeout $stage1 python3 -m pytest -q -p no:cacheprovider python/tests > $R/pytest.log 2>&1 &
OMP_NUM_THREADS=6 OPENBLAS_NUM_THREADS=6 timeout $stage1 python3 python/tools/published_case.py $R > $R/published.log 2>&1 &
timeout $stage1 python3 python/tools/bench_peers.py $R/warm.json --batches 2,4 --impls liger,cce --reps 1 --cce-probe \
  > $R/warm.log 2>&1 &
wait
echo "stage 1: $(( $(date +%s) - start )) s"
tail -n 3 $R/pytest.log $R/liger-ours.log; grep -h -E "cases in|^wall|liger compiles" $R/sweep-*.log
grep -E "^(generate|ours|torch_eager|liger|cce)" $R/published.log

OMP_NUM_THREADS=16 OPENBLAS_NUM_THREADS=16 timeout $((BENCH_BUDGET + 45)) python3 python/tools/bench_peers.py \
  $R/peers.json --budget $BENCH_BUDGET --reps $REPS --cce-probe
echo "stage 2: $(( $(date +%s) - start )) s"
cp $R/peers.json $R/published.json $OUT/ 2>/dev/null; tar czf $OUT/results.tgz -C $R . && rm -rf $R; ls -la $OUT
