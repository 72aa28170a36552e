#!/usr/bin/env bash
# The cuda backend's GPU session in one call, for a lent GPU machine that has no Eigen/GTest to build with:
#   fused/cuda/bench/gpu_run.sh stage BUILD STAGE   (here) copy the built cuda_backend_test, cuda_bench and
#                                                  fused_accuracy_table, a CTest file of the gpu-labelled tests and
#                                                  libgomp into STAGE
#   fused/cuda/bench/gpu_run.sh run STAGE           (there) ctest -L gpu, compute-sanitizer memcheck (whole
#                                                  suite) and racecheck (small cases), fused_accuracy_table
#                                                  --backend cuda, cuda_bench;
#                                                  logs in $OUT
set -u
mode=${1:?stage or run}
if [ "$mode" = stage ]; then
  build=${2:?build folder}; stage=${3:?stage folder}
  rm -rf "$stage" && mkdir -p "$stage/lib" || exit 2
  cp "$build/fused/cuda/cuda_backend_test" "$build/fused/cuda/cuda_bench" "$build/fused/tests/fused_accuracy_table" "$stage/" || exit 2
  # The discovered tests (add_test + LABELS gpu) with their absolute build path made relocatable; listing
  # them here (ctest -N) refreshes the discovery, which needs no GPU.
  (cd "$build/fused/cuda" && ctest -N > /dev/null) || exit 2
  sed "s|$(realpath "$build")/fused/cuda|@DIR@|g" "$build/fused/cuda/cuda_backend_test[1]_tests.cmake" \
    > "$stage/CTestTestfile.cmake.in" || exit 2
  cp "$(g++ -print-file-name=libgomp.so.1)" "$stage/lib/" || exit 2
  exit 0
fi

stage=$(realpath "${2:?stage folder}")
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
sed "s|@DIR@|$stage|g" "$stage/CTestTestfile.cmake.in" > "$stage/CTestTestfile.cmake"
# Libraries the binaries need that this machine may keep elsewhere: cuBLAS(Lt) from the toolkit or a wheel,
# libgomp (OpenMP of the reference) from the stage as a last resort.
for lib in libcublasLt.so.13 libcublas.so.13 libcudart.so.13; do
  if ldd "$stage/cuda_backend_test" | grep "$lib" | grep -q "not found"; then
    dir=$(dirname "$(find / -name "$lib" -not -path '/proc/*' 2>/dev/null | head -1)")
    export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
  fi
done
ldd "$stage/cuda_backend_test" | grep -q "libgomp.*not found" && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$stage/lib"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv

echo "== ctest -L gpu"
(cd "$stage" && ctest -L gpu --output-on-failure --timeout 400) > "$OUT/ctest.log" 2>&1
echo "ctest exit $?"; grep -E "tests passed|tests failed|Failed|\*\*\*" "$OUT/ctest.log" | head -30

# The whole suite but the out-of-memory test, whose deliberate 1 PiB cudaMalloc memcheck counts as an API error.
echo "== compute-sanitizer --tool memcheck, whole suite"
compute-sanitizer --tool memcheck --error-exitcode 9 "$stage/cuda_backend_test" \
  --gtest_filter='-CudaBackendErrors.OutOfDeviceMemoryIsAnInputErrorNamingTheBytes' > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $?"; grep -E "ERROR SUMMARY|tests ran|PASSED|FAILED" "$OUT/memcheck.log" | tail -6

# racecheck sees our kernels only (kns=simpo: they all live in namespace simpo); it still runs cuBLASLt's
# kernels, and has died inside them ("Internal Sanitizer Error ... hardware exception" in cublasLtMatmul) on
# tests that memcheck passes cleanly, so each small test runs in its own process.
for t in CudaBackendFeatures.Bias CudaBackendFeatures.EmptySequenceTreatedAsZero \
         CudaBackendFeatures.OddSizesBothSchedules CudaBackendSchedules.TwoPassAgreesWithThreePass; do
  echo "== compute-sanitizer --tool racecheck on $t"
  compute-sanitizer --tool racecheck --kernel-name kns=simpo --error-exitcode 9 "$stage/cuda_backend_test" \
    --gtest_filter="$t" > "$OUT/racecheck_one.log" 2>&1
  echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|Internal|PASSED|FAILED  \]" "$OUT/racecheck_one.log" | head -4
  { echo "==== $t"; cat "$OUT/racecheck_one.log"; } >> "$OUT/racecheck.log"; rm "$OUT/racecheck_one.log"
done

# Accuracy and speed with the default logits slicing (fused::Options::logits_k_slice = 256), then without it
# (one logits GEMM: fastest, scalars biased by the tensor cores' accumulation).
acc="$stage/fused_accuracy_table --backend cuda --T 256 --V 32000"
echo "== accuracy table (default slicing)"
$acc --H 1024 2>&1 | tee "$OUT/accuracy.log"
echo "== accuracy table at H=4096 (default slicing)"
$acc --H 4096 --B 2 8 2>&1 | tee -a "$OUT/accuracy.log"
echo "== accuracy table at H=4096, one logits GEMM"
$acc --H 4096 --B 2 --logits-k-slice 0 2>&1 | tee -a "$OUT/accuracy.log"

echo "== cuda_bench (default slicing)"
"$stage/cuda_bench" 2>&1 | tee "$OUT/bench.log"
for s in 1 4 8; do
  echo "== cuda_bench, logits k in $s slice(s)"
  "$stage/cuda_bench" --logits-k-splits $s 2>&1 | tee -a "$OUT/bench.log"
done
echo "== cuda_bench, 256 MiB workspace (the two_pass fallback)"
"$stage/cuda_bench" --B 2 --workspace-mib 256 --reps 5 2>&1 | tee "$OUT/bench_small_workspace.log"
