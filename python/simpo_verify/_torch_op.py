"""The fused step as torch.library custom ops, for torch.compile: `simpo_verify::fused_linear_simpo` (forward
outputs, the gradients of the inputs that require them, and their rounding residues, with a fake implementation
giving every shape and dtype) and `simpo_verify::scale_gradient` (its backward). A compiled graph calls them as
opaque nodes, so the host reads inside (the targets, grad_output) break no graph. simpo_verify.torch uses them
while torch.compile traces; eager calls keep the autograd.Function, which returns the gradients themselves at
grad_output 1 where an op must return new tensors, and defers grad_weight's last GEMM to its backward. The op does
not defer: an op's outputs are complete tensors when it returns (a deferred grad_weight is not final until the
finish), so its backward scales the finished gradients with their residues (scale_gradient, [V, H] read and written
once more at grad_output != 1).
"""

from __future__ import annotations

from typing import List, Optional

import torch

_FORWARD = ("loss", "chosen_logps", "rejected_logps", "chosen_logits_mean", "rejected_logits_mean", "nll_loss",
            "chosen_rewards", "rejected_rewards")
_GRADIENTS = ("grad_x", "grad_weight", "grad_bias")


@torch.library.custom_op("simpo_verify::fused_linear_simpo", mutates_args=())
def fused_linear_simpo_op(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                          ignore_index: int, beta: float, alpha: float, label_smoothing: float, compute_nll_loss: bool,
                          gamma: float, empty_sequence: str, workspace_bytes: int, want_x: bool,
                          want_weight: bool, validate: bool) -> List[torch.Tensor]:
    """[8 forward outputs in SPEC's order, grad_x, grad_weight, grad_bias, and their residues]; a gradient not asked
    for, and a residue that does not exist (f32, or the cpu backend), is an empty tensor."""
    from .torch import _check_dtypes, _hyperparameters, _run

    shape = _check_dtypes(x, weight, target, bias)
    hp = _hyperparameters(ignore_index, beta, alpha, label_smoothing, compute_nll_loss, gamma, empty_sequence)
    gradients = want_x or want_weight
    out, residues, _ = _run(x, weight, target, bias, hp, gradients, workspace_bytes, want_x, want_weight, validate,
                            shape=shape)
    wanted = {"grad_x": want_x, "grad_weight": want_weight, "grad_bias": want_weight and bias is not None}
    # A missing one is its own empty tensor: an op's outputs may not alias one another.
    grads = [out[n] if wanted[n] and n in out else x.new_empty(0) for n in _GRADIENTS]
    los = [residues[n] if wanted[n] and n in residues else x.new_empty(0) for n in _GRADIENTS]
    return [out[n] for n in _FORWARD] + grads + los


@fused_linear_simpo_op.register_fake
def _(x, weight, target, bias, ignore_index, beta, alpha, label_smoothing, compute_nll_loss, gamma, empty_sequence,
      workspace_bytes, want_x, want_weight, validate):
    B, _, _ = x.shape
    P = B // 2
    f32 = {"dtype": torch.float32, "device": x.device}
    forward = [x.new_empty((), **f32), x.new_empty((P,), **f32), x.new_empty((P,), **f32), x.new_empty((), **f32),
               x.new_empty((), **f32), x.new_empty((), **f32), x.new_empty((P,), **f32), x.new_empty((P,), **f32)]
    wanted = [want_x, want_weight, want_weight and bias is not None]
    like = [x, weight, bias if bias is not None else weight]
    grads = [torch.empty_like(t) if w else x.new_empty(0) for t, w in zip(like, wanted)]
    residue = x.is_cuda and x.dtype != torch.float32
    los = [torch.empty_like(t) if w and residue else x.new_empty(0) for t, w in zip(like, wanted)]
    return forward + grads + los


@torch.library.custom_op("simpo_verify::scale_gradient", mutates_args=())
def scale_gradient_op(hi: torch.Tensor, lo: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """T(grad_output (hi + lo)) with one rounding (simpo_verify._device.scale_gradient); without a residue (cpu
    backend, f32) T(grad_output hi), the product in double; at grad_output 1, hi."""
    from . import _device

    scale = float(grad_output)
    if hi.is_cuda:
        return _device.scale_gradient(hi, lo if lo.numel() else None, scale)
    wide = hi.double() + (lo.double() if lo.numel() else 0)
    return (wide * scale).to(hi.dtype)


@scale_gradient_op.register_fake
def _(hi, lo, grad_output):
    return torch.empty_like(hi)


def _setup_context(ctx, inputs, output):
    ctx.has_bias = inputs[3] is not None
    ctx.save_for_backward(*output[8:14])


def _backward(ctx, grads):
    grad_loss = grads[0]
    hi_lo = ctx.saved_tensors
    scaled = [torch.ops.simpo_verify.scale_gradient(hi_lo[i], hi_lo[i + 3], grad_loss) if hi_lo[i].numel() else None
              for i in range(3)]
    return (scaled[0], scaled[1], None, scaled[2] if ctx.has_bias else None) + (None,) * 11


fused_linear_simpo_op.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_simpo_compiled(x, weight, target, bias, hp, workspace_bytes, validate=True):
    """The op, for a graph being compiled: (loss, aux) as fused_linear_simpo returns them."""
    grad = torch.is_grad_enabled()
    want_x = grad and x.requires_grad
    want_weight = grad and (weight.requires_grad or (bias is not None and bias.requires_grad))
    out = fused_linear_simpo_op(x, weight, target, bias, hp["ignore_index"], hp["beta"], hp["alpha"],
                                hp["label_smoothing"], hp["compute_nll_loss"], hp["gamma"], hp["empty_sequence"],
                                workspace_bytes, want_x, want_weight, validate)
    return out[0], tuple(out[1:8])


__all__ = ["fused_linear_simpo_op", "scale_gradient_op", "fused_linear_simpo_compiled"]
