#!/usr/bin/env bash
# reference-cuda's GPU session in one call, for a lent GPU machine that has no Eigen/GTest/OpenBLAS to build with:
#   reference/cuda/gpu_run.sh stage BUILD STAGE   (here) copy reference_cuda_tests, reference_cuda_bench,
#                                                reference_bench, reference_write_numpy_cases, simpo_numpy.py,
#                                                simpo-verify if built, a relocatable CTest file of the gpu tests, and
#                                                the libraries the device may lack (libgomp, OpenBLAS, gfortran)
#   reference/cuda/gpu_run.sh run STAGE           (there, from the repository root) ctest -L gpu, memcheck of the
#                                                agreement sweep, reference_cuda_bench at the published workload
#                                                (B = 2, 16), the portable CPU reference's bench on the host's
#                                                cores, the main job's throughput with the cuda backend
#                                                (step mainjob) and simpo-verify case at B = 2 when built; logs in $OUT
set -u
mode=${1:?stage or run}
if [ "$mode" = stage ]; then
  build=$(realpath "${2:?build folder}"); stage=${3:?stage folder}
  rm -rf "$stage" && mkdir -p "$stage/lib" || exit 2
  cp "$build/reference/reference_cuda_tests" "$build/reference/reference_cuda_bench" "$build/reference/reference_bench" \
     "$build/reference/reference_write_numpy_cases" reference/independent/simpo_numpy.py "$stage/" || exit 2
  [ -x "$build/simpo-verify" ] && cp "$build/simpo-verify" "$stage/"
  # The discovered gtest cases (refreshed by ctest -N, which needs no GPU) with their build path made relocatable,
  # and the numpy check of reference-cuda's outputs (python3 there is the one with numpy).
  (cd "$build/reference" && ctest -N > /dev/null) || exit 2
  sed "s|$build/reference|@DIR@|g" "$build/reference/reference_cuda_tests[1]_tests.cmake" > "$stage/CTestTestfile.cmake.in" || exit 2
  cat >> "$stage/CTestTestfile.cmake.in" <<'CTEST'
add_test(reference_cuda_numpy_write_cases "@DIR@/reference_write_numpy_cases" "@DIR@/numpy_cases_cuda" "cuda")
add_test(reference_cuda_numpy_agrees "python3" "@DIR@/simpo_numpy.py" "--cases-dir" "@DIR@/numpy_cases_cuda")
set_tests_properties(reference_cuda_numpy_write_cases reference_cuda_numpy_agrees PROPERTIES LABELS gpu SKIP_RETURN_CODE 77)
set_tests_properties(reference_cuda_numpy_agrees PROPERTIES DEPENDS reference_cuda_numpy_write_cases)
CTEST
  for lib in libgomp.so.1 libgfortran.so.5 libquadmath.so.0; do cp -L "$(g++ -print-file-name=$lib)" "$stage/lib/" || exit 2; done
  cp -L /usr/lib/x86_64-linux-gnu/libopenblas.so.0 "$stage/lib/" || exit 2
  du -sh "$stage"
  exit 0
fi

stage=$(realpath "${2:?stage folder}")
repo=$PWD
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
sed "s|@DIR@|$stage|g" "$stage/CTestTestfile.cmake.in" > "$stage/CTestTestfile.cmake"
# cuBLAS from the toolkit or a wheel where the loader does not find it; the host libraries from the stage last.
. "$(dirname "$0")/../../scripts/device_libraries.sh"
device_libraries "$stage/reference_cuda_tests" "$stage/lib"
ldd "$stage/reference_cuda_tests" | grep "not found"
export SIMPO_FIXTURES_DIR="$repo/fixtures/cases"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
lscpu | grep -E "^Model name|^CPU\(s\)"; date -u

# Steps: SIMPO_GPU_STEPS (default "ctest bench memcheck cpu case"), so a short lease can run the first ones only.
steps=" ${SIMPO_GPU_STEPS:-ctest bench memcheck cpu case} "
if [[ $steps == *" ctest "* ]]; then
  echo "== ctest -L gpu"
  (cd "$stage" && ctest -L gpu -j8 -V --timeout 120) > "$OUT/ctest.log" 2>&1
  echo "ctest exit $?"; grep -E "tests passed|tests failed|\*\*\*|Skipped|Not Run|Failed  " "$OUT/ctest.log" | head -30
  echo "largest disagreements (agreement tests):"
  grep -hoE "\[ [^]]* \] largest disagreement [0-9.e+-]+ \([a-z_]+\)" "$OUT/ctest.log" | awk '{print $(NF-1), $0}' | sort -g | tail -3 | cut -d' ' -f2-
  grep -hoE "worst \|error\| / tolerance = [0-9.e+-]+" "$OUT/ctest.log" | sort -t= -k2 -g | tail -1
fi
if [[ $steps == *" bench "* ]]; then
  echo "== reference_cuda_bench (published workload, B = 2 and 16)"
  timeout 150 "$stage/reference_cuda_bench" --B 2 16 --reps ${SIMPO_BENCH_REPS:-2} 2>&1 | tee "$OUT/bench.log"
fi
if [[ $steps == *" memcheck "* ]]; then
  echo "== compute-sanitizer memcheck, agreement sweep and schedules"
  timeout 45 compute-sanitizer --tool memcheck --error-exitcode 9 "$stage/reference_cuda_tests" \
    --gtest_filter='CudaAgreesWithCpu.RandomSweep*:Invariance.ScheduleDoesNotChangeTheResult:Invariance.GradXRows*' > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" | tail -4
fi
if [[ $steps == *" cpu "* ]]; then
  echo "== the portable CPU reference on this host's cores (a quarter of the B = 2 workload)"
  timeout 50 "$stage/reference_bench" --B 2 --T 256 --H 4096 --V 128256 2>&1 | tee "$OUT/cpu_bench.log"
fi
if [[ $steps == *" mainjob "* ]] && [ -x "$stage/simpo-verify" ]; then
  # Issue 12's throughput bar: cases judged per second by the main job with the cuda backend, on every core and
  # on one (the sequential sweep the 3,058 cases/minute baseline was measured with).
  for threads in 0 1; do
    echo "== simpo-verify --impl cuda --no-fixtures --time-budget ${SIMPO_MAINJOB_S:-30} --threads $threads"
    "$stage/simpo-verify" --impl cuda --no-fixtures --time-budget ${SIMPO_MAINJOB_S:-30} --threads $threads \
      --counterexample-dir "$OUT/counterexamples" > "$OUT/mainjob-$threads.log" 2>&1
    echo "main job exit $?"; grep -E "cases in|passed, .* failed|FAILED" "$OUT/mainjob-$threads.log" | head -5
  done
fi
if [[ $steps == *" case "* ]] && [ -x "$stage/simpo-verify" ]; then
  echo "== simpo-verify case --B 2 --T 1024 --H 4096 --V 128256 --impl cuda --reference cuda"
  /usr/bin/time -v "$stage/simpo-verify" case --B 2 --T 1024 --H 4096 --V 128256 --impl cuda --reference cuda > "$OUT/case.log" 2>&1
  echo "case exit $?"; grep -vE "^\s+(Page|Volun|Invol|Swaps|File|Socket|Signals|Average|Minor|Major|Exit)" "$OUT/case.log" | tail -25
fi
