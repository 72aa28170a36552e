#!/usr/bin/env bash
# Puts CUTLASS's C++ headers (the pinned PyPI nvidia-cutlass wheel's include folder) into .cutlass/include, where
# fused/cuda/CMakeLists.txt looks by default (or pass -DSIMPO_CUTLASS_DIR=...). Configure already does this
# wherever the CUDA backend is built (setup.sh, `pip install ./python`, CI, which has nvcc); this script is for
# fetching by hand, e.g. after configure said PyPI was unreachable. Only the sm_90 promoted logits GEMM needs them;
# builds without them keep the sliced cuBLAS path. The fetch itself is cmake/fetch_cutlass.cmake.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=$(command -v python3 || true)
cmake -DDEST="$root/.cutlass" ${python:+-DPYTHON="$python"} -P "$root/cmake/fetch_cutlass.cmake"
