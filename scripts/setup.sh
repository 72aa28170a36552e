#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks (as root, apt-get), then configures and builds into build/.
# Idempotent: a second run installs nothing and rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake ninja-build g++ clang libclang-rt-14-dev libomp-dev libeigen3-dev libgtest-dev librapidcheck-dev libcli11-dev nlohmann-json3-dev libmpfr-dev libopenblas-dev
          python3 python3-numpy python3-venv python3-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The CUDA Toolkit is used where it is installed (nvcc); without it everything else still builds. With it,
# configure fetches the pinned CUTLASS headers from PyPI into .cutlass/include (the sm_90 promoted logits GEMM:
# cmake/fetch_cutlass.cmake) and says so; where PyPI is unreachable it warns and the sliced cuBLAS path is built.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi

# The Python package (python/) builds against a venv: Debian's python3 refuses pip installs system-wide. Its
# build tools and test dependencies come from PyPI; without PyPI the package is skipped (CMake says so).
venv=build/venv
if ! "$venv/bin/python" -c "import nanobind, numpy, ml_dtypes, pytest" 2>/dev/null; then
  /usr/bin/python3 -m venv "$venv" &&
    "$venv/bin/pip" install -q --disable-pip-version-check scikit-build-core nanobind numpy ml_dtypes pytest ||
    echo "setup: no Python packages from PyPI: the Python package simpo_verify is not built" >&2
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PWD/$venv/bin/python" >/dev/null
cmake --build build -j"$(nproc)"
# The venv imports the package from the build tree (build/python/simpo_verify), as ctest's pytest does.
if [ -d build/python/simpo_verify ]; then
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$PWD/build/python" > "$site/simpo_verify_build.pth"
fi
