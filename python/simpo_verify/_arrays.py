"""Arrays of any framework <-> the extension's wire form (dtype name, shape, contiguous host numpy buffer).

bf16 travels as its 16-bit pattern (numpy uint16): neither numpy's DLPack nor its buffer protocol carries
ml_dtypes' bfloat16, so the bytes go across untouched and the dtype name says what they are. f16 comes back the same
way (uint16 storage, dtype name F16) and is viewed as numpy's float16.
"""

from __future__ import annotations

import numpy as np

try:  # numpy's bfloat16; the package depends on it, but the wire form itself does not need it
    import ml_dtypes

    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    ml_dtypes = None
    _BF16 = None

_NUMPY_TO_SPEC = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.float64): "F64",
                  np.dtype(np.int64): "I64"}
_SPEC_TO_STORAGE = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64}

# SPEC's hyperparameters, their types and defaults (SPEC "Inputs"; empty_sequence is SPEC's edge-case option).
HYPERPARAMETERS = {
    "beta": (float, 0.1),
    "gamma": (float, 0.5),
    "alpha": (float, 1.0),
    "label_smoothing": (float, 0.0),
    "compute_nll_loss": (bool, True),
    "ignore_index": (int, -100),
    "grad_scale": (float, 1.0),
    "empty_sequence": (str, "error"),
}


from ._core import InputError  # noqa: E402  (the C++ InputError, a ValueError: one class for both layers)


def framework(a) -> str:
    """'numpy', 'torch', 'cupy', 'jax' or the top-level module of a's type."""
    mod = type(a).__module__.split(".")[0]
    return "jax" if mod == "jaxlib" else mod


def is_cuda(a) -> bool:
    if framework(a) == "torch":
        return a.is_cuda
    dev = getattr(a, "__dlpack_device__", None)
    if dev is None:
        return False
    try:
        return dev()[0] in (2, 13)  # kDLCUDA, kDLCUDAManaged
    except Exception:
        return False


def to_torch(a):
    """A CUDA array of any DLPack framework as a torch tensor (no copy)."""
    import torch

    return a if framework(a) == "torch" else torch.from_dlpack(a)


def metadata(hyperparameters: dict) -> dict:
    """Keyword hyperparameters -> SPEC's inputs-file metadata strings. Unknown names are an error naming them."""
    out = {}
    for key, value in hyperparameters.items():
        if key not in HYPERPARAMETERS:
            raise InputError(
                f"unknown hyperparameter {key!r}: SPEC's are {', '.join(HYPERPARAMETERS)}")
        kind = HYPERPARAMETERS[key][0]
        if kind is bool:
            if not isinstance(value, (bool, np.bool_)):
                raise InputError(f"hyperparameter {key} = {value!r} must be True or False")
            out[key] = "true" if value else "false"
        elif kind is int:
            if isinstance(value, (bool, np.bool_)) or int(value) != value:
                raise InputError(f"hyperparameter {key} = {value!r} must be an integer")
            out[key] = str(int(value))
        elif kind is float:
            out[key] = repr(float(value))  # shortest text that reads back to the same double
        else:
            out[key] = str(value)
    return out


def hyperparameters_of(meta: dict) -> dict:
    """SPEC metadata strings -> typed keyword hyperparameters (all of them)."""
    hp = {}
    for key, (kind, default) in HYPERPARAMETERS.items():
        text = meta.get(key)
        if text is None:
            hp[key] = default
        elif kind is bool:
            hp[key] = text == "true"
        else:
            hp[key] = kind(text)
    return hp


def _numpy_host(a, name: str) -> np.ndarray:
    fw = framework(a)
    if fw == "torch":
        import torch

        t = a.detach()
        if t.is_cuda:
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16).view(_BF16) if _BF16 else t.view(torch.int16).numpy()
        return t.numpy()
    if fw == "cupy":
        return a.get()
    try:
        return np.asarray(a)  # numpy, JAX (ml_dtypes bfloat16), buffer-protocol objects, lists
    except Exception as e:  # pragma: no cover
        raise InputError(f"{name}: cannot read a {type(a).__name__} as an array ({e})") from None


def to_wire(name: str, a, *, integer_to_int64: bool = False):
    """Any host or device array -> (dtype name, shape, contiguous numpy storage). Integer targets of other widths
    are widened to int64 (exact) when integer_to_int64; any other dtype keeps its own name, so that the C++ side
    names a wrong one in its message."""
    arr = _numpy_host(a, name)
    shape = list(arr.shape)
    if _BF16 is not None and arr.dtype == _BF16:
        return "BF16", shape, np.ascontiguousarray(arr).view(np.uint16).reshape(-1)
    if integer_to_int64 and arr.dtype.kind in "iu" and arr.dtype != np.int64:
        arr = arr.astype(np.int64)
    spec = _NUMPY_TO_SPEC.get(arr.dtype)
    if spec is None:
        raise InputError(
            f"{name} has dtype {arr.dtype}; SPEC's dtypes are bfloat16 (ml_dtypes), float16, float32, float64, int64")
    return spec, shape, np.ascontiguousarray(arr).reshape(-1)


def from_wire(wire, like=None):
    """(dtype name, shape, storage) -> an array of like's framework (numpy by default; torch on like's device)."""
    dtype, shape, storage = wire
    storage = np.asarray(storage)
    fw = framework(like) if like is not None else "numpy"
    if fw == "torch":
        import torch

        if dtype == "BF16":
            t = torch.from_numpy(storage.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(storage.view(_SPEC_TO_STORAGE[dtype]).copy())
        t = t.reshape(shape)
        return t.to(like.device) if like.is_cuda else t
    if dtype == "BF16":
        out = storage.view(_BF16) if _BF16 is not None else storage
    else:
        out = storage.view(_SPEC_TO_STORAGE[dtype])
    out = out.reshape(shape)
    if fw == "cupy":
        import cupy

        return cupy.asarray(out)
    if fw == "jax":
        import jax.numpy as jnp

        return jnp.asarray(out)
    return out
