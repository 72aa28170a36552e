"""One process times ours (through simpo_verify.torch, its Python and autograd overhead included), torch eager
(TRL), Liger and CCE on the published workload (T=1024, H=4096, V=128256, bf16, no bias, every token a completion
token) at B = 2, 4, 8, 16, with the cuBLAS GEMM floor measured in the same process, and writes the peers JSON
(schema in python/README.md, "peers.json").

    python3 bench_peers.py OUT.json [--batches 2,4,8,16] [--reps 5] [--impls ours,torch_eager,liger,cce]
                           [--budget S] [--cce-probe] [--dtype bf16|f16|f32] [--paired A:B,...]

fwd: the loss alone (no autograd graph: torch.no_grad for the peers, no input requiring grad for ours).
full: forward + loss.backward(): every gradient, as one training step needs. Times are medians of --reps runs
after one warm-up, CUDA events on the current stream. extra_mib: peak device memory above the steady state
(inputs, and for full the gradient buffers, already allocated), from torch's allocator, plus for ours the
memory its kernel holds outside torch's allocator (workspace and fp32 accumulators: simpo_verify._device).

--paired A:B (impl names, e.g. ours:ours_third, ours:ours_novalidate) times A and B in turns, one rep of each per
round in alternating order, so both see the same clocks (timed in blocks, two runs of one impl differ by several
per cent on a lent card): per B the medians of A and B and the median, lowest and highest of the per-round ratio
B / A, for the forward and for the full step, in the row's "paired" and printed as `B=.. paired A:B ...`. The impl
`floor` is the floor's GEMMs as a loss (the logits GEMM forward, the two gradient GEMMs backward): `floor:ours`
gives ours' ratio to the floor timed in turns.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers import _simpo_terms  # noqa: E402

T, H, V = 1024, 4096, 128256
HP = dict(beta=0.1, gamma=0.5, alpha=1.0, label_smoothing=0.0, compute_nll_loss=True, ignore_index=-100,
          grad_scale=1.0, empty_sequence="error")


def workload_weight(g, dtype=torch.bfloat16):
    """The LM head W [V, H] ~ N(0, 4/H) (logits of standard deviation 2 against x ~ N(0, 1)), drawn from g first:
    every bench on this workload draws W, then x and t per B, from one generator seeded 0, so each B's inputs are
    the same in every tool."""
    return (torch.randn(V, H, device="cuda", generator=g) * (2.0 / H ** 0.5)).to(dtype)


def workload_rows(g, B, dtype=torch.bfloat16):
    """x [B, T, H] ~ N(0, 1) and targets t [B, T] uniform over V (every token a target), drawn from g."""
    x = torch.randn(B, T, H, device="cuda", generator=g).to(dtype)
    t = torch.randint(0, V, (B, T), device="cuda", generator=g)
    return x, t


def event_ms(fn):
    """One call of fn, timed by CUDA events on the current stream (synchronized)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def timed(fn, reps):
    fn()  # the warm-up
    torch.cuda.synchronize()
    return statistics.median(event_ms(fn) for _ in range(reps))


class _FloorGemms(torch.autograd.Function):
    """The floor as a loss function: forward the logits GEMM x W^T, backward the two gradient GEMMs dz W and dz^T x
    on a fixed random dz; the loss is one logit (a view: no reduction over the logits)."""

    @staticmethod
    def forward(ctx, x, w, dz):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, w, dz)
        return torch.mm(x2, w.t())[0, 0]

    @staticmethod
    def backward(ctx, _grad):
        x2, w, dz = ctx.saved_tensors
        return torch.mm(dz, w).reshape(-1, T, H), torch.mm(dz.t(), x2), None


def loss_fn(name):
    """-> f(x, w, t) returning the loss (a graph when x, w require grad). "floor": the three GEMMs of gemm_floor as
    a loss (_FloorGemms), for --paired floor:ours, the ratio to the floor timed in turns."""
    if name == "floor":
        dz = {}

        def floor(x, w, t):
            key = (x.shape[0] * x.shape[1], x.dtype)
            if key not in dz:  # one random dz per shape, made outside the timed calls' steady state
                dz.clear()
                dz[key] = torch.randn(key[0], V, device="cuda").to(x.dtype)
            return _FloorGemms.apply(x, w, dz[key])

        return floor
    if name in ("ours", "ours_third", "ours_novalidate"):
        from simpo_verify.torch import FusedLinearSimPOLoss

        m = FusedLinearSimPOLoss(validate=name != "ours_novalidate")  # novalidate: the NaN/Inf scan's cost
        if name == "ours_third":  # backward with grad_output 1/3 (gradient accumulation over 3 micro-batches)
            return lambda x, w, t: m(w, x, t)[0] / 3
        return lambda x, w, t: m(w, x, t)[0]
    if name == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearSimPOLoss

        m = LigerFusedLinearSimPOLoss()
        return lambda x, w, t: m(w, x, t)[0]
    if name in ("torch_eager", "cce", "cce_exact"):

        def f(x, w, t):  # the peers' own graph, without the harness's cloning and backward
            if name == "torch_eager":
                P = x.shape[0] // 2
                all_logits = (x @ w.t()).float()
                nll = torch.nn.functional.cross_entropy(all_logits[:P].reshape(-1, V), t[:P].reshape(-1))
                mask = t != -100
                per_token = torch.gather(all_logits.log_softmax(-1), 2, torch.where(mask, t, 0).unsqueeze(2)).squeeze(2)
                logps = (per_token * mask).sum(-1) / mask.sum(-1)
                return nll + _simpo_terms(logps[:P], logps[P:], 0.1, 0.5, 0.0)
            return cce_simpo(x, w, t, filter_eps="default" if name == "cce" else None)

        return f
    raise ValueError(name)


def cce_simpo(x, w, t, reduction="none", filter_eps="default"):
    """CCE's SimPO loss as bench_peers times it; reduction="mean" is CCE's plain cross-entropy (no SimPO term)."""
    from cut_cross_entropy import linear_cross_entropy

    kw = {} if filter_eps == "default" else {"filter_eps": filter_eps}
    if reduction == "mean":
        return linear_cross_entropy(x, w, t, reduction="mean", **kw)
    P = x.shape[0] // 2
    tl = linear_cross_entropy(x, w, t, reduction="none", **kw).float()
    mask = (t != -100).float()
    logps = -(tl * mask).sum(-1) / mask.sum(-1)
    nll = (tl[:P] * mask[:P]).sum() / mask[:P].sum()
    return nll + _simpo_terms(logps[:P], logps[P:], 0.1, 0.5, 0.0)


def training_step(f, x, w, t):
    """-> (step, xg, wg): step() runs forward + backward of f with every gradient on the leaves xg and wg (x and w
    detached, requiring grad), dropping the last step's gradients first."""
    xg = x.detach().requires_grad_(True)
    wg = w.detach().requires_grad_(True)

    def step():
        xg.grad, wg.grad = None, None
        f(xg, wg, t).backward()

    return step, xg, wg


def full_step_ms(f, x, w, t, reps):
    """forward + backward of f, gradients allocated in the steady state, one untimed step first."""
    step, _, _ = training_step(f, x, w, t)
    step()
    torch.cuda.synchronize()
    return timed(step, reps)


def paired(fa, fb, reps):
    """fa and fb (no arguments) timed in turns: one warm-up each, then `reps` rounds of one call of each, the
    order alternating per round. -> {"a_ms", "b_ms": medians, "ratio": median of b / a per round, "ratio_min",
    "ratio_max"}."""
    fa(), fb()
    torch.cuda.synchronize()
    ta, tb = [], []
    for i in range(reps):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            (ta if which == 0 else tb).append(event_ms(fa if which == 0 else fb))
    ratios = [b / a for a, b in zip(ta, tb)]
    return {"a_ms": statistics.median(ta), "b_ms": statistics.median(tb), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios)}


def measure_paired(fa, fb, x, w, t, reps):
    """paired() of two loss functions: the forward under no_grad and the full step (measure()'s fwd and full)."""
    with torch.no_grad():
        fwd = paired(lambda: fa(x, w, t), lambda: fb(x, w, t), reps)
    full = paired(training_step(fa, x, w, t)[0], training_step(fb, x, w, t)[0], reps)
    return {"fwd": fwd, "full": full}


def parse_pairs(spec):
    """'ours:ours_third,ours:ours_novalidate' -> [('ours', 'ours_third'), ...]; ValueError naming a bad item."""
    pairs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        a, sep, b = item.partition(":")
        if not sep or not a or not b:
            raise ValueError(f"--paired {item!r}: expected A:B, two impl names")
        pairs.append((a, b))
    return pairs


def cce_probe(x, w, t, reps):
    """Why CCE's full step is slower here than in ANCHORS.md: the same step timed twice in a row (autotune or a
    first-call cost would show as a difference), with reduction="mean" (CCE's own loss), with logits ten times
    smaller (CCE skips gradient blocks whose |softmax - onehot| is below filter_eps everywhere, so its backward
    depends on the values), and with filter_eps=None (no skipping)."""
    import cut_cross_entropy.tl_autotune as cta

    probe = {"autotune_enabled": bool(getattr(cta, "_AUTOTUNE", False)), "B": x.shape[0],
             "logit_std": float((x[0, :64].float() @ w.float().t()).std())}
    probe["full_ms"] = full_step_ms(cce_simpo, x, w, t, reps)
    probe["full_ms_again"] = full_step_ms(cce_simpo, x, w, t, reps)
    probe["full_mean_reduction_ms"] = full_step_ms(lambda a, b, c: cce_simpo(a, b, c, "mean"), x, w, t, reps)
    w_small = (w.float() * 0.1).to(torch.bfloat16)
    probe["full_logits_x0.1_ms"] = full_step_ms(cce_simpo, x, w_small, t, reps)
    probe["full_no_filter_ms"] = full_step_ms(lambda a, b, c: cce_simpo(a, b, c, filter_eps=None), x, w, t, reps)
    with torch.no_grad():
        probe["fwd_ms"] = timed(lambda: cce_simpo(x, w, t), reps)
    return probe


def gemm_floor(x, w, reps):
    N = x.shape[0] * x.shape[1]
    x2 = x.reshape(N, H)
    dz = torch.randn(N, V, device="cuda").to(x.dtype)  # the floor's three GEMMs in the inputs' dtype
    fwd = timed(lambda: torch.mm(x2, w.t()), reps)
    full = fwd + timed(lambda: torch.mm(dz, w), reps) + timed(lambda: torch.mm(dz.t(), x2), reps)
    del dz
    return fwd, full


def measure(f, x, w, t, reps, ours=False):
    """-> {"fwd_ms", "full_ms", "fwd_extra_mib", "full_extra_mib"} of f(x, w, t) (the module docstring's fwd, full
    and extra memory). One untimed call first (compile / autotune outside the timings). ours: f is simpo_verify's,
    whose kernel holds device memory outside torch's allocator (simpo_verify._device.last_info), added to the extra."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with torch.no_grad():
        f(x, w, t)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        fwd = timed(lambda: f(x, w, t), reps)
    fwd_extra = torch.cuda.max_memory_allocated() - base
    if ours:
        from simpo_verify import _device

        outside_fwd = _device.last_info["workspace_bytes"]
    else:
        outside_fwd = 0
    step, xg, wg = training_step(f, x, w, t)
    xg.grad = torch.zeros_like(xg)  # the steady state holds the gradients
    wg.grad = torch.zeros_like(wg)
    step()
    xg.grad, wg.grad = torch.zeros_like(xg), torch.zeros_like(wg)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    full = timed(step, reps)
    # step() frees the old gradients before making new ones: its peak minus the steady state is extra
    full_extra = torch.cuda.max_memory_allocated() - base
    outside_full = (_device.last_info["workspace_bytes"] + _device.last_info["extra_device_bytes"]) if ours else 0
    return {"fwd_ms": fwd, "full_ms": full, "fwd_extra_mib": (fwd_extra + outside_fwd) / 2**20,
            "full_extra_mib": (full_extra + outside_full) / 2**20}


def main():
    a = argparse.ArgumentParser()
    a.add_argument("out")
    a.add_argument("--batches", default="2,4,8,16")
    a.add_argument("--reps", type=int, default=5)
    a.add_argument("--impls", default="ours,torch_eager,liger,cce")
    a.add_argument("--budget", type=float, default=0, help="stop starting new rows after this many seconds")
    a.add_argument("--cce-probe", action="store_true", help="first: cce_probe() at B = 2 (result's cce_probe)")
    a.add_argument("--paired", default="", help="A:B,...: impls timed in turns per B (module docstring)")
    a.add_argument("--dtype", choices=["bf16", "f16", "f32"], default="bf16",
                   help="x's and weight's dtype (f32: torch's fp32 GEMMs, TF32 off as torch's default)")
    args = a.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    impls = [i for i in args.impls.split(",") if i]
    try:
        pairs = parse_pairs(args.paired)
    except ValueError as e:
        a.error(str(e))
    t_start = time.time()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = workload_weight(g, dtype)
    result = {
        "schema": "simpo-verify peers benchmark v1 (python/README.md)",
        "workload": {"T": T, "H": H, "V": V, "dtype": args.dtype, "bias": False, "ignore": "none",
                     "hyperparameters": HP},
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": "python3 python/tools/bench_peers.py " + " ".join(sys.argv[1:]),
        "reps": args.reps, "units": {"time": "ms (median)", "memory": "MiB"},
        "rows": [],
        "peers": {},
        "floor": {"B": [], "fwd_ms": [], "full_ms": []},
    }
    if args.cce_probe:
        gp = torch.Generator(device="cuda").manual_seed(1)  # its own inputs: the rows' stream stays as it was
        x, t = workload_rows(gp, 2)
        try:
            result["cce_probe"] = cce_probe(x, w, t, args.reps)
        except Exception as e:
            result["cce_probe"] = {"error": f"{type(e).__name__}: {e}"}
        print(f"cce probe: {result['cce_probe']}", flush=True)
        del x, t
        torch.cuda.empty_cache()
    for B in [int(b) for b in args.batches.split(",")]:
        if args.budget and time.time() - t_start > args.budget:
            break
        x, t = workload_rows(g, B, dtype)
        floor_fwd, floor_full = gemm_floor(x, w, args.reps)
        row = {"B": B, "floor_fwd_ms": floor_fwd, "floor_full_ms": floor_full, "impls": {}}
        for name in impls:
            try:
                row["impls"][name] = measure(loss_fn(name), x, w, t, args.reps, ours=name.startswith("ours"))
            except Exception as e:
                row["impls"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"B={B} {name}: {row['impls'][name]}", flush=True)
            torch.cuda.empty_cache()
        for fa_name, fb_name in pairs:
            key = f"{fa_name}:{fb_name}"
            try:
                r = measure_paired(loss_fn(fa_name), loss_fn(fb_name), x, w, t, args.reps)
                row.setdefault("paired", {})[key] = r
                print(f"B={B} paired {key} " + " | ".join(
                    f"{k} {v['a_ms']:.3f} / {v['b_ms']:.3f} ms, ratio {v['ratio']:.4f} "
                    f"[{v['ratio_min']:.4f}, {v['ratio_max']:.4f}]" for k, v in r.items()), flush=True)
            except Exception as e:
                row.setdefault("paired", {})[key] = {"error": f"{type(e).__name__}: {e}"}
                print(f"B={B} paired {key}: {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()
        print(f"B={B} floor fwd {floor_fwd:.2f} full {floor_full:.2f} ms", flush=True)
        result["rows"].append(row)
        # The columns fused/cuda/bench/speed_table.py --peers reads: {"peers": {name: {"B": [..], "fwd_ms": [..],
        # "full_ms": [..]}}}, plus the extra memory and the same process's GEMM floor.
        for name, r in row["impls"].items():
            if "error" in r:
                continue
            col = result["peers"].setdefault(name, {"B": [], "fwd_ms": [], "full_ms": [], "fwd_extra_mib": [],
                                                    "full_extra_mib": []})
            col["B"].append(B)
            for k in ("fwd_ms", "full_ms", "fwd_extra_mib", "full_extra_mib"):
                col[k].append(r[k])
        for k, v in (("B", B), ("fwd_ms", floor_fwd), ("full_ms", floor_full)):
            result["floor"][k].append(v)
        del x, t
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    result["wall_s"] = time.time() - t_start
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
