#!/usr/bin/env bash
# Puts CUTLASS's C++ headers (the pinned PyPI nvidia-cutlass wheel's include folder) into .cutlass/include,
# where fused/cuda/CMakeLists.txt looks by default (or pass -DSIMPO_CUTLASS_DIR=...). Only the sm_90 promoted
# logits GEMM needs them; builds without them (CI: no nvcc) keep the sliced cuBLAS path.
set -euo pipefail
version=4.2.0.0
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
dest="$root/.cutlass"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --only-binary=:all: "nvidia-cutlass==$version" -d "$tmp"
rm -rf "$dest/include" && mkdir -p "$dest"
(cd "$tmp" && unzip -q nvidia_cutlass-*.whl 'cutlass_library/source/include/*' && mv cutlass_library/source/include "$dest/include")
grep -qx '/.cutlass/' "$root/.git/info/exclude" 2>/dev/null || echo '/.cutlass/' >> "$(git -C "$root" rev-parse --git-path info/exclude)"
echo "CUTLASS $version headers in $dest/include"
