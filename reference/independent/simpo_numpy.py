#!/usr/bin/python3
"""A second, independent float64 implementation of SPEC's SimPO function, in numpy.

It shares nothing with the C++ reference: its own safetensors reader (json + numpy), its own formulas (autograd
style: logits materialized per sequence, softmax by np.exp, log-sigmoid by np.logaddexp), so an error in either
shows up as a disagreement. It recomputes every fixture and compares with the stored reference outputs:

    simpo_numpy.py                          every fixtures/cases/<name>.inputs.safetensors of this tree
    simpo_numpy.py --cases-dir DIR          every <name>.inputs.safetensors in DIR
    simpo_numpy.py --inputs IN --outputs OUT   one pair (any float64 implementation's outputs: the bound
                                               below is float64's, so an f32/bf16 candidate fails it)

Exit 0 when every tensor agrees, 1 on any mismatch (or a missing tensor, wrong shape, NaN), 2 on unreadable
input, 77 when a cases directory holds no case (ctest reports it as skipped, never as passed).

The bound. Both implementations evaluate the same exact function in float64 on the same inputs (bf16 decodes
exactly), so they differ by rounding alone. Each logit is a sum of H products: its rounding error is at most
H eps sum_h |x_h w_h| (eps = 1.1e-16; 4.5e-13 of that sum at H = 4096, ~sqrt(H) eps = 7e-15 in practice).
log-sum-exp, log-probs and softmax have derivatives bounded by 1 in the logits, so their absolute errors are the
logit errors plus V eps for the sum over the vocabulary (1.4e-11 at V = 128256 in the worst case, ~4e-14 in
practice); averages over T tokens and sums over N rows add at most n eps relative to their terms. Measured
normwise (max |a - b| / scale of the tensor), the disagreement is therefore below ~1e-12 at every fixture size,
while a single float32 step anywhere costs >= 6e-8 and a bf16 step >= 4e-3: 1e-10 separates "the same function,
in float64" from anything else with a margin of 100 on both sides.

Scales: gradients and per-pair tensors use max |reference| over the tensor; loss and nll_loss are sums of
non-negative terms (no cancellation) and use |reference|; the logits means can cancel to nearly zero, so they use
the mean |logit| their rounding scales with.
"""

import argparse
import json
import math
import pathlib
import struct
import sys

import numpy as np

BOUND = 1e-10

SCALAR_NAMES = ["loss", "nll_loss", "chosen_logits_mean", "rejected_logits_mean"]
PAIR_NAMES = ["chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards"]
GRAD_NAMES = ["grad_x", "grad_weight", "grad_bias"]


class BadInput(Exception):
    pass


# ---- safetensors: 8-byte little-endian header length, JSON header, raw little-endian data ----

def read_safetensors(path):
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as e:
        raise BadInput(f"{path}: cannot read: {e.strerror}")
    if len(data) < 8:
        raise BadInput(f"{path}: {len(data)} bytes, too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", data[:8])
    if 8 + header_len > len(data):
        raise BadInput(f"{path}: header length {header_len} runs past the end of the file")
    try:
        header = json.loads(data[8:8 + header_len])
    except ValueError as e:
        raise BadInput(f"{path}: header is not JSON: {e}")
    metadata = header.pop("__metadata__", None) or {}
    body = data[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        raw = body[begin:end]
        dtype = info["dtype"]
        if dtype == "BF16":
            # bf16 is the top half of a float32: widen the bits, then read as float32 (exact), then float64.
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            values = bits.view("<f4").astype(np.float64)
        elif dtype == "F32":
            values = np.frombuffer(raw, dtype="<f4").astype(np.float64)
        elif dtype == "F64":
            values = np.frombuffer(raw, dtype="<f8").astype(np.float64)
        elif dtype == "I64":
            values = np.frombuffer(raw, dtype="<i8").astype(np.int64)
        else:
            raise BadInput(f"{path}: tensor {name} has dtype {dtype}, not one of BF16 F32 F64 I64")
        if values.size != math.prod(shape):
            raise BadInput(f"{path}: tensor {name} holds {values.size} values for shape {list(shape)}")
        tensors[name] = values.reshape(shape)
    return tensors, metadata


def hyperparameters(metadata, path):
    def number(key, default):
        try:
            return float(metadata.get(key, default))
        except ValueError:
            raise BadInput(f"{path}: metadata {key} = {metadata[key]!r} is not a number")

    return {
        "beta": number("beta", 0.1),
        "gamma": number("gamma", 0.5),
        "alpha": number("alpha", 1.0),
        "label_smoothing": number("label_smoothing", 0.0),
        "grad_scale": number("grad_scale", 1.0),
        "compute_nll_loss": metadata.get("compute_nll_loss", "true") == "true",
        "ignore_index": int(metadata.get("ignore_index", "-100")),
        "empty_sequence": metadata.get("empty_sequence", "error"),
    }


# ---- the function ----

def log_sigmoid(s):
    return -np.logaddexp(0.0, -s)


def sigmoid(s):
    return np.exp(log_sigmoid(s))


def simpo(x, weight, bias, target, hp):
    """SPEC's outputs in float64. Logits are materialized one sequence at a time ([T, V])."""
    B, T, H = x.shape
    V = weight.shape[0]
    if B % 2:
        raise BadInput(f"B = {B} is odd")
    P = B // 2
    mask = target != hp["ignore_index"]
    n = mask.sum(axis=1)
    if hp["empty_sequence"] != "zero" and (n == 0).any():
        raise BadInput(f"sequence {int(np.argmax(n == 0))} has no completion token")

    # Forward: per-token log-probs and per-sequence logit sums; the softmax is kept for the backward pass.
    logprob = np.zeros((B, T))
    logit_sum = np.zeros(B)
    logit_abs_sum = np.zeros(B)
    softmax = []
    for b in range(B):
        z = x[b] @ weight.T
        if bias is not None:
            z = z + bias
        logit_sum[b] = z.sum()
        logit_abs_sum[b] = np.abs(z).sum()
        shift = z.max(axis=1, keepdims=True)
        e = np.exp(z - shift)
        total = e.sum(axis=1, keepdims=True)
        log_softmax = z - shift - np.log(total)
        safe_target = np.where(mask[b], target[b], 0)
        logprob[b] = np.where(mask[b], log_softmax[np.arange(T), safe_target], 0.0)
        softmax.append(e / total)

    avg = np.where(n > 0, logprob.sum(axis=1) / np.maximum(n, 1), 0.0)
    c, r = avg[:P], avg[P:]
    beta, gamma, ls = hp["beta"], hp["gamma"], hp["label_smoothing"]
    s = beta * (c - r) - gamma
    pref = np.mean(-(1 - ls) * log_sigmoid(s) - ls * log_sigmoid(-s))
    chosen_tokens = n[:P].sum()
    nll_on = hp["compute_nll_loss"] and chosen_tokens > 0
    nll = -logprob[:P].sum() / chosen_tokens if nll_on else 0.0
    loss = hp["alpha"] * nll + pref
    logits_per_side = P * T * V

    out = {
        "loss": np.array(loss),
        "nll_loss": np.array(nll),
        "chosen_logps": c,
        "rejected_logps": r,
        "chosen_rewards": beta * c,
        "rejected_rewards": beta * r,
        "chosen_logits_mean": np.array(logit_sum[:P].sum() / logits_per_side),
        "rejected_logits_mean": np.array(logit_sum[P:].sum() / logits_per_side),
    }
    # The scale the logits means' rounding is relative to (see the module docstring).
    logit_scale = {
        "chosen_logits_mean": logit_abs_sum[:P].sum() / logits_per_side,
        "rejected_logits_mean": logit_abs_sum[P:].sum() / logits_per_side,
    }

    # Backward, by the chain rule from the loss down: d loss / d avg, then d avg / d logprob, then the softmax.
    g = (-(1 - ls) * sigmoid(-s) + ls * sigmoid(s)) / P
    d_avg = np.concatenate([beta * g, -beta * g])
    d_logprob = np.where(mask, (d_avg / np.maximum(n, 1))[:, None], 0.0)
    if nll_on:
        d_logprob[:P] -= hp["alpha"] * mask[:P] / chosen_tokens
    d_logprob *= hp["grad_scale"]
    grad_x = np.zeros_like(x)
    grad_weight = np.zeros_like(weight)
    grad_bias = np.zeros(V)
    for b in range(B):
        # d logprob_t / d z = onehot(target) - softmax, for completion tokens only.
        onehot = np.zeros((T, V))
        rows = np.nonzero(mask[b])[0]
        onehot[rows, target[b][rows]] = 1.0
        dz = d_logprob[b][:, None] * (onehot - softmax[b])
        grad_x[b] = dz @ weight
        grad_weight += dz.T @ x[b]
        grad_bias += dz.sum(axis=0)
    out["grad_x"] = grad_x
    out["grad_weight"] = grad_weight
    if bias is not None:
        out["grad_bias"] = grad_bias
    return out, logit_scale


# ---- comparison ----

def compare(name, got, expected, logit_scale):
    """(error, scale, problem-or-None). error is max |got - expected| / scale."""
    if got.shape != expected.shape:
        return math.inf, math.nan, f"shape {list(got.shape)}, expected {list(expected.shape)}"
    if not np.isfinite(got).all():
        return math.inf, math.nan, "NaN or Inf"
    if name in logit_scale:
        scale = logit_scale[name]
    elif name in ("loss", "nll_loss"):
        scale = abs(float(expected))
    else:
        scale = float(np.abs(expected).max()) if expected.size else 0.0
    diff = float(np.abs(got - expected).max()) if expected.size else 0.0
    error = diff / scale if scale > 0 else diff
    return error, scale, None


def check_pair(case, inputs_path, outputs_path, rows):
    inputs, metadata = read_safetensors(inputs_path)
    for required in ("x", "weight", "target"):
        if required not in inputs:
            raise BadInput(f"{inputs_path}: no tensor {required}")
    hp = hyperparameters(metadata, inputs_path)
    expected, logit_scale = simpo(inputs["x"], inputs["weight"], inputs.get("bias"), inputs["target"], hp)
    candidate, _ = read_safetensors(outputs_path)
    unknown = sorted(set(candidate) - set(expected) - set(GRAD_NAMES))
    if unknown:
        raise BadInput(f"{outputs_path}: unknown output tensors {unknown}")
    ok = True
    for name in SCALAR_NAMES + PAIR_NAMES + GRAD_NAMES:
        if name not in expected:
            continue
        if name not in candidate:
            # A forward-only file may omit the gradients (not checked, never passed); a forward tensor may not.
            status = "not checked" if name in GRAD_NAMES else "MISSING"
            ok &= status == "not checked"
            rows.append((case, name, "-", "-", "-", status))
            continue
        error, scale, problem = compare(name, candidate[name], expected[name], logit_scale)
        passed = problem is None and error <= BOUND
        ok &= passed
        rows.append((case, name, list(expected[name].shape), f"{scale:.3g}", f"{error:.2e}",
                     "ok" if passed else f"MISMATCH{' (' + problem + ')' if problem else ''}"))
    if "grad_bias" in candidate and "grad_bias" not in expected:
        ok = False
        rows.append((case, "grad_bias", "-", "-", "-", "UNEXPECTED (the inputs have no bias)"))
    return ok


def print_table(rows):
    header = ("case", "tensor", "shape", "scale", "error", "status")
    text = [tuple(str(c) for c in row) for row in [header] + rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(header))]
    for i, row in enumerate(text):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main():
    here = pathlib.Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases-dir", default=str(here.parent.parent / "fixtures" / "cases"),
                        help="directory of <name>.inputs.safetensors + <name>.reference.safetensors")
    parser.add_argument("--inputs", help="one inputs file (with --outputs)")
    parser.add_argument("--outputs", help="the outputs file to check against --inputs")
    args = parser.parse_args()

    if (args.inputs is None) != (args.outputs is None):
        print("error: --inputs and --outputs go together", file=sys.stderr)
        return 2
    if args.inputs:
        pairs = [(pathlib.Path(args.inputs).name.removesuffix(".inputs.safetensors"), args.inputs, args.outputs)]
    else:
        directory = pathlib.Path(args.cases_dir)
        if not directory.is_dir():
            print(f"no cases directory {directory}: nothing checked", file=sys.stderr)
            return 77
        pairs = []
        for inputs in sorted(directory.glob("*.inputs.safetensors")):
            case = inputs.name.removesuffix(".inputs.safetensors")
            pairs.append((case, str(inputs), str(directory / f"{case}.reference.safetensors")))
        if not pairs:
            print(f"no *.inputs.safetensors in {directory}: nothing checked", file=sys.stderr)
            return 77

    rows, failed = [], []
    try:
        for case, inputs, outputs in pairs:
            if not check_pair(case, inputs, outputs, rows):
                failed.append(case)
    except BadInput as e:
        if rows:
            print_table(rows)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(rows)
    print(f"{len(pairs) - len(failed)} cases agree, {len(failed)} disagree (bound {BOUND:g}, normwise)"
          + (": " + ", ".join(failed) if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
