# Sourced by the device-run scripts (fused/cuda/bench/gpu_run.sh, fused/vocab_parallel/bench/gpu_run.sh,
# reference/cuda/gpu_run.sh, python/tools/device_*.sh): `device_libraries BINARY STAGE_LIB [LIBRARY ...]` puts on LD_LIBRARY_PATH the folder of
# each CUDA library BINARY needs that the loader does not find (the toolkit's or a wheel's, found by name; default:
# cuBLAS, cuBLASLt and the runtime), then STAGE_LIB, last, for the host libraries carried from the build machine
# (OpenMP, OpenBLAS, CUPTI, ...) where the lent machine lacks them.
device_libraries() {
  local binary=$1 stage_lib=$2
  shift 2
  local libs=("$@")
  [ ${#libs[@]} -gt 0 ] || libs=(libcublasLt.so.13 libcublas.so.13 libcudart.so.13)
  local lib dir
  for lib in "${libs[@]}"; do
    if ldd "$binary" | grep "$lib" | grep -q "not found"; then
      dir=$(dirname "$(find / -name "$lib" -not -path '/proc/*' 2>/dev/null | head -1)")
      export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
    fi
  done
  ldd "$binary" | grep -q "not found" && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$stage_lib"
  return 0
}

# `unpack_carried_libraries SRC DEST [--skip-present]`: the host libraries carried from the build machine in SRC
# (.pylibs: the Python extension's Debian libraries, gzipped where large) as plain files in DEST, created if missing;
# with --skip-present, those the loader already finds (ldconfig) are left out. A missing or empty SRC is no error
# (a wheel repaired by build_wheel.sh carries its libraries itself).
unpack_carried_libraries() {
  local src=$1 dest=$2 skip=${3:-} f n
  mkdir -p "$dest"
  for f in "$src"/*; do
    [ -e "$f" ] || continue
    n=$(basename "$f" .gz)
    if [ "$skip" = --skip-present ] && ldconfig -p | awk '{print $1}' | grep -qx "$n"; then continue; fi
    case "$f" in *.gz) gunzip -c "$f" > "$dest/$n" ;; *) cp "$f" "$dest/" ;; esac
  done
  return 0
}
