#!/usr/bin/env bash
# The cuda backend's GPU session in one call, for a lent GPU machine that has no Eigen/GTest to build with:
#   fused/cuda/bench/gpu_run.sh stage BUILD STAGE   (here) copy the built cuda_backend_test, cuda_bench,
#                                                  gemm_accuracy, gemm_floor and fused_accuracy_table, a CTest
#                                                  file of the gpu-labelled tests, libgomp and libcupti into STAGE
#                                                  (and into STAGE/dev the dev/ experiments that were built)
#   fused/cuda/bench/gpu_run.sh run STAGE [PARTS]   (there) PARTS (default all but floor ncu dev): gemm (gemm_accuracy:
#                                                  the logits GEMMs' error and speed), floor (gemm_floor: the best
#                                                  GEMM per step shape, FLOOR_ARGS), ctest (ctest -L gpu), accuracy
#                                                  (fused_accuracy_table --backend cuda), bench (cuda_bench, B=2..16,
#                                                  the BENCH_EXTRA forms and the 64 MiB low-memory schedule),
#                                                  sanitize (memcheck on the suite, racecheck on
#                                                  small cases), ncu (Nsight Compute on the step's GEMMs at
#                                                  NCU_B), dev (each dev/ experiment staged: those built with
#                                                  `--target NAME`); logs in $OUT
# Knobs (environment): FLOOR_ARGS (gemm_floor's arguments, default none: M = 2048 4096), BENCH_EXTRA (';'-separated cuda_bench argument sets, each run at every B), ACCURACY_EXTRA
# (the same for fused_accuracy_table), SMALL_WORKSPACE, LOW_MEMORY_ARGS (cuda_bench arguments added to the 64 MiB
# run), PEERS_JSON (default: bench/peers.json),
# MEMCHECK_FILTER/_TIMEOUT, RACECHECK_TESTS/_TIMEOUT/_ALL_ONLY, NCU_B/_COUNT/_TIMEOUT, DEV_ONLY/_ARGS/_TIMEOUT.
set -u
mode=${1:?stage or run}
if [ "$mode" = stage ]; then
  build=${2:?build folder}; stage=${3:?stage folder}
  rm -rf "$stage" && mkdir -p "$stage/lib" || exit 2
  cp "$build/fused/cuda/cuda_backend_test" "$build/fused/cuda/cuda_bench" "$build/fused/cuda/gemm_accuracy" \
     "$build/fused/cuda/gemm_floor" "$build/fused/tests/fused_accuracy_table" "$stage/" || exit 2
  # The dev/ experiments that were built (`cmake --build BUILD --target NAME`), for the dev part.
  mkdir -p "$stage/dev" || exit 2
  for f in "$(dirname "$0")"/../dev/*.cu; do
    e=$(basename "$f" .cu)
    [ -x "$build/fused/cuda/$e" ] && { cp "$build/fused/cuda/$e" "$stage/dev/" || exit 2; }
  done
  # The discovered tests (add_test + LABELS gpu) with their absolute build path made relocatable; listing
  # them here (ctest -N) refreshes the discovery, which needs no GPU.
  (cd "$build/fused/cuda" && ctest -N > /dev/null) || exit 2
  sed "s|$(realpath "$build")/fused/cuda|@DIR@|g" "$build/fused/cuda/cuda_backend_test[1]_tests.cmake" \
    > "$stage/CTestTestfile.cmake.in" || exit 2
  cp "$(g++ -print-file-name=libgomp.so.1)" "$stage/lib/" || exit 2
  # CUPTI (cuda_bench --kernels), which the lent machine's loader does not find.
  cp "$(find /usr/local/cuda/ -name libcupti.so.13 | head -1)" "$stage/lib/" || exit 2
  exit 0
fi

stage=$(realpath "${2:?stage folder}")
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
sed "s|@DIR@|$stage|g" "$stage/CTestTestfile.cmake.in" > "$stage/CTestTestfile.cmake"
# Libraries the binaries need that this machine may keep elsewhere (scripts/device_libraries.sh).
. "$(dirname "$0")/../../../scripts/device_libraries.sh"
device_libraries "$stage/cuda_backend_test" "$stage/lib"
device_libraries "$stage/cuda_bench" "$stage/lib"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv

parts=${3:-gemm ctest accuracy bench sanitize}
want() { [[ " $parts " == *" $1 "* ]]; }
summary=()

if want gemm; then
  echo "== gemm_accuracy"
  "$stage/gemm_accuracy" 2>&1 | tee "$OUT/gemm.log"
  summary+=("gemm_accuracy exit ${PIPESTATUS[0]}")
fi

if want floor; then
  # Not in the default parts: some minutes per M (every candidate, each timed beside cuBLAS's default).
  echo "== gemm_floor ${FLOOR_ARGS:-}"
  "$stage/gemm_floor" ${FLOOR_ARGS:-} 2>&1 | tee "$OUT/floor.log"
  summary+=("gemm_floor exit ${PIPESTATUS[0]}")
fi

if want ctest; then
  echo "== ctest -L gpu"
  (cd "$stage" && ctest -L gpu --output-on-failure --timeout 400) > "$OUT/ctest.log" 2>&1
  rc=$?; grep -E "tests passed|tests failed|Failed|\*\*\*" "$OUT/ctest.log" | head -30
  summary+=("ctest exit $rc: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log")")
fi

if want accuracy; then
  # The default logits GEMM (promoted on sm_90), at both H, logit scales 2 and 30.
  acc="$stage/fused_accuracy_table --backend cuda --T 256 --V 32000"
  echo "== accuracy table, default logits GEMM"
  $acc --H 1024 2>&1 | tee "$OUT/accuracy.log"
  $acc --H 4096 --B 2 8 2>&1 | tee -a "$OUT/accuracy.log"
  # ACCURACY_EXTRA: ';'-separated flag sets, the same table again with each (e.g. --fp32-logits).
  aextra=()
  [ -n "${ACCURACY_EXTRA:-}" ] && IFS=';' read -r -a aextra <<< "$ACCURACY_EXTRA"
  for args in "${aextra[@]}"; do
    echo "== accuracy table $args"
    $acc --H 1024 $args 2>&1 | tee -a "$OUT/accuracy.log"
    $acc --H 4096 --B 2 8 $args 2>&1 | tee -a "$OUT/accuracy.log"
  done
fi

if want bench; then
  echo "== cuda_bench, default (B 2 4 8 16)"
  "$stage/cuda_bench" 2>&1 | tee "$OUT/bench.log"
  # BENCH_EXTRA: ';'-separated argument sets, each run at every B (empty: none). Default: the full step's other
  # kept-logits form (fp32), so the default's choice (distances) is measured against it in the same call.
  extra=("--fp32-logits")
  [ -n "${BENCH_EXTRA+x}" ] && IFS=';' read -r -a extra <<< "$BENCH_EXTRA"
  for args in "${extra[@]}"; do
    echo "== cuda_bench $args"
    "$stage/cuda_bench" $args 2>&1 | tee -a "$OUT/bench.log"
  done
  if [ "${SMALL_WORKSPACE:-1}" = 1 ]; then
    echo "== cuda_bench, 64 MiB workspace (the low-memory schedule)"
    "$stage/cuda_bench" --B 16 --workspace-mib 64 --reps 5 ${LOW_MEMORY_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
  fi
  python3 "$(dirname "$0")/speed_table.py" "$OUT/bench.log" --json "$OUT/speed.json" --png "$OUT/speed.png" \
    --peers "${PEERS_JSON:-$(dirname "$0")/peers.json}" 2>&1 | tee -a "$OUT/bench.log"
fi

if want dev; then
  # Not in the default parts: each staged dev/ experiment (fused/cuda/dev/README.md), or those DEV_ONLY names, with
  # its defaults and DEV_ARGS.
  for e in "$stage"/dev/*; do
    [ -x "$e" ] || continue
    [ -n "${DEV_ONLY:-}" ] && [[ " $DEV_ONLY " != *" $(basename "$e") "* ]] && continue
    echo "== dev/$(basename "$e") ${DEV_ARGS:-}"
    timeout ${DEV_TIMEOUT:-300} "$e" ${DEV_ARGS:-} 2>&1 | tee -a "$OUT/dev.log"
    summary+=("dev/$(basename "$e") exit ${PIPESTATUS[0]}")
  done
fi

if want ncu; then
  # Not in the default parts: Nsight Compute's view of the step's GEMMs (ours: CUTLASS device_kernel; the floor's:
  # cuBLAS nvjet/gemm) at one B, for where a GEMM loses to the floor (tensor-pipe use, stalls, L2 and DRAM traffic).
  # Clocks left as the card runs them (--clock-control none), so the durations compare with cuda_bench's.
  echo "== ncu, cuda_bench --B ${NCU_B:-4}, the first ${NCU_COUNT:-8} GEMM launches"
  timeout ${NCU_TIMEOUT:-300} ncu --clock-control none --kernel-name regex:"device_kernel|nvjet|gemm" \
    --launch-count ${NCU_COUNT:-8} --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section LaunchStats "$stage/cuda_bench" --B ${NCU_B:-4} --reps 1 --warmup 0 > "$OUT/ncu.txt" 2>&1
  rc=$?
  grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|DRAM Throughput|L2 Cache Throughput|Issue Slots Busy|Registers Per" \
    "$OUT/ncu.txt" | head -80
  summary+=("ncu exit $rc (report in ncu.txt)")
fi

if want sanitize; then
  # The whole suite but the out-of-memory test, whose deliberate 1 PiB cudaMalloc memcheck counts as an API error.
  echo "== compute-sanitizer --tool memcheck, whole suite"
  timeout ${MEMCHECK_TIMEOUT:-600} compute-sanitizer --tool memcheck --error-exitcode 9 "$stage/cuda_backend_test" \
    --gtest_filter="${MEMCHECK_FILTER:--CudaBackendErrors.OutOfDeviceMemoryIsAnInputErrorNamingTheBytes}" > "$OUT/memcheck.log" 2>&1
  rc=$?; grep -E "ERROR SUMMARY|tests ran|PASSED|FAILED" "$OUT/memcheck.log" | tail -6
  summary+=("memcheck exit $rc: $(grep 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)")
  # racecheck on small tests, each in its own process: our kernels (kns=simpo), then everything (CUTLASS and
  # cuBLAS too), since it has died inside cublasLtMatmul before.
  filters=("--kernel-name kns=simpo" "")
  [ "${RACECHECK_ALL_ONLY:-0}" = 1 ] && filters=("")
  for filter in "${filters[@]}"; do
    for t in ${RACECHECK_TESTS:-CudaBackendFeatures.Bias CudaBackendFeatures.OddSizesBothSchedules CudaBackendSchedules.TwoPassAgreesWithThreePass}; do
      echo "== compute-sanitizer --tool racecheck $filter on $t"
      timeout ${RACECHECK_TIMEOUT:-120} compute-sanitizer --tool racecheck $filter --error-exitcode 9 "$stage/cuda_backend_test" \
        --gtest_filter="$t" > "$OUT/racecheck_one.log" 2>&1
      rc=$?; grep -E "RACECHECK SUMMARY|Internal|PASSED|FAILED  \]" "$OUT/racecheck_one.log" | head -4
      summary+=("racecheck '$filter' $t exit $rc: $(grep -E 'RACECHECK SUMMARY|Internal' "$OUT/racecheck_one.log" | head -1)")
      { echo "==== $filter $t"; cat "$OUT/racecheck_one.log"; } >> "$OUT/racecheck.log"; rm "$OUT/racecheck_one.log"
    done
  done
fi

echo "== summary"
printf '%s\n' "${summary[@]}"
[ -f "$OUT/floor.log" ] && grep -E "^device|^peak|^FLOOR|REJECTED|REFERENCE WRONG" "$OUT/floor.log"
[ -f "$OUT/bench.log" ] && grep -E "^ *[0-9]+ \||^device|^==" "$OUT/bench.log"
