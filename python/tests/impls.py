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
