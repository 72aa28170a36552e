"""Imports the extension simpo_verify._core, finding the CUDA libraries it links where the loader does not.

A wheel repaired by auditwheel (python/tools/build_wheel.sh) carries the extension's host libraries (OpenBLAS,
MPFR, GMP, OpenMP, ...) but not CUDA's (cuBLAS, cuBLASLt, the runtime, NCCL): they are hundreds of MB, and one
process should use one copy of each, the one torch and the driver use. Where the loader does not find one, it is
loaded (globally, so the extension's own lookup by soname finds it) from NVIDIA's pip wheels on sys.path (torch's
CUDA dependencies) or from the CUDA Toolkit, then the import is tried again.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import os
import re
import sys

_MISSING = re.compile(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file")


def _candidates(name: str) -> list[str]:
    roots = [p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]
    found = []
    for root in roots:  # nvidia/cu13/lib (CUDA 13 wheels), nvidia/cublas/lib, nvidia/nccl/lib (CUDA 12 wheels)
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", name)))
    toolkits = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for toolkit in filter(None, toolkits):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            path = os.path.join(toolkit, sub, name)
            if os.path.exists(path):
                found.append(path)
    return found


def _load(name: str, tried: set[str]) -> None:
    """Loads library `name` globally, first whatever it needs that the loader also misses."""
    if name in tried:
        raise ImportError(f"simpo_verify: cannot load {name} (a dependency cycle through it)")
    tried.add(name)
    paths = _candidates(name)
    if not paths:
        raise ImportError(
            f"simpo_verify: the extension was built with the CUDA backend and needs {name}, which neither the "
            "loader nor NVIDIA's pip wheels on sys.path nor the CUDA Toolkit (CUDA_HOME, /usr/local/cuda) "
            "provide. Install torch for this CUDA version (its nvidia-* wheels), or the CUDA Toolkit, or build "
            "the package without CUDA (pip install ./python -C cmake.define.SIMPO_ENABLE_CUDA=OFF).")
    for _ in range(16):
        try:
            ctypes.CDLL(paths[0], mode=ctypes.RTLD_GLOBAL)
            return
        except OSError as e:
            missing = _MISSING.search(str(e))
            if not missing or missing.group(1) == name:
                raise ImportError(f"simpo_verify: cannot load {paths[0]}: {e}") from None
            _load(missing.group(1), tried)


def load_core():
    tried: set[str] = set()
    for _ in range(16):  # one missing library per failed import
        try:
            return importlib.import_module("simpo_verify._core")
        except ImportError as e:
            missing = _MISSING.search(str(e))
            if not missing or missing.group(1) in tried:
                raise
            _load(missing.group(1), tried)
    return importlib.import_module("simpo_verify._core")
