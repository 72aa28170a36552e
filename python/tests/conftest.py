import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # impls.py


def make_problem(B=4, T=6, H=16, V=40, seed=0, bias=False, ignore_prefix=2, scale=1.0, dtype=ml_dtypes.bfloat16):
    """A small valid problem as numpy arrays: x/weight/bias in `dtype` (bf16 by default), int64 target with an
    ignored prompt prefix."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, H)).astype(dtype)
    w = (rng.standard_normal((V, H)) * scale / np.sqrt(H) * 2).astype(dtype)
    t = rng.integers(0, V, (B, T)).astype(np.int64)
    t[:, :ignore_prefix] = -100
    b = (rng.standard_normal(V) * 0.5).astype(dtype) if bias else None
    return x, w, t, b


@pytest.fixture
def problem():
    return make_problem()
