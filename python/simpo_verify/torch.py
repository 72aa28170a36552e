"""simpo_verify.torch: the fused linear + SimPO loss as a drop-in for Liger-Kernel's LigerFusedLinearSimPOLoss.

    loss_fn = FusedLinearSimPOLoss(beta=0.1, gamma=0.5)          # Liger's constructor arguments
    loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean,
           nll_loss, chosen_rewards, rejected_rewards) = loss_fn(lm_head.weight, hidden, target, lm_head.bias)
    loss.backward()

Backends: CUDA tensors run the fused cuda backend on the device, ordered on torch's current stream, with no copy
through the host (bf16 and f32: the targets are checked and the per-sequence math done on the device, and the call
synchronizes once, when the forward's statistics exist, to raise SPEC's errors; with validate=False not at all, see
below; f16 reads the targets on the host first); CPU tensors run the fused cpu backend.
Gradients come from autograd: the forward computes them (3 GEMMs, as Liger does) for the inputs that require grad
when grad mode is on: a frozen input (requires_grad False: a LoRA model's LM head, frozen hidden states) costs no
gradient GEMM, and under torch.no_grad() or torch.inference_mode() the forward-only schedule runs (one GEMM).
backward hands them over scaled by grad_output, which is SPEC's grad_scale, one rounding as if the step had run at
that scale, with no second kernel run. grad_weight of bf16 on the sm_90a kernels (the bf16 hi/lo pair) leaves its
last chunk's GEMM to backward, which runs it with grad_output in its epilogue, read there on the device (that
backward never synchronizes; with validate=False neither does the forward, so the whole step runs ahead of the
device as torch's own ops do): a grad_output of 1/3 (gradient accumulation's loss / n) costs what 1 costs, where
scaling the finished [V, H] gradient would read and write it once more; its workspace (that chunk's dz and x rows,
the pair's lo) comes from torch's allocator and is held from forward to backward. The other 16-bit gradients keep
their rounding residue and backward returns T(grad_output (hi + lo)) (N*H and V elements). CPU tensors recompute at
grad_output != 1.

Dtype policy: x, weight and bias share one dtype, torch.bfloat16, torch.float16 or torch.float32 (SPEC's input
dtypes), computed in that dtype, never converted: bf16 on the sm_90a kernels, f16 on the tensor cores through
cuBLAS, f32 with fp32 GEMMs (no TF32), each held to its own dtype's strict bound. Mixed dtypes are a TypeError.
target may be any integer dtype (widened to int64, exact). Non-contiguous inputs (hidden[:, :-1], a
transposed weight) are copied to contiguous memory first (an extra read and write of that input), with the same
results as the contiguous call. Gradients are in the inputs' dtype (SPEC's fused
outputs); the loss and auxiliary outputs are float32 tensors on the inputs' device. Invalid inputs (SPEC's edge-case table: an empty sequence, a target out of range, NaN inputs, ...)
raise simpo_verify.InputError (a ValueError) with SPEC's message, where Liger returns NaN.

`compiled` and `chunk_size` are accepted for Liger compatibility and have no effect: the kernel is compiled
ahead of time and picks its own chunks from its workspace budget (SPEC: chunking never changes the result
beyond fp32 noise).
"""

from __future__ import annotations

import functools

import torch

from . import DEFAULT_WORKSPACE_BYTES, _device, compute as _compute
from ._arrays import InputError, metadata

__all__ = ["FusedLinearSimPOLoss", "fused_linear_simpo", "InputError"]


@functools.lru_cache(maxsize=64)
def _metadata(hp_items):
    """metadata() of a hyperparameter dict's items: a training loop passes the same ones every step."""
    return metadata(dict(hp_items))


def _run(_input, weight, target, bias, hp, gradients, workspace_bytes, grad_x=True, grad_weight=True, validate=True,
         defer_weight=False, shape=None, forward_views=False):
    """-> (dict of SPEC outputs as torch tensors on the inputs' device, dict of the 16-bit gradients' rounding
    residues: cuda only, for backward's scale_gradient, and with defer_weight where the plan allows it the pending
    grad_weight GEMM (pending, workspace) for _device.finish_weight_gradient, else None). shape: _check_dtypes's,
    where the caller has checked the tensors. forward_views: _device.compute's (outputs that are no autograd
    Function's or op's)."""
    if _input.is_cuda:
        # The targets' checks and the forward outputs on the device: the host never waits before the step (with
        # validate=False never at all). f16 plans its dz scale from the targets on the host.
        out, info = _device.compute(_input, weight, target, bias, dict(_metadata(tuple(hp.items()))),
                                    gradients=gradients, grad_x=grad_x, grad_weight=grad_weight, residues=gradients,
                                    validate=validate, workspace_bytes=workspace_bytes, defer_weight=defer_weight,
                                    forward_on_device=_input.dtype != torch.float16, shape=shape,
                                    forward_views=forward_views)
        return out, info["residues"], info["deferred"]
    _device.check_tensors(_input, weight, target, bias)
    return _compute(_input.detach(), weight.detach(), target.detach(),
                    bias.detach() if bias is not None else None, impl="cpu", gradients=gradients,
                    validate=validate, workspace_bytes=workspace_bytes, **hp), {}, None


_AUX = ("chosen_logps", "rejected_logps", "chosen_logits_mean", "rejected_logits_mean", "nll_loss", "chosen_rewards",
        "rejected_rewards")


def _check_dtypes(_input, weight, target, bias):
    """check_tensors with a wrong or mixed dtype as TypeError; -> (B, T, H, V)."""
    try:
        return _device.check_tensors(_input, weight, target, bias)
    except InputError as e:
        if "dtype" in str(e):  # a wrong or mixed input dtype: torch's TypeError
            raise TypeError(f"simpo_verify.torch: {e}") from None
        raise


class _FusedLinearSimPOFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, _input, weight, target, bias, hp, workspace_bytes, validate):
        shape = _check_dtypes(_input, weight, target, bias)
        # backward reads only the loss's gradient: the seven auxiliary outputs' are not filled with zeros for it.
        ctx.set_materialize_grads(False)
        # A frozen input (requires_grad False: LoRA's LM head, frozen hidden states) gets no gradient GEMM.
        want_x = ctx.needs_input_grad[0]
        want_weight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[3])
        gradients = want_x or want_weight
        out, residues, ctx.deferred = _run(_input, weight, target, bias, hp, gradients, workspace_bytes, want_x,
                                           want_weight, validate, defer_weight=want_weight, shape=shape)
        ctx.hp, ctx.workspace_bytes, ctx.validate = hp, workspace_bytes, validate
        ctx.has_bias = bias is not None
        if gradients:
            names = ("grad_x", "grad_weight", "grad_bias")
            ctx.save_for_backward(_input, weight, target, bias, *(out.get(n) for n in names),
                                  *(residues.get(n) for n in names))
        aux = tuple(out[k] for k in _AUX)
        ctx.mark_non_differentiable(*aux)
        return (out["loss"],) + aux

    @staticmethod
    def backward(ctx, grad_loss, *_aux_grads):
        if grad_loss is None:  # (materialize_grads off) no gradient reached the loss: none for the inputs
            return (None,) * 7
        _input, weight, target, bias, grad_x, grad_weight, grad_bias, x_lo, w_lo, b_lo = ctx.saved_tensors
        deferred = ctx.deferred
        if deferred is not None and deferred is not _FINISHED:
            # grad_weight's last GEMM waited for this scale (SPEC's grad_scale = grad_output): T(scale sum) in place,
            # one rounding, the same bits as the undeferred step at 1. grad_x and grad_bias from their residues, in
            # place (at 1 untouched). The kernels read grad_output on the device: no synchronization.
            ctx.deferred = _FINISHED
            _device.finish_weight_gradient(*deferred, grad_loss)
            grad_x, grad_bias = (_device.scale_gradient_(g, lo, grad_loss) if g is not None else None
                                 for g, lo in ((grad_x, x_lo), (grad_bias, b_lo)))
            return (grad_x if ctx.needs_input_grad[0] else None, grad_weight if ctx.needs_input_grad[1] else None,
                    None, grad_bias if ctx.has_bias and ctx.needs_input_grad[3] else None, None, None, None)
        scale = float(grad_loss)  # one scalar read
        if deferred is _FINISHED:
            # A second backward through the graph (retain_graph): the deferred GEMM took the first one's scale into
            # grad_weight and grad_x and grad_bias were scaled in place, so the step runs again at this one (exact,
            # slower).
            grad_x, grad_weight, grad_bias = _rerun(ctx, _input, weight, target, bias, scale)
        elif scale != 1.0 and _input.is_cuda:
            # SPEC's grad_scale = grad_output, from the kept rounding residues: T(scale (hi + lo)), one rounding,
            # no second kernel run (gradient accumulation's loss / n, a loss weight, a negative sign).
            grad_x, grad_weight, grad_bias = (_device.scale_gradient(g, lo, scale) if g is not None else None
                                              for g, lo in ((grad_x, x_lo), (grad_weight, w_lo), (grad_bias, b_lo)))
        elif scale != 1.0:  # the cpu backend keeps no residues: it recomputes with grad_scale (exact, slower)
            grad_x, grad_weight, grad_bias = _rerun(ctx, _input, weight, target, bias, scale)
        return (grad_x if ctx.needs_input_grad[0] else None, grad_weight if ctx.needs_input_grad[1] else None, None,
                grad_bias if ctx.has_bias and ctx.needs_input_grad[3] else None, None, None, None)


# ctx.deferred once backward has run the deferred GEMM.
_FINISHED = object()


def _rerun(ctx, _input, weight, target, bias, scale):
    """The gradients of the step run again with grad_scale times `scale`."""
    hp = dict(ctx.hp)
    hp["grad_scale"] = hp.get("grad_scale", 1.0) * scale
    out, _, _ = _run(_input, weight, target, bias, hp, True, ctx.workspace_bytes, validate=ctx.validate)
    return out["grad_x"], out["grad_weight"], out.get("grad_bias")


def _hyperparameters(ignore_index, beta, alpha, label_smoothing, compute_nll_loss, gamma, empty_sequence):
    return {"ignore_index": int(ignore_index), "beta": float(beta), "alpha": float(alpha),
            "label_smoothing": float(label_smoothing), "compute_nll_loss": bool(compute_nll_loss),
            "gamma": float(gamma), "empty_sequence": empty_sequence}


def fused_linear_simpo(_input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0,
                       label_smoothing=0.0, compute_nll_loss=False, compiled=True, gamma=0.5, chunk_size=1, *,
                       empty_sequence="error", workspace_bytes=DEFAULT_WORKSPACE_BYTES, validate=True):
    """Liger's liger_fused_linear_simpo (LigerFusedLinearSimPOFunction.apply), same positional arguments and
    defaults (compute_nll_loss defaults to False there, unlike the module). Returns
    (loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss, chosen_rewards,
    rejected_rewards)). Keyword-only extras: empty_sequence ("error", SPEC's default, or "zero": a sequence
    with no completion token averages to 0 with no gradient), workspace_bytes (the kernel's scratch budget) and
    validate (False skips SPEC's NaN/Inf rule on x, weight and bias: a NaN input then gives NaN outputs instead of
    InputError. On CUDA with bf16 or f32 inputs it also makes the call asynchronous, no host synchronization: the
    targets are checked and counted on the device, and invalid ones (out of range, an empty sequence under
    empty_sequence="error", no chosen completion token with the NLL term on) give NaN outputs, as Liger does,
    instead of InputError; on the CPU and for f16 they stay InputError. On CUDA the rule itself costs an O(B*T)
    check of the step's row statistics, and a scan of the inputs only where those are not finite)."""
    del compiled, chunk_size  # Liger's knobs: no meaning here (module docstring)
    hp = _hyperparameters(ignore_index, beta, alpha, label_smoothing, compute_nll_loss, gamma, empty_sequence)
    if torch.compiler.is_compiling():  # torch.compile: the custom ops, opaque nodes of the graph (_torch_op.py)
        from ._torch_op import fused_linear_simpo_compiled

        return fused_linear_simpo_compiled(_input, weight, target, bias, hp, workspace_bytes, validate)
    if not torch.is_grad_enabled():
        # no_grad / inference_mode (an evaluation loop): the forward-only schedule, one GEMM instead of three,
        # whatever requires_grad says (autograd.Function.forward cannot see the caller's grad mode).
        shape = _check_dtypes(_input, weight, target, bias)
        out, _, _ = _run(_input, weight, target, bias, hp, False, workspace_bytes, validate=validate, shape=shape,
                         forward_views=True)
        return out["loss"], tuple(out[k] for k in _AUX)
    loss, *aux = _FusedLinearSimPOFunction.apply(_input, weight, target, bias, hp, workspace_bytes, validate)
    return loss, tuple(aux)


class FusedLinearSimPOLoss(torch.nn.Module):
    """Liger-Kernel's LigerFusedLinearSimPOLoss, on this project's fused kernel (module docstring)."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
                 compute_nll_loss: bool = True, compiled: bool = True, gamma: float = 0.5, chunk_size: int = 1, *,
                 empty_sequence: str = "error", workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, validate: bool = True):
        super().__init__()
        self.ignore_index = ignore_index
        self.beta = beta
        self.alpha = alpha
        self.label_smoothing = label_smoothing
        self.compute_nll_loss = compute_nll_loss
        self.compiled = compiled
        self.gamma = gamma
        self.chunk_size = chunk_size
        self.empty_sequence = empty_sequence
        self.workspace_bytes = workspace_bytes
        self.validate = validate

    def forward(self, lin_weight, _input, target, bias=None):
        return fused_linear_simpo(_input, lin_weight, target, bias, self.ignore_index, self.beta, self.alpha,
                                  self.label_smoothing, self.compute_nll_loss, self.compiled, self.gamma,
                                  self.chunk_size, empty_sequence=self.empty_sequence,
                                  workspace_bytes=self.workspace_bytes, validate=self.validate)
