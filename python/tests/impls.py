"""Implementations the tests drive through serve/sweep: the fused cpu backend itself, and deliberately wrong ones."""

import numpy as np

import simpo_verify as sv


def ours(x, weight, target, bias=None, *, gradients=True, **hp):
    return sv.compute(x, weight, target, bias, impl="cpu", gradients=gradients, **hp)


def nll_scaled(x, weight, target, bias=None, *, gradients=True, **hp):
    """nll_loss 0.1% too large: a scalar slip the strict profile sees and Liger's 5e-3 tolerance does not."""
    out = ours(x, weight, target, bias, gradients=gradients, **hp)
    out["nll_loss"] = out["nll_loss"] * np.float32(1.001)
    return out


def chatty(x, weight, target, bias=None, *, gradients=True, **hp):
    """Prints on stdout (Python and C level): serve must keep the protocol's stdout clean."""
    import os

    print("chatty: hello from print")
    os.write(1, b"chatty: hello from fd 1\n")
    return ours(x, weight, target, bias, gradients=gradients, **hp)


def refuses_everything(x, weight, target, bias=None, *, gradients=True, **hp):
    raise RuntimeError("this implementation refuses every input")


def flips_one_ulp(x, weight, target, bias=None, *, gradients=True, **hp):
    """One ulp of grad_x's largest element whenever these inputs were seen before: the first run and its reruns
    differ in one element (run-to-run nondeterminism)."""
    out = ours(x, weight, target, bias, gradients=gradients, **hp)
    key = (np.asarray(x).tobytes(), np.asarray(weight).tobytes(), np.asarray(target).tobytes(), repr(sorted(hp.items())))
    seen = key in flips_one_ulp.seen
    flips_one_ulp.seen.add(key)
    if gradients and seen:
        gx = np.array(out["grad_x"], copy=True)
        bits = gx.view(np.uint16 if gx.dtype.itemsize == 2 else np.uint32).reshape(-1)
        bits[np.argmax(np.abs(gx.astype(np.float32)).reshape(-1))] ^= 1
        out["grad_x"] = gx
    return out


flips_one_ulp.seen = set()
