"""simpo_verify: the fused linear + SimPO loss (SPEC.md) and its verifier, from Python.

    compute(x, weight, target, bias=None, *, impl="auto", gradients=True, **hyperparameters) -> dict
    check(inputs, candidate, profile="strict") -> Report
    serve(fn)                                  the exec: protocol's persistent form for a Python callable
    sweep(fn, cases=300, seed=..., profile="strict") -> SweepReport

Everything runs in the project's C++ libraries (problem/, reference/, fused/, verifier/) through the extension
simpo_verify._core; this layer only converts arrays. simpo_verify.torch holds the Liger-compatible module.
"""

from __future__ import annotations

import json
import os

from ._libs import load_core

_core = load_core()  # before anything else imports it: finds the CUDA libraries a repaired wheel leaves out

from ._arrays import HYPERPARAMETERS, InputError, framework, from_wire, hyperparameters_of, is_cuda, metadata, to_wire  # noqa: E402
from .serve import serve  # noqa: E402
from .sweep import SweepReport, sweep  # noqa: E402

__all__ = ["compute", "check", "reference", "Judge", "Report", "serve", "sweep", "SweepReport", "InputError",
           "HYPERPARAMETERS", "load_inputs", "save_inputs", "load_outputs", "save_outputs", "cuda_available"]

DEFAULT_WORKSPACE_BYTES = 2 << 30  # fused::default_workspace_bytes

IMPLEMENTATIONS = ("auto", "cuda", "cpu", "reference")


def cuda_available() -> bool:
    """A CUDA device is present and this build has the cuda backend."""
    return _core.cuda_available()


def _problem(x, weight, target, bias, hyperparameters):
    tensors = {"x": to_wire("x", x), "weight": to_wire("weight", weight),
               "target": to_wire("target", target, integer_to_int64=True)}
    if bias is not None:
        tensors["bias"] = to_wire("bias", bias)
    return _core.problem(tensors, metadata(hyperparameters), "inputs")


def compute(x, weight, target, bias=None, *, impl="auto", gradients=True, grad_f32=False, validate=True,
            workspace_bytes=DEFAULT_WORKSPACE_BYTES, max_chunk_rows=0, **hyperparameters):
    """SPEC's outputs for one problem, as a dict name -> array of the inputs' framework.

    x [B,T,H], weight [V,H], bias [V] (optional): one dtype of bfloat16 (ml_dtypes' with numpy), float16 or float32
    (numpy, torch, JAX, or any array numpy can read; mixing dtypes is an InputError naming both); target [B,T]: any
    integer dtype (widened to int64 exactly). Gradients come back in the inputs' dtype (grad_weight and grad_bias in
    float32 with grad_f32), scalars and per-pair outputs in float32 (float64 from impl="reference"). Hyperparameters are SPEC's
    (beta, gamma, alpha, label_smoothing, compute_nll_loss, ignore_index, grad_scale, empty_sequence); unknown
    names are an InputError.

    impl: "auto" (the cuda backend where a device is present, else cpu), "cuda", "cpu", or "reference" (float64).
    Inputs on a CUDA device (torch, or any DLPack CUDA array) stay there: the cuda backend reads them in place and
    the outputs come back on that device (gradients bf16, or f32 with grad_f32; scalars f32); it takes bfloat16
    only (f16 and f32 inputs: on the host, impl "cpu" or "reference"). Host inputs give host outputs. Invalid
    inputs raise InputError with SPEC's message.
    """
    if impl not in IMPLEMENTATIONS:
        raise InputError(f"impl {impl!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    on_device = [is_cuda(a) for a in (x, weight, target, bias) if a is not None]
    if any(on_device):
        if impl not in ("auto", "cuda"):
            raise InputError(f"impl {impl!r} runs on the host, but the inputs are on a CUDA device: "
                             f"use impl='cuda' (or 'auto'), or move the inputs to the host")
        from . import _device
        from ._arrays import to_torch

        fw = framework(x)
        tx, tw, tt = to_torch(x), to_torch(weight), to_torch(target)
        tb = to_torch(bias) if bias is not None else None
        out, _ = _device.compute(tx, tw, tt, tb, metadata(hyperparameters), gradients=gradients, grad_f32=grad_f32,
                                 validate=validate, workspace_bytes=workspace_bytes, max_chunk_rows=max_chunk_rows)
        if fw == "torch":
            return out
        if fw == "jax":
            import jax.dlpack

            return {k: jax.dlpack.from_dlpack(v) for k, v in out.items()}
        return out  # other frameworks (CuPy has no bfloat16): torch tensors on the same device, DLPack-capable
    problem = _problem(x, weight, target, bias, hyperparameters)
    wire = _core.compute(problem, impl, gradients, grad_f32, validate, workspace_bytes, max_chunk_rows)
    return {name: from_wire(w, like=x) for name, w in wire.items()}


def _is_path(a):
    return isinstance(a, (str, os.PathLike))


def _inputs_problem(inputs):
    """An inputs file path, a dict with x, weight, target, optional bias, and any hyperparameters, or a Problem
    the extension already holds (e.g. from _core.generate: no copy through arrays)."""
    if isinstance(inputs, _core.Problem):
        return inputs
    if _is_path(inputs):
        return _core.load_problem(os.fspath(inputs))
    if not isinstance(inputs, dict):
        raise InputError(f"inputs must be an inputs-file path or a dict of arrays, not {type(inputs).__name__}")
    tensors = {k: v for k, v in inputs.items() if k in ("x", "weight", "target", "bias")}
    hp = {k: v for k, v in inputs.items() if k not in tensors}
    missing = [k for k in ("x", "weight", "target") if k not in tensors]
    if missing:
        raise InputError(f"inputs have no {', '.join(missing)}")
    return _problem(tensors["x"], tensors["weight"], tensors["target"], tensors.get("bias"), hp)


def _outputs_wire(outputs, source):
    if _is_path(outputs):
        return _core.load_outputs(os.fspath(outputs))
    if not isinstance(outputs, dict):
        raise InputError(f"{source} must be an outputs-file path or a dict of arrays, not {type(outputs).__name__}")
    return _core.check_outputs({k: to_wire(k, v) for k, v in outputs.items()}, source)


def reference(inputs, *, gradients=True):
    """The float64 reference's outputs for `inputs` (a path or a dict as check takes), as numpy arrays."""
    problem = _inputs_problem(inputs)
    return {k: from_wire(w) for k, w in _core.reference(problem, gradients).items()}


class Judge:
    """The reference's outputs and the error model's scales for one problem, computed once, for judging many
    candidates of it (check() makes one per call). Judge(inputs).check(candidate, profile="strict") -> Report.

    Where the reference runs on the GPU (reference-cuda built, a device present, bf16 inputs large enough for
    --reference auto to pick it), its float64 gradients stay on the device and candidates are compared there: a
    candidate's CUDA arrays (torch, or any DLPack CUDA array) are read in place, host arrays are uploaded; only the
    per-tensor summaries come back (on_device says which). `exact` downloads the gradients on first use."""

    def __init__(self, inputs, *, gradients=True, exact=None):
        self.problem = _inputs_problem(inputs)
        self.gradients = gradients
        self._exact = None
        if exact is None:  # the reference here: its dz pass gives the scales the softmax norms (O(N), not O(N H V))
            self._judge = _core.Judge(self.problem, gradients)
        else:
            wire = {k: to_wire(k, v) for k, v in exact.items() if gradients or not k.startswith("grad_")}
            self._judge = _core.Judge(self.problem, wire)
            self._exact = {k: from_wire(w) for k, w in wire.items()}

    @property
    def on_device(self) -> bool:
        """The reference's gradients are on the GPU and candidates are compared there."""
        return self._judge.on_device()

    @property
    def exact(self) -> dict:
        if self._exact is None:
            self._exact = {k: from_wire(w) for k, w in self._judge.exact().items()}
        return self._exact

    def prepare(self, profile):
        """Measures what `profile` needs of the problem now rather than at its first check (bf16_logits: fp32
        logits on the host, O(N H V))."""
        self._judge.prepare(profile)

    def check(self, candidate, profile="strict", *, rtol=None, atol=None) -> "Report":
        device = {}
        if isinstance(candidate, dict) and self._judge.on_device():
            from ._arrays import to_torch

            device = {k: to_torch(v).detach().contiguous() for k, v in candidate.items() if is_cuda(v)}
            candidate = {k: v for k, v in candidate.items() if k not in device}
        if not self.gradients:
            device = {k: v for k, v in device.items() if not k.startswith("grad_")}
        cand = _outputs_wire(candidate, "candidate")
        if not self.gradients:
            cand = {k: v for k, v in cand.items() if not k.startswith("grad_")}
        if rtol is not None or atol is not None:
            return Report(self._judge.check(cand, device, "user", float(rtol or 0.0), float(atol or 0.0)))
        return Report(self._judge.check(cand, device, profile))


class Report:
    """The verifier's judgement of one candidate: passed, per-tensor rows, to_json(); prints as the CLI's table."""

    def __init__(self, raw: dict):
        self._raw = raw
        self.profile: str = raw["profile"]
        self.passed: bool = raw["passed"]
        self.rows: list = raw["tensors"]  # one dict per output tensor, in SPEC's order
        self.worst_margin: float = raw["worst_margin"]

    def row(self, name):
        for r in self.rows:
            if r["name"] == name:
                return r
        raise KeyError(name)

    def failed(self):
        return [r["name"] for r in self.rows if r["verdict"].lower() == "failed"]

    def to_json(self) -> str:
        return self._raw["json"]

    def to_dict(self) -> dict:
        return json.loads(self._raw["json"])

    def __str__(self) -> str:
        return self._raw["table"]

    def __repr__(self) -> str:
        verdict = "passed" if self.passed else f"failed: {', '.join(self.failed()) or 'missing tensors'}"
        return f"<simpo_verify.Report {self.profile}: {verdict}>"


def check(inputs, candidate, profile="strict", *, rtol=None, atol=None, gradients=True, exact=None) -> Report:
    """Judges a candidate's outputs against the float64 reference, as `simpo-verify check` does.

    inputs: an inputs-file path, or a dict {x, weight, target, [bias], [hyperparameter: value ...]}.
    candidate: an outputs-file path, or a dict of SPEC output names -> arrays (any framework, host or device).
    profile: "strict" (bounds derived from dtypes and shapes), "bf16_logits" (the same for logits rounded to bf16
    before the softmax, as TRL and Liger do) or "peer" (Liger's atol = rtol = 5e-3); rtol/atol
    given: the user profile. gradients=False expects a forward-only candidate. exact: the reference's outputs
    (from reference()) to reuse across candidates of the same inputs.
    """
    return Judge(inputs, gradients=gradients, exact=exact).check(candidate, profile, rtol=rtol, atol=atol)


def load_inputs(path):
    """An inputs file -> dict {x, weight, target, [bias], hyperparameters...} of numpy arrays and values."""
    tensors, meta = _core.load_problem(os.fspath(path)).tensors()
    out = {k: from_wire(w) for k, w in tensors.items()}
    out.update(hyperparameters_of(meta))
    return out


def save_inputs(path, x, weight, target, bias=None, **hyperparameters):
    _problem(x, weight, target, bias, hyperparameters).save(os.fspath(path))


def load_outputs(path):
    return {k: from_wire(w) for k, w in _core.load_outputs(os.fspath(path)).items()}


def save_outputs(path, outputs: dict):
    _core.save_outputs(os.fspath(path), {k: to_wire(k, v) for k, v in outputs.items()})
