#!/usr/bin/python3
"""SPEC's fused linear + SimPO loss in float32 numpy, as a user would write it, driven by simpo-verify:
    simpo-verify sweep --impl 'exec:python3 examples/numpy_simpo.py' --cases 200
Persistent protocol (SPEC "External implementations"): one JSON request per stdin line, one JSON answer per case.
SIMPO_PLANTED_BUG=<name> plants one bug (verifier/README.md's table); unset, it is correct.
SIMPO_LOGITS=bf16 rounds the logits to bf16 before the softmax, as TRL's eager loss and Liger do (judge it with
--profile bf16_logits); SIMPO_GRADS=bf16 writes the gradients in bf16. It answers SPEC's capabilities handshake: all of SPEC, deterministic."""
import json, os, struct, sys
import numpy as np
np.seterr(over="ignore")  # exp(s) -> inf gives sigmoid's exact limit

BUG = os.environ.get("SIMPO_PLANTED_BUG", "")
BF16_LOGITS = os.environ.get("SIMPO_LOGITS", "f32") == "bf16"
BF16_GRADS = os.environ.get("SIMPO_GRADS", "f32") == "bf16"  # gradients written as bf16, as torch and Liger return them

def bf16(a):  # float32 -> nearest bf16 (ties to even), kept as float32
    b = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).view(np.float32)

def read(path):  # safetensors: 8-byte header length, JSON header, raw data; bf16 is a float32's top half
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8:8 + n])
    meta, out = head.pop("__metadata__", {}), {}
    for k, t in head.items():
        raw = data[8 + n + t["data_offsets"][0]:8 + n + t["data_offsets"][1]]
        a = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view("<f4") if t["dtype"] == "BF16" else np.frombuffer(raw, "<i8")
        out[k] = a.reshape(t["shape"])
    return out, meta

def write(path, tensors):
    head, blobs, off = {}, [], 0
    for k, a in tensors.items():
        half = BF16_GRADS and k.startswith("grad_")
        b = (bf16(a).view("<u4") >> 16).astype("<u2").tobytes() if half else np.ascontiguousarray(a, "<f4").tobytes()
        head[k], off = {"dtype": "BF16" if half else "F32", "shape": list(np.shape(a)), "data_offsets": [off, off + len(b)]}, off + len(b)
        blobs.append(b)
    h = json.dumps(head).encode()
    open(path, "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))

def compute(t, meta, gradients):
    x, w, tgt, bias = t["x"], t["weight"], t["target"], t.get("bias")
    hp = {k: float(meta.get(k, d)) for k, d in [("beta", .1), ("gamma", .5), ("alpha", 1), ("label_smoothing", 0), ("grad_scale", 1)]}
    beta, gamma, alpha, ls, gs = hp["beta"], hp["gamma"], hp["alpha"], hp["label_smoothing"], hp["grad_scale"]
    nll_on, ii = meta.get("compute_nll_loss", "true") == "true", int(meta.get("ignore_index", -100))
    (B, T, H), V = x.shape, w.shape[0]
    P, N = B // 2, B * T
    if BUG == "dies_on_large_v" and V > 1000: os._exit(3)
    if BUG == "refuses_alpha_zero" and alpha == 0: raise ValueError("alpha must be > 0")
    if BUG == "ls_with_bias" and bias is not None: ls = ls / 2
    if BUG == "ignores_grad_scale": gs = 1.0
    m = (tgt >= 0) if BUG == "ignore_index_in_vocab" else (tgt != ii)
    if ((tgt < 0) | (tgt >= V))[m].any(): raise ValueError("a target outside [0, V) that is not ignore_index")
    n, Nc = m.sum(1), m[:P].sum()
    nf = np.maximum(n, 1).astype(np.float32)
    if (n == 0).any() and meta.get("empty_sequence", "error") == "error": raise ValueError("a sequence with no completion token")
    if nll_on and Nc == 0 and alpha != 0: raise ValueError("compute_nll_loss with no chosen completion token")
    z = x.reshape(N, H) @ w.T + (0 if bias is None else bias)
    if BF16_LOGITS: z = bf16(z)
    zp = np.pad(z, ((0, 0), (0, -V % 8))) if BUG == "pads_vocab_to_8" else z
    zmax = zp.max(1, keepdims=True)
    lse = zmax[:, 0] + np.log(np.exp(zp - zmax).sum(1))
    tt = np.where(m, tgt, 0).reshape(N)
    l = (z[np.arange(N), tt] - lse).reshape(B, T) * m
    avg = l.sum(1) / nf
    s = beta * (avg[:P] - avg[P:]) - gamma
    nll_den = P * T if BUG == "nll_over_all_positions" else max(Nc, 1)
    nll = -l[:P].sum() / nll_den if nll_on else np.float32(0)
    out = {"loss": alpha * nll + np.mean((1 - ls) * np.logaddexp(0, -s) + ls * np.logaddexp(0, s)), "nll_loss": nll,
           "chosen_logps": avg[:P], "rejected_logps": avg[P:], "chosen_logits_mean": z[:P * T].mean(),
           "rejected_logits_mean": z[P * T:].mean(), "chosen_rewards": beta * avg[:P], "rejected_rewards": beta * avg[P:]}
    if gradients:
        g = (-(1 - ls) / (1 + np.exp(s)) + ls / (1 + np.exp(-s))) / P  # (1-ls) sigmoid(-s), ls sigmoid(s)
        k = np.concatenate([beta * g, -beta * g]) / nf
        k = gs * m * (k[:, None] - (np.arange(B) < P)[:, None] * (alpha / nll_den if nll_on else 0)).astype(np.float32)
        dz = -k.reshape(N, 1) * np.exp(z - lse[:, None])
        dz[np.arange(N), tt] += k.reshape(N)
        out["grad_x"] = (dz @ w).reshape(B, T, H)
        if BUG == "chunk_tail" and N > 16 and N % 16: out["grad_x"].reshape(N, H)[N - N % 16:] *= 0.5  # chunks of 16 rows
        out["grad_weight"] = dz.T @ x.reshape(N, H)
        if BUG == "weight_grad_bf16_chunks":  # chunks of 4 rows, the running sum kept in bf16 (ANCHORS' first bug class)
            acc = np.zeros((V, H), np.float32)
            for r in range(0, N, 4): acc = bf16(acc + dz[r:r + 4].T @ x.reshape(N, H)[r:r + 4])
            out["grad_weight"] = acc
        if BUG == "nondeterministic" and os.urandom(1)[0] % 2:  # one ulp in one element, on half the runs
            gx = out["grad_x"] = out["grad_x"].astype(np.float32)
            i = np.argmax(np.abs(gx))  # a completion row's element (ignored rows are exactly 0)
            gx.flat[i] = np.nextafter(gx.flat[i], np.float32(np.inf))
        if bias is not None: out["grad_bias"] = dz.sum(0)
    return out

for line in sys.stdin:
    req = json.loads(line)
    if "capabilities" in req:  # SPEC's handshake, once before the first case
        print(json.dumps({"ok": True, "capabilities": {"deterministic": True}}), flush=True)
        continue
    try:
        write(req["outputs"], compute(*read(req["inputs"]), req["gradients"]))
        print(json.dumps({"ok": True}), flush=True)
    except ValueError as e:
        print(json.dumps({"ok": False, "error": str(e)}), flush=True)
