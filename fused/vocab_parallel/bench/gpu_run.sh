#!/usr/bin/env bash
# The vocab-parallel cuda ranks' device session in one call, for a lent GPU machine with no Eigen/GTest/OpenBLAS:
#   fused/vocab_parallel/bench/gpu_run.sh stage BUILD STAGE   (here) copy vocab_parallel_cuda_tests, simpo-verify,
#                                                            vocab_parallel_bench, their gpu CTest file and the
#                                                            host libraries the device lacks into STAGE
#   fused/vocab_parallel/bench/gpu_run.sh run STAGE [PARTS]   (there) PARTS (default "ctest case bench"): ctest -L gpu;
#                                                            case --impl cuda --vocab-shards 1 2 3 on a mid-size
#                                                            shape; the bench (BENCH_ARGS, default G = 2, 4 in
#                                                            process against one GPU, B = 2, 8, V=256000)
# NCCL_NVLS_ENABLE=0 throughout (NVLink multicast off; nccl_collectives.cu forces it too). Logs in $OUT.
set -u
mode=${1:?stage or run}
if [ "$mode" = stage ]; then
  build=$(realpath "${2:?build folder}"); stage=${3:?stage folder}
  rm -rf "$stage" && mkdir -p "$stage/lib" || exit 2
  cp "$build/fused/vocab_parallel/vocab_parallel_cuda_tests" "$build/fused/vocab_parallel/vocab_parallel_bench" \
     "$build/simpo-verify" "$stage/" || exit 2
  (cd "$build/fused/vocab_parallel" && ctest -N > /dev/null) || exit 2
  sed "s|$build/fused/vocab_parallel|@DIR@|g" "$build/fused/vocab_parallel/vocab_parallel_cuda_tests[1]_tests.cmake" \
    > "$stage/CTestTestfile.cmake.in" || exit 2
  for lib in libgomp.so.1 libgfortran.so.5 libquadmath.so.0; do cp -L "$(g++ -print-file-name=$lib)" "$stage/lib/" || exit 2; done
  gzip -c /usr/lib/x86_64-linux-gnu/libopenblas.so.0 > "$stage/lib/libopenblas.so.0.gz" || exit 2
  du -sh "$stage"
  exit 0
fi

stage=$(realpath "${2:?stage folder}")
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
gunzip -kf "$stage/lib/libopenblas.so.0.gz"
sed "s|@DIR@|$stage|g" "$stage/CTestTestfile.cmake.in" > "$stage/CTestTestfile.cmake"
# CUDA libraries (NCCL too) from the toolkit or a wheel where the loader does not find them; host ones from the stage.
. "$(dirname "$0")/../../../scripts/device_libraries.sh"
device_libraries "$stage/vocab_parallel_cuda_tests" "$stage/lib" libcublasLt.so.13 libcublas.so.13 libcudart.so.13 libnccl.so.2
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$stage/lib"
ldd "$stage/simpo-verify" | grep -E "not found|nccl|cublas"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u

parts=" ${3:-ctest case bench} "
if [[ $parts == *" ctest "* ]]; then
  echo "== ctest -L gpu (vocab_parallel_cuda_tests)"
  (cd "$stage" && ctest -L gpu -j4 --output-on-failure --timeout 200) > "$OUT/ctest.log" 2>&1
  echo "ctest exit $?"; grep -E "tests passed|tests failed|Failed|\*\*\*|Skipped" "$OUT/ctest.log" | head -20
fi
if [[ $parts == *" case "* ]]; then
  shape="--B 4 --T 256 --H 1000 --V 32003 --bias --seed 7"
  for G in 1 2 3; do
    echo "== simpo-verify case --impl cuda --vocab-shards $G $shape"
    timeout 120 "$stage/simpo-verify" case --impl cuda --vocab-shards $G $shape > "$OUT/case$G.log" 2>&1
    echo "exit $?"; grep -vE "^ *(loss|nll|chosen|rejected|grad)" "$OUT/case$G.log" | head -12
  done
fi
if [[ $parts == *" bench "* ]]; then
  echo "== vocab_parallel_bench ${BENCH_ARGS:=--B 2 8 --shards 2 4} (T=1024 H=4096 V=256000)"
  timeout 300 "$stage/vocab_parallel_bench" $BENCH_ARGS --reps 5 2>&1 | tee "$OUT/bench.log"
fi
date -u
