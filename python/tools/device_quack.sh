#!/usr/bin/env bash
# QuACK's linear cross-entropy against ours on the device (python/tools/bench_quack.py), in two device calls.
#
# QuACK (quack-kernels 0.6.5) needs the CuTe DSL (nvidia-cutlass-dsl 4.7.1), whose CUDA 13 library wheel is 84 MiB
# (93 MiB with the rest), while one device call carries at most 64 MiB with the working tree. So the wheels travel
# in two parts, each under 45 MiB: the CUDA 13 wheel rezipped without compression and then xz-compressed (56 MiB;
# the rezipped wheel holds the same files, which is all pip reads), split at 40 MiB; part a is its first piece,
# part b its rest with the small wheels. The first call leaves part a in /tmp/quack-wheels; the second, on the
# same machine while it is still warm (it keeps /tmp between calls), brings part b, reassembles, checks every
# file's SHA-256, installs and runs the bench. A later run on the same warm machine reuses what the first
# reassembled (the checksums say whether it may), so a retry needs no stage-a.
#
#   bash python/tools/device_quack.sh prepare    # here (PyPI reachable): .quack-wheels/{a,b} (ignored by git)
#   # device call 1, carry [".quack-wheels/a"]:
#   bash python/tools/device_quack.sh stage-a
#   # device call 2, right after, carry [".quack-wheels/b", ".whl"] (and ".pylibs" where the wheel needs it):
#   bash python/tools/device_quack.sh run
#
# The device has torch 2.11 (cu130), Triton, einops, cuda-bindings, numpy, protobuf and matplotlib, and no network:
# what QuACK needs beyond them is carried. Not carried: nvidia-cuda-nvdisasm (the DSL runs nvdisasm only to write
# SASS, CUTE_DSL_KEEP_SASS) and the DSL's CUDA 12 libraries (the DSL picks the newest flavour the driver supports,
# and cu13 is the one torch cu130's driver runs). .whl: the simpo_verify cp312 wheel (build_wheel.sh), installed
# as device_dropin.sh installs it; without it the bench's "ours" column reads "not installed".
# Environment (run): OUT (results folder; the run tool sets it), BATCHES (2,4,8,16), REPS (5), BUDGET (360: seconds
# after which no new B row or cell starts), BENCH_TIMEOUT (480), BENCH_ARGS (more bench_quack.py arguments).
# Results: $OUT/quack.json, $OUT/quack.png, $OUT/quack.log; the table on stdout.
set -u -o pipefail
cd "$(dirname "$0")/../.." || exit 1
root=$PWD
stage=/tmp/quack-wheels   # part a between the two calls
site=/tmp/site-quack      # QuACK and the CuTe DSL, pip install --target
big=nvidia_cutlass_dsl_libs_cu13-4.7.1-cp312-cp312-manylinux_2_28_x86_64.whl
pins="quack-kernels==0.6.5 nvidia-cutlass-dsl==4.7.1 nvidia-cutlass-dsl-libs-base==4.7.1
      nvidia-cutlass-dsl-libs-core==4.7.1 nvidia-cutlass-dsl-libs-cu13==4.7.1 apache-tvm-ffi==0.1.15.post2
      torch-c-dlpack-ext==0.1.5"

die() { echo "device_quack: $*" >&2; exit 1; }
mib() { du -sm "$@" | awk '{s += $1} END {print s " MiB"}'; }

prepare() {
  local w=$root/.quack-wheels dl=$root/.quack-wheels/dl
  for t in xz split sha256sum; do command -v $t >/dev/null || die "prepare needs $t"; done
  python3 -m pip --version >/dev/null 2>&1 || die "prepare needs python3 -m pip"
  mkdir -p "$dl" || die "cannot create $dl"
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dl" $pins || die "pip download failed"
  [ -f "$dl/$big" ] || die "$dl/$big missing after the download"
  rm -rf "$w/a" "$w/b" "$w/tmp" && mkdir -p "$w/a" "$w/b" "$w/tmp" || exit 1
  # The same members, stored instead of deflated: xz then packs the 180 MB extension far tighter than zip did.
  python3 - "$dl/$big" "$w/tmp/$big" <<'EOF' || die "rezipping $big failed"
import sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zo:
    for info in zi.infolist():
        out = zipfile.ZipInfo(info.filename, info.date_time)
        out.external_attr = info.external_attr
        zo.writestr(out, zi.read(info))
with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst) as b:
    assert [(i.filename, i.CRC, i.file_size) for i in a.infolist()] == \
           [(i.filename, i.CRC, i.file_size) for i in b.infolist()], "members differ"
EOF
  echo "device_quack: xz -9 of the rezipped $big (a few minutes on 2 cores)"
  xz -9 -T0 -c "$w/tmp/$big" > "$w/tmp/$big.xz" || die "xz failed"
  (cd "$w/tmp" && sha256sum "$big" "$big.xz" > SHA256SUMS) || exit 1
  (cd "$dl" && for f in *.whl; do [ "$f" = "$big" ] || [[ "$f" == nvidia_cutlass_dsl_libs_cu12* ]] || sha256sum "$f"; done) \
    >> "$w/tmp/SHA256SUMS" || exit 1
  split -b 40M -a 2 "$w/tmp/$big.xz" "$w/tmp/$big.xz.part-" || die "split failed"
  local parts=("$w/tmp/$big.xz.part-"*)
  [ ${#parts[@]} -eq 2 ] || die "expected 2 parts of $big.xz, got ${#parts[@]}"
  mv "${parts[0]}" "$w/a/" && mv "${parts[1]}" "$w/b/" || exit 1
  (cd "$dl" && for f in *.whl; do [ "$f" = "$big" ] || [[ "$f" == nvidia_cutlass_dsl_libs_cu12* ]] || cp "$f" "$w/b/"; done)
  cp "$w/tmp/SHA256SUMS" "$w/a/" && cp "$w/tmp/SHA256SUMS" "$w/b/" || exit 1
  rm -rf "$w/tmp"
  echo "device_quack: part a $(mib "$w/a"), part b $(mib "$w/b")"
  ls -l "$w/a" "$w/b"
}

stage_a() {
  local a=$root/.quack-wheels/a
  [ -d "$a" ] || die "$a is not here: carry .quack-wheels/a in this call (made by 'device_quack.sh prepare')"
  ls "$a"/*.part-aa >/dev/null 2>&1 || die "$a holds no *.part-aa: run 'device_quack.sh prepare' again"
  rm -rf "$stage" && mkdir -p "$stage" && cp "$a"/* "$stage"/ || die "copying part a to $stage failed"
  echo "device_quack: part a staged in $stage ($(mib "$stage")); now 'device_quack.sh run' with .quack-wheels/b"
  ls -l "$stage"
}

run() {
  local b=$root/.quack-wheels/b out=${OUT:-$root/quack-out}
  [ -d "$b" ] || die "$b is not here: carry .quack-wheels/b in this call"
  mkdir -p "$out" || die "cannot create $out"
  if ls "$stage"/*.part-aa >/dev/null 2>&1; then
    cmp -s "$stage/SHA256SUMS" "$b/SHA256SUMS" || die "parts a and b come from different 'prepare' runs"
    cp "$b"/* "$stage"/ || die "copying part b to $stage failed"
    cd "$stage" || exit 1
    cat "$big.xz.part-aa" "$big.xz.part-ab" > "$big.xz" || die "reassembly failed"
    grep -v " $big\$" SHA256SUMS | sha256sum -c --quiet - || die "a checksum differs (part a or b damaged)"
    if command -v xz >/dev/null; then
      xz -dc "$big.xz" > "$big" || die "xz -d failed"
    else  # Python's lzma reads xz's multi-block streams too
      python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
        "$big.xz" "$big" || die "decompression failed"
    fi
    grep " $big\$" SHA256SUMS | sha256sum -c --quiet - || die "$big differs from the one prepared"
    rm -f "$big.xz" "$big.xz.part-"*
  elif [ -f "$stage/$big" ] && cmp -s "$stage/SHA256SUMS" "$b/SHA256SUMS"; then
    cd "$stage" || exit 1
    grep -v "$big.xz\$" SHA256SUMS | sha256sum -c --quiet - || die "$stage was changed since it was reassembled: \
run stage-a again"
    echo "device_quack: reusing the wheels an earlier run reassembled in $stage"
  else
    die "no part a in $stage: run 'device_quack.sh stage-a' with .quack-wheels/a first, on the same warm machine \
(a fresh machine has an empty /tmp)"
  fi
  cd "$root" || exit 1
  echo "device_quack: installing $(ls "$stage"/*.whl | wc -l) wheels into $site"
  rm -rf "$site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$stage"/*.whl || die "pip install of QuACK's wheels failed"
  local ours=(.whl/simpo_verify-*.whl)
  if [ -f "${ours[0]}" ]; then
    [ ${#ours[@]} -eq 1 ] || die "more than one simpo_verify wheel in .whl: ${ours[*]}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "${ours[0]}" || die "pip install of ${ours[0]} failed"
  else
    echo "device_quack: no .whl/simpo_verify-*.whl carried: the bench's 'ours' column will read 'not installed'" >&2
  fi
  if [ -d .pylibs ]; then  # the extension's Debian libraries, for a wheel built without them (device_dropin.sh)
    . scripts/device_libraries.sh
    unpack_carried_libraries .pylibs /tmp/pylibs
    export LD_LIBRARY_PATH=/tmp/pylibs:${LD_LIBRARY_PATH:-}
  fi
  # The CuTe DSL's packages live in nvidia_cutlass_dsl/dsl_packages, which its .pth file puts on sys.path; a
  # --target folder is no site folder, so its .pth files are not read: the folder is named here instead.
  export PYTHONPATH=/tmp/site:$site:$site/nvidia_cutlass_dsl/dsl_packages:$root/python/tools PYTHONUNBUFFERED=1
  date -u; nvidia-smi -L
  python3 -c "import torch, einops, cuda.bindings.driver; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    || die "the device lacks torch, einops or cuda-bindings, which QuACK needs and are not carried"
  python3 -c "import cutlass, tvm_ffi, quack; print('quack', quack.__version__, 'cutlass-dsl', cutlass.__version__, \
'tvm_ffi', tvm_ffi.__version__)" || echo "device_quack: QuACK does not import (above): its columns will read 'not installed'" >&2
  python3 -c "import simpo_verify as sv; print('simpo_verify', sv.__file__, 'cuda', sv.cuda_available())" || true
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-480}" python3 python/tools/bench_quack.py "$out/quack.json" --png "$out/quack.png" \
    --batches "${BATCHES:-2,4,8,16}" --reps "${REPS:-5}" --budget "${BUDGET:-360}" ${BENCH_ARGS:-} 2>&1 \
    | tee "$out/quack.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || echo "device_quack: bench_quack.py exited $rc (124: BENCH_TIMEOUT); what it wrote is in $out" >&2
  return "$rc"
}

case "${1:-}" in
  prepare) prepare ;;
  stage-a) stage_a ;;
  run) run ;;
  *) die "usage: device_quack.sh prepare | stage-a | run (the header says which carry each needs)" ;;
esac
