#!/usr/bin/env python3
"""SimPO training of a small Llama model three ways in one process: TRL's loss (eager torch), Liger-Kernel's
LigerFusedLinearSimPOLoss and simpo_verify.torch.FusedLinearSimPOLoss.

The model is built offline from a transformers LlamaConfig (random init, nothing downloaded) and trained on
synthetic preference pairs: a random prompt, a chosen completion that counts up from the prompt's last token
(token + 1 mod V, a rule the model can learn) and a rejected completion of random tokens. Each way trains its own
copy of one seeded initial state on the same batches with AdamW. Three trainings drift apart by rounding, so the
agreement claim rests on the same-state check: at every step, on the `ours` copy's state before its update, all
three losses (and gradients, at grad_scale 1/accumulation) are computed eagerly on the step's first micro-batch;
at step 0, every --judge-every steps and the last, the project's verifier (simpo_verify.Judge, float64 reference)
judges each way's outputs and gives the error model's bound on the loss, against which the differences are held.

    python3 python/examples/train_simpo.py --dtype bf16 --steps 50 --out results/
    python3 python/examples/train_simpo.py --device cpu --steps 3 --layers 1 --hidden 128 --vocab 512 --seq 64

Writes DIR/train_simpo_<tag>.json (per-step losses, step times, peak memory, same-state differences and
verdicts) and DIR/train_simpo_<tag>.png (loss curves; same-state differences to ours).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import types

import torch  # before simpo_verify: torch's CUDA libraries are the ones the extension then finds
import torch.nn.functional as F

WAYS = ("trl", "liger", "ours")
AUX = ("chosen_logps", "rejected_logps", "chosen_logits_mean", "rejected_logits_mean", "nll_loss", "chosen_rewards",
       "rejected_rewards")
IGNORE = -100


# ---------------------------------------------------------------------------------------------------------------
# TRL's SimPO, as CPOTrainer(loss_type="simpo") computes it. Reimplemented from huggingface/trl,
# trl/experimental/cpo/cpo_trainer.py (CPOTrainer.cpo_loss, get_batch_logps, concatenated_forward,
# get_batch_loss_metrics) and trl/trainer/utils.py (selective_log_softmax); TRL itself is not a dependency.
# ---------------------------------------------------------------------------------------------------------------

def selective_log_softmax(logits, index):
    """trl.trainer.utils.selective_log_softmax: log_softmax then gather, row by row for memory."""
    index = index.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index)
        logsumexp = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        per_token = selected - logsumexp.unsqueeze(-1)
    else:  # TRL: logsumexp is unstable in bf16, so a per-row log_softmax (in the logits' dtype)
        per_token = torch.stack([F.log_softmax(lg, dim=-1).gather(dim=-1, index=ix) for lg, ix in zip(logits, index)])
    return per_token.squeeze(-1)


def get_batch_logps(logits, labels, average_log_prob):
    """CPOTrainer.get_batch_logps for a decoder-only model: shift, mask -100, average (SimPO) or sum."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != IGNORE
    labels[labels == IGNORE] = 0
    per_token = selective_log_softmax(logits, labels)
    if average_log_prob:
        return (per_token * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token * loss_mask).sum(-1)


def trl_simpo(hidden, weight, labels, bias, hp, logsoftmax_fp32):
    """(loss, aux) of CPOTrainer.get_batch_loss_metrics with loss_type="simpo", label_smoothing hp, cpo_alpha
    hp["alpha"] (its AlphaPO `alpha` 0). hidden [2P, L, H] unshifted, labels [2P, L] (-100 on prompt and padding).
    logsoftmax_fp32: the log-softmax and cross-entropy of the bf16 logits in float32, as under autocast (both are
    on its float32 list) and as the verifier's bf16_logits profile models; False runs them in the logits' dtype,
    TRL's code on a pure-bf16 model without autocast."""
    beta, gamma, ls, cpo_alpha = hp["beta"], hp["gamma"], hp["label_smoothing"], hp["alpha"]
    all_logits = F.linear(hidden, weight, bias)  # LlamaForCausalLM: logits = lm_head(hidden_states)
    if logsoftmax_fp32:
        all_logits = all_logits.float()
    P = labels.shape[0] // 2
    if cpo_alpha == 0:
        nll_loss = torch.zeros((), device=hidden.device)
    else:  # concatenated_forward's cross_entropy_loss on the chosen half
        nll_loss = F.cross_entropy(all_logits[:P, :-1, :].reshape(-1, all_logits.shape[-1]),
                                   labels[:P, 1:].reshape(-1), ignore_index=IGNORE)
    all_logps = get_batch_logps(all_logits, labels, average_log_prob=True)
    chosen, rejected = all_logps[:P], all_logps[P:]
    logits = (chosen - rejected) - gamma / beta  # cpo_loss, loss_type "simpo"
    losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    loss = losses.mean() + cpo_alpha * nll_loss
    # SPEC's logits means are over the shifted positions (what the fused ways see); TRL's logged ones also
    # include the last position, so these are computed for the comparison, not TRL's metrics.
    shifted = all_logits[:, :-1, :].detach().float()
    aux = (chosen, rejected, shifted[:P].mean(), shifted[P:].mean(), nll_loss, beta * chosen.detach(),
           beta * rejected.detach())
    return loss, aux


# ---------------------------------------------------------------------------------------------------------------
# The three ways as one signature: (hidden [2P, L, H] unshifted, lm_head, labels [2P, L]) -> (loss, aux).
# Liger's and our module take the hidden states of the positions that predict a token, and their targets:
# hidden[:, :-1] and labels[:, 1:] (Liger's chunk_forward applies no shift; TRL's get_batch_logps does).
# ---------------------------------------------------------------------------------------------------------------

def make_ways(names, hp, device, logsoftmax_fp32, ours_validate=True):
    ways = {}
    fused_kw = dict(ignore_index=IGNORE, beta=hp["beta"], alpha=hp["alpha"], label_smoothing=hp["label_smoothing"],
                    compute_nll_loss=hp["compute_nll_loss"], gamma=hp["gamma"])
    if "trl" in names:
        ways["trl"] = lambda h, head, y: trl_simpo(h, head.weight, y, head.bias, hp, logsoftmax_fp32)
    if "liger" in names:
        from liger_kernel.chunked_loss import LigerFusedLinearSimPOLoss

        # Liger compiles its chunk function with torch.compile by default; on the CPU that needs a C++ toolchain
        # and minutes per shape, so the CPU smoke run uses its eager chunks (same arithmetic).
        liger = LigerFusedLinearSimPOLoss(compiled=device.type == "cuda", **fused_kw)
        ways["liger"] = lambda h, head, y: liger(head.weight, h[:, :-1], y[:, 1:], head.bias)
    if "ours" in names:
        from simpo_verify.torch import FusedLinearSimPOLoss

        # validate=False: no host synchronization on CUDA (the asynchronous call; fused/cuda/README.md)
        ours = FusedLinearSimPOLoss(validate=ours_validate, **fused_kw)
        ways["ours"] = lambda h, head, y: ours(head.weight, h[:, :-1], y[:, 1:], head.bias)
    return ways


# ---------------------------------------------------------------------------------------------------------------
# Synthetic preference pairs, SimPO's layout: [2P, T], chosen rows first, then the rejected rows of the same
# prompts; right padding; labels = input ids with -100 on prompt and padding (TRL's concatenated_labels).
# ---------------------------------------------------------------------------------------------------------------

def make_batch(seed, step, micro, pairs, seq, vocab, device):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro)
    ids = torch.zeros(2 * pairs, seq, dtype=torch.long)
    mask = torch.zeros(2 * pairs, seq, dtype=torch.long)
    labels = torch.full((2 * pairs, seq), IGNORE, dtype=torch.long)
    for p in range(pairs):
        lp = int(torch.randint(max(1, seq // 8), max(2, seq // 4) + 1, (1,), generator=g))
        prompt = torch.randint(0, vocab, (lp,), generator=g)
        for row, chosen in ((p, True), (pairs + p, False)):
            lc = int(torch.randint(max(1, (seq - lp) // 2), seq - lp + 1, (1,), generator=g))
            if chosen:  # counts up from the prompt's last token: learnable, so the loss can go down
                completion = (prompt[-1] + 1 + torch.arange(lc)) % vocab
            else:
                completion = torch.randint(0, vocab, (lc,), generator=g)
            n = lp + lc
            ids[row, :lp], ids[row, lp:n] = prompt, completion
            mask[row, :n] = 1
            labels[row, lp:n] = completion
    return ids.to(device), mask.to(device), labels.to(device)


def hidden_states(model, ids, mask):
    return model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state


# ---------------------------------------------------------------------------------------------------------------
# The same-state check: one model state, one batch, three ways; the verifier's verdicts at judged steps.
# ---------------------------------------------------------------------------------------------------------------

def same_state(model, ways, batch, hp, grad_scale, judge, profiles):
    ids, mask, labels = batch
    with torch.no_grad():
        hidden = hidden_states(model, ids, mask)
    x = hidden[:, :-1].detach().contiguous()
    last = hidden[:, -1:].detach()
    w = model.lm_head.weight.detach()
    target = labels[:, 1:].contiguous()
    losses, candidates = {}, {}
    for name, fn in ways.items():
        xl = x.clone().requires_grad_(True)
        wl = w.clone().requires_grad_(True)
        head = types.SimpleNamespace(weight=wl, bias=None)  # the LM head as the ways read it (Llama's has no bias)
        loss, aux = fn(torch.cat([xl, last], dim=1), head, labels)
        (loss * grad_scale).backward()  # gradient accumulation's loss / n: SPEC's grad_scale
        losses[name] = float(loss.detach())
        candidates[name] = dict(zip(AUX, (a.detach().float() for a in aux)), loss=loss.detach().float(),
                                grad_x=xl.grad, grad_weight=wl.grad)
    verdicts = None
    if judge:
        import simpo_verify as sv

        inputs = {"x": x.cpu(), "weight": w.cpu(), "target": target.cpu(), "beta": hp["beta"], "gamma": hp["gamma"],
                  "alpha": hp["alpha"], "label_smoothing": hp["label_smoothing"],
                  "compute_nll_loss": hp["compute_nll_loss"], "grad_scale": grad_scale}
        j = sv.Judge(inputs)
        exact_loss = float(j.exact["loss"])
        verdicts = {"reference_loss": exact_loss}
        for name, cand in candidates.items():
            cand = {k: v.cpu() for k, v in cand.items()}
            per = {}
            for prof in profiles[name]:
                r = j.check(cand, prof)
                row = r.row("loss")
                per[prof] = {"passed": r.passed, "failed": r.failed(), "worst_margin": r.worst_margin,
                             "loss_allowed": row["atol"] + row["rtol"] * abs(exact_loss),
                             "loss_error": abs(losses[name] - exact_loss)}
            verdicts[name] = per
    return losses, verdicts


def judge_profiles(dtype_name, ways):
    """Which of the verifier's profiles each way is held to: ours to strict; TRL and Liger round the logits to
    the inputs' dtype before the softmax, the bf16_logits profile's model (in float32 that rounding is the
    fp32 GEMM's own, so strict)."""
    other = ["strict"] if dtype_name == "f32" else ["bf16_logits", "strict"]
    return {w: ["strict"] if w == "ours" else other for w in ways}


# ---------------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16", help="model, hidden states and LM head dtype")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per step, each backward of loss / n")
    p.add_argument("--compile", action="store_true", help="torch.compile each way's model forward + loss")
    p.add_argument("--ways", default="trl,liger,ours", help="comma-separated subset of trl, liger, ours")
    p.add_argument("--ours-validate", choices=("on", "off"), default="on",
                   help="ours with SPEC's input checks (on, the default: one host synchronization per call on CUDA) "
                        "or without (off: validate=False, the asynchronous call)")
    p.add_argument("--out", default=None, help="folder for the JSON and the PNG (none: print only)")
    p.add_argument("--tag", default=None, help="file name tag (default: dtype, accumulation, compile)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 11/4 of hidden, rounded to 64)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--pairs", type=int, default=2, help="preference pairs per micro-batch (2P rows)")
    p.add_argument("--seq", type=int, default=256, help="sequence length T of every row")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--beta", type=float, default=2.0)
    p.add_argument("--gamma", type=float, default=0.5)
    p.add_argument("--cpo-alpha", type=float, default=1.0,
                   help="NLL weight: TRL's cpo_alpha, Liger's and ours' alpha (0: compute_nll_loss False)")
    p.add_argument("--judge-every", type=int, default=10,
                   help="verifier judgement at step 0, every N and the last (0: off)")
    p.add_argument("--trl-logsoftmax", choices=("fp32", "model"), default="fp32",
                   help="TRL's log-softmax in float32 (as under autocast) or in the logits' dtype")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.ways = [w.strip() for w in a.ways.split(",") if w.strip()]
    bad = [w for w in a.ways if w not in WAYS]
    if bad or not a.ways:
        p.error(f"--ways: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(WAYS)}")
    if len(set(a.ways)) != len(a.ways):
        p.error("--ways: a way is named twice")
    for name in ("steps", "accumulation", "layers", "hidden", "heads", "vocab", "pairs"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1")
    if a.seq < 8:
        p.error("--seq must be at least 8 (a prompt and a completion)")
    if a.hidden % a.heads:
        p.error(f"--hidden {a.hidden} is not a multiple of --heads {a.heads}")
    if a.judge_every < 0:
        p.error("--judge-every must be 0 or more")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if a.intermediate is None:
        a.intermediate = max(64, round(a.hidden * 11 / 4 / 64) * 64)
    return a


def build_model(a, dtype, device):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        sys.exit(f"train_simpo.py builds its model from transformers' LlamaConfig: {e} (pip install transformers)")

    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
                         max_position_embeddings=max(a.seq, 128), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(a.seed)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def compile_step(make_step, name, status):
    """torch.compile of the way's model forward + loss with fullgraph=True; where that cannot trace, the same with
    graph breaks allowed; where dynamo cannot run the loss at all, the model forward compiled and the loss eager
    (torch.compiler.disable). status[name] records which, with the first failure's reason."""
    tiers = [("fullgraph", lambda: torch.compile(make_step(False), fullgraph=True)),
             ("graph breaks", lambda: torch.compile(make_step(False))),
             ("model compiled, loss eager", lambda: torch.compile(make_step(True)))]
    state = {"tier": 0, "fn": tiers[0][1](), "why": ""}
    status[name] = tiers[0][0]

    def call(*args):
        while True:
            try:
                return state["fn"](*args)
            except Exception as e:  # noqa: BLE001 - dynamo's Unsupported and its wrappers vary by version
                if state["tier"] + 1 >= len(tiers):
                    raise
                if not state["why"]:
                    state["why"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                state["tier"] += 1
                label = tiers[state["tier"]][0]
                print(f"  {name}: {tiers[state['tier'] - 1][0]} failed ({type(e).__name__}); trying {label}",
                      flush=True)
                status[name] = f"{label} (fullgraph: {state['why']})"
                torch._dynamo.reset()
                state["fn"] = tiers[state["tier"]][1]()

    return call


def main(argv=None):
    a = parse_args(argv)
    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
    # fp32 means fp32: TF32 would round the GEMM inputs to 10 mantissa bits, outside the f32 error model.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hp = {"beta": a.beta, "gamma": a.gamma, "alpha": a.cpo_alpha, "label_smoothing": 0.0,
          "compute_nll_loss": a.cpo_alpha != 0}
    tag = a.tag or f"{a.dtype}_acc{a.accumulation}{'_compile' if a.compile else ''}"
    skipped = {}
    if "liger" in a.ways:
        try:
            import liger_kernel.chunked_loss  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure (no triton, no wheel) skips the way
            skipped["liger"] = f"liger_kernel does not import here: {type(e).__name__}: {e}"
            print(f"skipping liger: {skipped['liger']}", flush=True)
    names = [w for w in a.ways if w not in skipped]
    ways = make_ways(names, hp, device, a.trl_logsoftmax == "fp32", a.ours_validate == "on")
    init = build_model(a, dtype, device)
    n_params = sum(p.numel() for p in init.parameters())
    print(f"Llama {a.layers} layers, hidden {a.hidden}, intermediate {a.intermediate}, heads {a.heads}, vocab "
          f"{a.vocab}: {n_params / 1e6:.1f}M parameters, {a.dtype} on {device}; {a.pairs} pairs x T={a.seq} per "
          f"micro-batch, accumulation {a.accumulation}, compile {a.compile}, ways {','.join(names)}", flush=True)
    models = {w: copy.deepcopy(init) for w in names}
    del init
    optims = {w: torch.optim.AdamW(models[w].parameters(), lr=a.lr, weight_decay=0.0) for w in names}

    def step_fn_for(fn, loss_eager=False):
        loss_fn = torch.compiler.disable(fn) if loss_eager else fn

        def step_fn(model, ids, mask, labels):
            return loss_fn(hidden_states(model, ids, mask), model.lm_head, labels)[0]
        return step_fn

    compile_status = {}
    if a.compile:
        steps = {w: compile_step(lambda eager, f=ways[w]: step_fn_for(f, eager), w, compile_status) for w in names}
    else:
        steps = {w: step_fn_for(ways[w]) for w in names}

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rec = {w: {"loss": [], "step_ms": [], "peak_bytes": 0, "step_peak_above_resident_bytes": 0} for w in names}
    same = []
    profiles = judge_profiles(a.dtype, names)
    ref_way = "ours" if "ours" in names else names[0]
    for step in range(a.steps):
        batches = [make_batch(a.seed, step, m, a.pairs, a.seq, a.vocab, device) for m in range(a.accumulation)]
        judged = a.judge_every > 0 and (step % a.judge_every == 0 or step == a.steps - 1)
        t_judge = time.perf_counter()
        losses, verdicts = same_state(models[ref_way], ways, batches[0], hp, 1.0 / a.accumulation, judged, profiles)
        entry = {"step": step, "loss": losses, "diff_to_" + ref_way: {w: losses[w] - losses[ref_way] for w in names}}
        if verdicts:
            entry["judge"] = verdicts
            entry["judge_s"] = time.perf_counter() - t_judge
            parts = []
            for w in names:
                for prof, v in verdicts[w].items():
                    parts.append(f"{w} {prof} {'PASS' if v['passed'] else 'FAIL ' + ','.join(v['failed'])}")
            print(f"step {step}: same state ({entry['judge_s']:.1f} s): " + ", ".join(parts), flush=True)
        same.append(entry)
        for w in names:
            model, opt = models[w], optims[w]
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated()
            sync()
            t0 = time.perf_counter()
            total = 0.0
            for ids, mask, labels in batches:
                loss = steps[w](model, ids, mask, labels)
                (loss / a.accumulation).backward()  # HF Trainer's gradient accumulation
                total += loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            rec[w]["step_ms"].append((time.perf_counter() - t0) * 1e3)
            rec[w]["loss"].append(float(total) / a.accumulation)
            if cuda:
                peak = torch.cuda.max_memory_allocated()
                rec[w]["peak_bytes"] = max(rec[w]["peak_bytes"], peak)
                rec[w]["step_peak_above_resident_bytes"] = max(rec[w]["step_peak_above_resident_bytes"],
                                                               peak - resident)
        print(f"step {step}: train loss " + ", ".join(f"{w} {rec[w]['loss'][-1]:.5f}" for w in names)
              + "; same-state diff to " + ref_way + " "
              + ", ".join(f"{w} {entry['diff_to_' + ref_way][w]:+.2e}" for w in names if w != ref_way), flush=True)

    # The claim: at every judged step each way's loss is within its profile's bound of the float64 reference,
    # so two ways differ by at most the sum of their bounds.
    bound_checks = []
    for e in same:
        if "judge" not in e:
            continue
        allowed = {w: e["judge"][w][profiles[w][0]]["loss_allowed"] for w in names}
        for w in names:
            if w != ref_way:
                d = abs(e["diff_to_" + ref_way][w])
                bound_checks.append({"step": e["step"], "way": w, "diff": d, "allowed": allowed[w] + allowed[ref_way],
                                     "within": d <= allowed[w] + allowed[ref_way]})
    summary = {}
    print(f"\n{'way':<6} {'dtype':<5} {'mean step ms':>12} {'peak MiB':>9} {'step peak MiB':>13} {'final loss':>11}  "
          "compile")
    for w in names:
        times = rec[w]["step_ms"][3:] or rec[w]["step_ms"]
        mean_ms = sum(times) / len(times)
        summary[w] = {"mean_step_ms_after_3": mean_ms, "final_loss": rec[w]["loss"][-1]}
        peak = f"{rec[w]['peak_bytes'] / 2**20:9.0f}" if cuda else f"{'-':>9}"
        step_peak = f"{rec[w]['step_peak_above_resident_bytes'] / 2**20:13.0f}" if cuda else f"{'-':>13}"
        print(f"{w:<6} {a.dtype:<5} {mean_ms:12.2f} {peak} {step_peak} {rec[w]['loss'][-1]:11.5f}  "
              f"{compile_status.get(w, 'eager')}")
    for s, why in skipped.items():
        print(f"{s:<6} skipped: {why}")
    if bound_checks:
        bad = [c for c in bound_checks if not c["within"]]
        worst = max(bound_checks, key=lambda c: c["diff"] / c["allowed"] if c["allowed"] > 0 else math.inf)
        print(f"same-state loss differences to {ref_way} within the verifier's bounds at "
              f"{len(bound_checks) - len(bad)} of {len(bound_checks)} judged (step, way) pairs; largest "
              f"|diff| / allowed {worst['diff'] / worst['allowed']:.3g} ({worst['way']}, step {worst['step']})")

    result = {"config": {k: v for k, v in vars(a).items()}, "parameters": n_params, "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name() if cuda else "cpu", "hyperparameters": hp,
              "profiles": profiles, "compile": compile_status, "skipped": skipped, "train": rec, "summary": summary,
              "same_state": same, "bound_checks": bound_checks}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"train_simpo_{tag}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
        plot(result, names, ref_way, os.path.join(a.out, f"train_simpo_{tag}.png"), tag)
    return result


def plot(result, names, ref_way, path, tag):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    colors = {w: f"C{i}" for i, w in enumerate(names)}
    for w in names:
        top.plot(result["train"][w]["loss"], label=w, lw=1.2, c=colors[w])
    top.set_ylabel("training loss (own trajectory)")
    top.set_title(f"SimPO, three ways: {tag}")
    top.legend()
    steps = [e["step"] for e in result["same_state"]]
    for w in names:
        if w == ref_way:
            continue
        d = [abs(e["diff_to_" + ref_way][w]) for e in result["same_state"]]
        bottom.semilogy(steps, [max(v, 1e-12) for v in d], label=f"|{w} - {ref_way}|, same state", lw=1.0,
                      c=colors[w])
        traj = [abs(x - y) for x, y in zip(result["train"][w]["loss"], result["train"][ref_way]["loss"])]
        bottom.semilogy(range(len(traj)), [max(v, 1e-12) for v in traj], ls=":", lw=0.8, c=colors[w],
                        label=f"|{w} - {ref_way}|, own trajectories")
    checks = result["bound_checks"]
    if checks:
        bottom.scatter([c["step"] for c in checks], [c["allowed"] for c in checks], marker="_", s=120, c="k",
                       label="verifier's bound (sum of the two ways')", zorder=3)
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("loss difference")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
