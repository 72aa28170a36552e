"""The fused cuda backend on CUDA tensors, with no copy through the host (fused::compute_on_device, fused/fused.h).

Any DLPack CUDA array is viewed as a torch tensor (no copy); the gradients are allocated by torch's caching
allocator on the inputs' device, and the call is ordered on torch's current stream.
"""

from __future__ import annotations

import contextlib

from . import _core
from ._arrays import InputError

# Device memory the last call held outside torch's allocator (the runner's workspace, kept between calls, and
# this call's fp32 accumulators / padded copies; none of the plan's when the call ran in a workspace of torch's):
# the benchmark adds it to torch's peak. And the plan that ran, for logs.
last_info = {"workspace_bytes": 0, "extra_device_bytes": 0, "plan": ""}


def _shape_error(a_name, a, b_name, b, what):
    return InputError(
        f"shapes disagree: {a_name} {list(a.shape)} and {b_name} {list(b.shape)} ({what})")


def _dtype_name(t):
    """SPEC's name of a torch input dtype ("bf16", "f16", "f32"), or None."""
    import torch

    return {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}.get(t.dtype)


def check_tensors(x, weight, target, bias):
    """SPEC's dtypes and shapes for torch tensors, with the C++ layer's wording; returns (B, T, H, V)."""
    import torch

    if _dtype_name(x) is None:
        raise InputError(f"x is {x.dtype}: SPEC's input dtypes are bfloat16, float16 and float32")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise InputError(f"{name} is {t.dtype} and x is {x.dtype}: SPEC takes one dtype for x, weight and bias")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise InputError(f"target is {target.dtype}, SPEC says int64")
    if x.dim() != 3:
        raise InputError(f"x has shape {list(x.shape)}, SPEC says rank 3 [B, T, H]")
    if weight.dim() != 2:
        raise InputError(f"weight has shape {list(weight.shape)}, SPEC says rank 2 [V, H]")
    if target.dim() != 2:
        raise InputError(f"target has shape {list(target.shape)}, SPEC says rank 2 [B, T]")
    B, T, H = x.shape
    V = weight.shape[0]
    if weight.shape[1] != H:
        raise _shape_error("x", x, "weight", weight, "H must match")
    if tuple(target.shape) != (B, T):
        raise _shape_error("x", x, "target", target, "B and T must match")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != V):
        raise _shape_error("weight", weight, "bias", bias, "V must match")
    devices = {t.device for t in (x, weight, target, bias) if t is not None}
    if len(devices) != 1:
        raise InputError(f"inputs on different devices: {sorted(str(d) for d in devices)}")
    return B, T, H, V


def compute(x, weight, target, bias, meta, *, gradients=True, grad_x=True, grad_weight=True, residues=False,
            grad_f32=False, validate=True, workspace_bytes, max_chunk_rows=0, defer_weight=False,
            forward_on_device=False, shape=None, forward_views=False):
    """-> (outputs dict of torch tensors on x's device, info dict). Inputs: torch CUDA tensors.

    grad_x / grad_weight False: that gradient (grad_weight with grad_bias) is neither computed nor returned (a frozen
    input). residues: 16-bit gradients also get their rounding residues, in info["residues"] (same names), for
    scale_gradient. defer_weight: where the plan keeps grad_weight in the bf16 hi/lo pair, its last GEMM waits for
    the loss scale (fused.h: DeviceCall::defer_weight_finish) in a workspace from torch's allocator:
    info["deferred"] is then (pending, workspace) for finish_weight_gradient, grad_weight is not final until then
    and gets no residue; elsewhere info["deferred"] is None and the call is the whole step. forward_on_device (bf16
    or f32 inputs; fused.h: DeviceCall::forward_on_device): the targets are checked and counted on the device and the
    forward outputs written there, so the host never waits before the step; with validate the call synchronizes
    once, on the forward's statistics, where SPEC's errors are raised as InputError; without it nothing
    synchronizes (the asynchronous call) and invalid targets give NaN outputs instead of InputError. shape: the
    (B, T, H, V) check_tensors returned for these tensors, where the caller has checked them already.
    forward_views (with forward_on_device): the eight forward outputs are views of one float32 buffer (one
    allocation instead of eight), for callers whose outputs may alias one another (not a custom op's)."""
    import torch

    if not _core.has_device_entry():
        raise InputError("inputs on a CUDA device, but this simpo_verify was built without the cuda backend "
                         "(no nvcc at build time): move them to the host, or rebuild where nvcc is installed")
    B, T, H, V = shape if shape is not None else check_tensors(x, weight, target, bias)
    dev = x.device
    if torch.cuda.is_current_stream_capturing():
        raise InputError("simpo_verify's fused step cannot be captured in a CUDA graph: it is not written for "
                         "capture (with validation it synchronizes once per call, to raise SPEC's errors; f16 reads "
                         "the targets on the host first); run it outside the captured region")
    x, weight = x.detach().contiguous(), weight.detach().contiguous()
    target = target.detach().to(torch.int64).contiguous()
    bias = bias.detach().contiguous() if bias is not None else None
    # SPEC: gradients in the inputs' dtype; grad_weight and grad_bias in float32 when asked for.
    gdtype = torch.float32 if grad_f32 else x.dtype
    want_x, want_weight = gradients and grad_x, gradients and grad_weight
    grad_x = grad_w = grad_b = None
    if want_x:
        grad_x = torch.empty((B, T, H), dtype=x.dtype, device=dev)
    if want_weight:
        grad_w = torch.empty((V, H), dtype=gdtype, device=dev)
        grad_b = torch.empty((V,), dtype=gdtype, device=dev) if bias is not None else None
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    args = {
        "B": B, "T": T, "H": H, "V": V, "dtype": _dtype_name(x),
        "device": dev.index if dev.index is not None else torch.cuda.current_device(),
        "x": ptr(x), "weight": ptr(weight), "bias": ptr(bias), "target": ptr(target),
        "grad_x": ptr(grad_x), "grad_weight": ptr(grad_w), "grad_bias": ptr(grad_b), "metadata": meta,
        "grad_x_lo": 0, "grad_weight_lo": 0, "grad_bias_lo": 0,
        "gradients": gradients, "want_grad_x": want_x, "want_grad_weight": want_weight, "grad_f32": grad_f32,
        "validate": validate, "workspace_bytes": workspace_bytes, "max_chunk_rows": max_chunk_rows,
        "workspace": 0, "workspace_size": 0, "defer_weight_finish": False,
        "forward_on_device": forward_on_device,
    }
    forward = None
    if forward_on_device:
        P = B // 2
        shapes = [(P,) if name.endswith(("_logps", "_rewards")) else () for name in _FORWARD_OUTPUTS]
        if forward_views:
            sizes = [P if s else 1 for s in shapes]
            packed = torch.empty(sum(sizes), dtype=torch.float32, device=dev)
            forward = {name: part.view(s)
                       for name, s, part in zip(_FORWARD_OUTPUTS, shapes, packed.split(sizes))}
        else:  # each a tensor of its own (an op's outputs may not alias)
            forward = {name: torch.empty(s, dtype=torch.float32, device=dev)
                       for name, s in zip(_FORWARD_OUTPUTS, shapes)}
        args["forward_out"] = [t.data_ptr() for t in forward.values()]
    # On the inputs' device (the backend sets it for the call; torch's current device is put back after) unless it is
    # the current one already.
    with torch.cuda.device(dev) if dev.index is not None and dev.index != torch.cuda.current_device() else _NO_CONTEXT:
        args["stream"] = torch.cuda.current_stream(dev).cuda_stream
        # The deferred call's scratch, the pair's lo included, comes from torch's allocator and stays with its pending
        # GEMM until the finish (the runner frees its own for the call: never both).
        workspace = None
        if defer_weight and want_weight:
            need = _core.device_workspace(args)
            if need["defers_weight_finish"]:
                workspace = torch.empty(need["bytes"], dtype=torch.uint8, device=dev)
                args.update(workspace=workspace.data_ptr(), workspace_size=need["bytes"], defer_weight_finish=True)
        lo = {}
        if residues and gradients:
            for name, g in (("grad_x", grad_x), ("grad_weight", grad_w), ("grad_bias", grad_b)):
                if g is not None and g.dtype != torch.float32 and not (name == "grad_weight" and workspace is not None):
                    lo[name] = torch.empty_like(g)
                    args[name + "_lo"] = lo[name].data_ptr()
        r = _core.compute_device(args)
    out = forward if forward_on_device else _forward_outputs(r["outputs"], x)
    for name, g in (("grad_x", grad_x), ("grad_weight", grad_w), ("grad_bias", grad_b)):
        if g is not None:
            out[name] = g
    last_info.update(workspace_bytes=r["workspace_bytes"], extra_device_bytes=r["extra_device_bytes"], plan=r["plan"])
    deferred = (r["pending"], workspace) if r["pending"] is not None else None
    return out, dict(last_info, residues=lo, deferred=deferred)


_NO_CONTEXT = contextlib.nullcontext()

# problem.h's order of the forward outputs (fused.h: DeviceCall::forward_out).
_FORWARD_OUTPUTS = ("loss", "nll_loss", "chosen_logps", "rejected_logps", "chosen_logits_mean", "rejected_logits_mean",
                    "chosen_rewards", "rejected_rewards")


def _forward_outputs(wires, like):
    """SPEC's forward outputs (host values from the call) as tensors on like's device. Staged in one pinned buffer
    (torch's caching host allocator) and copied asynchronously, one tensor per output (an op's outputs may not alias
    one another): a copy from pageable memory would synchronize the stream once per output."""
    import numpy as np
    import torch

    from ._arrays import from_wire

    if any(w[0] != "F32" for w in wires.values()):
        return {name: from_wire(w, like=like) for name, w in wires.items()}
    arrays = {name: np.asarray(w[2]).view(np.float32).reshape(w[1]) for name, w in wires.items()}
    staged = torch.empty(sum(a.size for a in arrays.values()), dtype=torch.float32, pin_memory=True)
    host = staged.numpy()
    out, at = {}, 0
    for name, a in arrays.items():
        host[at:at + a.size] = a.reshape(-1)
        out[name] = staged[at:at + a.size].view(a.shape).to(like.device, non_blocking=True)
        at += a.size
    return out


def _device_scale(scale, like):
    """A float32 scalar tensor on like's device holding `scale` (a tensor there: grad_output), not read by the host."""
    import torch

    return scale.detach().to(device=like.device, dtype=torch.float32).reshape(()).contiguous()


def finish_weight_gradient(pending, workspace, scale):
    """The deferred grad_weight of compute(defer_weight=True) with the loss scale: T(scale (the step's sum)), one
    rounding, in the grad_weight tensor compute returned, on the current stream of the workspace's device. The scale
    is a tensor on the device (grad_output), read by the kernels: no synchronization. Once per pending (InputError
    after)."""
    import torch

    dev = workspace.device
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev)
        s = _device_scale(scale, workspace)
        _core.finish_weight_gradient_by(pending, s.data_ptr(), stream.cuda_stream)
        workspace.record_stream(stream)  # the GEMM reads it on this stream: torch frees it only after


def scale_gradient_(hi, lo, scale):
    """hi = T(scale (hi + lo)) in place, the scale a tensor on the device (grad_output); at 1 hi is left as it is.
    Returns hi."""
    import torch

    dev = hi.device
    with torch.cuda.device(dev):
        s = _device_scale(scale, hi)
        _core.scale_gradient_by(_dtype_name(hi), hi.data_ptr(), 0 if lo is None else lo.data_ptr(), hi.numel(),
                                s.data_ptr(), hi.data_ptr(), dev.index, torch.cuda.current_stream(dev).cuda_stream)
    return hi


def scale_gradient(hi, lo, scale):
    """A new tensor T(scale (hi + lo)) on hi's device and current stream: one rounding (lo None: T(scale hi)). At
    scale 1, hi's values: the step's own rounding, which T(hi + lo) can differ from on a tie."""
    import torch

    if scale == 1.0:
        return hi.clone()
    out = torch.empty_like(hi)
    dev = hi.device
    with torch.cuda.device(dev):
        _core.scale_gradient(_dtype_name(hi), hi.data_ptr(), 0 if lo is None else lo.data_ptr(), hi.numel(),
                             float(scale), out.data_ptr(), dev.index, torch.cuda.current_stream(dev).cuda_stream)
    return out
