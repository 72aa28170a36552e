"""serve(fn): a Python callable as an `exec:` implementation (SPEC "External implementations").

Persistent form: one JSON line per case on stdin, {"inputs": path, "outputs": path, "gradients": bool}; fn runs
on the inputs file's arrays and hyperparameters, its outputs are written to the outputs file, and one line goes
back on stdout: {"ok": true}, or {"ok": false, "error": "..."} when fn raised (a refusal). Returns at end of input.

    simpo-verify sweep --impl 'exec:python3 -m simpo_verify.serve mypeer:simpo'          # persistent
    simpo-verify compute --impl 'exec:python3 -m simpo_verify.serve mypeer:simpo --inputs {inputs}
        --outputs {outputs} --gradients {gradients}' ...                                    # one-shot

fn(x, weight, target, bias=None, *, gradients=True, **hyperparameters) -> dict of SPEC output name -> array;
arrays are numpy (bf16 as ml_dtypes.bfloat16) or, with arrays="torch", torch tensors on `device`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import traceback

from ._arrays import from_wire, hyperparameters_of, to_wire


def _arrays_of(tensors: dict, meta: dict, arrays: str, device):
    like = None
    if arrays == "torch":
        import torch

        like = torch.empty(0, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    elif arrays != "numpy":
        raise ValueError(f"arrays={arrays!r}: expected 'numpy' or 'torch'")
    a = {k: from_wire(w, like=like) for k, w in tensors.items()}
    return a["x"], a["weight"], a["target"], a.get("bias"), hyperparameters_of(meta)


def call(fn, tensors: dict, meta: dict, gradients: bool, arrays="numpy", device=None) -> dict:
    """fn on wire tensors -> wire outputs (what serve and sweep both do per case)."""
    x, weight, target, bias, hp = _arrays_of(tensors, meta, arrays, device)
    out = fn(x, weight, target, bias, gradients=gradients, **hp)
    if not isinstance(out, dict):
        raise TypeError(f"the implementation returned {type(out).__name__}, not a dict of SPEC outputs")
    return {k: to_wire(k, v) for k, v in out.items() if v is not None}


def run_one(fn, inputs: str, outputs: str, gradients: bool, arrays="numpy", device=None):
    from . import _core

    tensors, meta = _core.load_problem(inputs).tensors()
    _core.save_outputs(outputs, call(fn, tensors, meta, gradients, arrays, device))


def serve(fn, *, arrays="numpy", device=None, stdin=None, stdout=None, capabilities=None):
    """Answers the persistent exec: protocol for fn until stdin closes.

    capabilities: the declaration sent in answer to SPEC's handshake ({"capabilities": true}); by default
    fn.capabilities when fn has one. Without either, the handshake is answered {"ok": false} (all of SPEC).

    With the default streams, anything else written to standard output (fn's prints, a library's logs, at the
    file-descriptor level too) is sent to standard error instead, so the protocol's stdout carries answers only.
    """
    stdin = stdin if stdin is not None else sys.stdin
    if stdout is None:
        sys.stdout.flush()
        protocol_fd = os.dup(1)
        os.dup2(2, 1)  # fd 1 now reaches stderr: stray output can no longer corrupt the protocol
        sys.stdout = sys.stderr
        stdout = os.fdopen(protocol_fd, "w", buffering=1)
    if capabilities is None:
        capabilities = getattr(fn, "capabilities", None)
    for line in stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if "capabilities" in request:  # SPEC's handshake, before the first case
                answer = ({"ok": True, "capabilities": capabilities} if capabilities is not None
                          else {"ok": False, "error": "no capabilities declared: all of SPEC"})
                stdout.write(json.dumps(answer) + "\n")
                stdout.flush()
                continue
            run_one(fn, request["inputs"], request["outputs"], bool(request.get("gradients", True)), arrays, device)
            answer = {"ok": True}
        except Exception as e:  # any exception is the implementation refusing these inputs
            traceback.print_exc(file=sys.stderr)
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(answer) + "\n")
        stdout.flush()


def load_callable(spec: str):
    """'package.module:function' or 'path/to/file.py:function' -> the function."""
    if ":" not in spec:
        raise ValueError(f"{spec!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = module
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m simpo_verify.serve",
                                description="serve a Python SimPO implementation over simpo-verify's exec: protocol")
    p.add_argument("target", help="MODULE:FUNCTION or FILE.py:FUNCTION")
    p.add_argument("--torch", action="store_true", help="pass torch tensors (default: numpy arrays)")
    p.add_argument("--device", default=None, help="torch device for --torch (default: cuda when available)")
    p.add_argument("--inputs", help="one-shot form: the inputs file")
    p.add_argument("--outputs", help="one-shot form: the outputs file")
    p.add_argument("--gradients", default="true", choices=["true", "false"], help="one-shot form")
    p.add_argument("--capabilities", default=None,
                   help="persistent form: the declaration (a JSON object, or FILE.json) answered to the capabilities "
                        "handshake; default: FUNCTION.capabilities when it has one (SPEC 'External implementations')")
    a = p.parse_args(argv)
    fn = load_callable(a.target)
    capabilities = None
    if a.capabilities:
        text = open(a.capabilities).read() if os.path.exists(a.capabilities) else a.capabilities
        try:
            capabilities = json.loads(text)
        except json.JSONDecodeError as e:
            p.error(f"--capabilities: not JSON: {e}")
    arrays = "torch" if a.torch else "numpy"
    if a.inputs or a.outputs:
        if not (a.inputs and a.outputs):
            p.error("the one-shot form needs both --inputs and --outputs")
        try:
            run_one(fn, a.inputs, a.outputs, a.gradients == "true", arrays, a.device)
        except Exception as e:
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
            return 1
        return 0
    serve(fn, arrays=arrays, device=a.device, capabilities=capabilities)
    return 0


if __name__ == "__main__":
    sys.exit(main())
