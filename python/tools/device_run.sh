#!/usr/bin/env bash
# The device proofs of python/README.md in one call (the lent H200): install the carried wheels, then
#   1. in parallel: the five peers' sweeps, Liger's SimPO tests with our module in place of Liger's (and with
#      Liger's own, for comparison), and this package's pytest (torch and CUDA tests included);
#   2. the benchmark, alone on the GPU;
#   3. the published workload as one case for every peer.
# Carried (ignored folders): .whl (simpo_verify cp312 wheel, liger-kernel, cut-cross-entropy), .pylibs (the
# extension's Debian shared libraries: OpenBLAS, MPFR, ...), .liger-test (Liger-Kernel's test files).
# Every stage has a deadline; what finished is in $OUT whatever happens later.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=3 OPENBLAS_NUM_THREADS=3
SWEEP_BUDGET=${SWEEP_BUDGET:-25} CASES=${CASES:-300} BENCH_BUDGET=${BENCH_BUDGET:-22}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# The extension's Debian libraries, where the image lacks them; CUDA's from the toolkit or torch's wheels.
mkdir -p /tmp/pylibs
for f in .pylibs/*; do
  n=$(basename "$f" .gz)
  ldconfig -p | awk '{print $1}' | grep -qx "$n" && continue
  case "$f" in *.gz) gunzip -c "$f" > /tmp/pylibs/$n ;; *) cp "$f" /tmp/pylibs/ ;; esac
done
cuda_libs=$(dirname "$(find /usr/local/cuda/ /usr/local/lib /opt -name 'libcublasLt.so.13' 2>/dev/null | head -1)" 2>/dev/null)
export PYTHONPATH=/tmp/site:$PWD/python/tools LD_LIBRARY_PATH=/tmp/pylibs:${cuda_libs:-/usr/local/cuda/lib64}:${LD_LIBRARY_PATH:-}
echo "libraries carried: $(ls /tmp/pylibs | tr '\n' ' '); CUDA libraries: $cuda_libs"
R=$OUT/r; mkdir -p $R   # packed into $OUT/results.tgz at the end (at most 8 files come back)
date -u; nvidia-smi -L
python3 -c "import simpo_verify as sv, torch; print('simpo_verify', sv.__file__, 'cuda backend', sv.cuda_available(), 'torch', torch.__version__)" || exit 1

start=$(date +%s)
for p in ours torch_eager liger cce cce_exact; do
  timeout $((SWEEP_BUDGET + 25)) python3 python/tools/sweep_peer.py $p $R --cases $CASES --budget $SWEEP_BUDGET \
    > $R/sweep-$p.log 2>&1 &
done
for t in ours loss; do  # Liger's file with our module in place of Liger's, and as Liger ships it
  (cd .liger-test && timeout $((SWEEP_BUDGET + 20)) python3 -m pytest -v -p no:cacheprovider --no-header \
     test/chunked_loss/test_simpo_$t.py --junitxml=$R/liger-$t.xml > $R/liger-$t.log 2>&1) &
done
timeout $((SWEEP_BUDGET + 20)) python3 -m pytest -q -p no:cacheprovider python/tests > $R/pytest.log 2>&1 &
wait
echo "stage 1: $(( $(date +%s) - start )) s"; tail -n 3 $R/pytest.log $R/liger-*.log; grep -h "cases in" $R/sweep-*.log

OMP_NUM_THREADS=16 OPENBLAS_NUM_THREADS=16 timeout $((BENCH_BUDGET + 15)) python3 python/tools/bench_peers.py $R/peers.json --budget $BENCH_BUDGET --reps 3
echo "stage 2: $(( $(date +%s) - start )) s"
OMP_NUM_THREADS=16 OPENBLAS_NUM_THREADS=16 timeout 35 python3 python/tools/published_case.py $R > $R/published.log 2>&1
grep -E "^(reference|ours|torch_eager|liger|cce)" $R/published.log
echo "stage 3: $(( $(date +%s) - start )) s"
cp $R/peers.json $R/published.json $OUT/ 2>/dev/null; tar czf $OUT/results.tgz -C $R . && rm -rf $R; ls -la $OUT
