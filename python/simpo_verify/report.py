"""The peer report from Python: several implementations (MODULE:FUNCTION callables) swept on the same case stream
(one seed), matches_reference judged under every profile (strict, bf16_logits, peer), each held to its declared
capabilities (FUNCTION.capabilities), with exclusions, the determinism finding, time per case and the first
failure of each property shrunk; markdown and JSON. The CLI's `simpo-verify report` does the same for built-in and
exec: implementations.

    python3 -m simpo_verify.report peers:torch_eager peers:liger peers:cce peers:cce_exact peers:ours \\
        --torch --cases 300 --out peer-report
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .serve import load_callable
from .sweep import sweep

PROFILES = ("strict", "bf16_logits", "peer")


def _exec_name(target: str, arrays: str) -> str:
    """The same callable through the exec: protocol: what replay commands name."""
    return f"exec:python3 -m simpo_verify.serve {target}" + (" --torch" if arrays == "torch" else "")


def peer_report(targets, cases=200, seed=20260101, arrays="numpy", device=None, shapes=(), hyperparameter_sets=0,
                counterexample_dir="", shrink_seconds=30.0, time_budget_s=0.0) -> dict:
    """{"seed", "cases", "implementations": [SweepReport.to_dict() + seconds per case]} for each target."""
    out = {"seed": seed, "cases": cases, "shapes": [list(s) for s in shapes], "hyperparameter_sets": hyperparameter_sets,
           "implementations": []}
    for target in targets:
        fn = load_callable(target) if isinstance(target, str) else target
        t0 = time.time()
        r = sweep(fn, cases=cases, seed=seed, profile="strict", also_judge=PROFILES[1:], arrays=arrays, device=device,
                  counterexample_dir=counterexample_dir, shapes=shapes, hyperparameter_sets=hyperparameter_sets,
                  shrink_seconds=shrink_seconds, time_budget_s=time_budget_s,
                  name=_exec_name(target, arrays) if isinstance(target, str) else None)
        d = r.to_dict()
        d["wall_seconds"] = time.time() - t0
        d["seconds_per_case"] = r.seconds / max(r.cases, 1)
        out["implementations"].append(d)
    return out


def markdown(doc: dict) -> str:
    shapes = f", shapes {doc['shapes']} x {doc['hyperparameter_sets']} hyperparameter sets" if doc.get("shapes") else ""
    lines = [f"## Peer report (seed {doc['seed']}, {doc['cases']} cases{shapes}, the same stream for every implementation)", "",
             "| implementation | declared | excluded | " + " | ".join(f"{p} passed / failed" for p in PROFILES)
             + " | other properties failed | determinism | s per case |",
             "|---" * (6 + len(PROFILES)) + "|"]
    for d in doc["implementations"]:
        prof = [f"{d['profiles'].get(p, {}).get('passed', '-')} / {d['profiles'].get(p, {}).get('failed', '-')}" for p in PROFILES]
        others = ", ".join(f"{k} {v}" for k, v in d["failed_by_property"].items() if v and k != "matches_reference") or "none"
        differing = max((s["cases_differing"] for s in d["spread"].values()), default=0)
        det = ("declared; " if d["declared"].get("deterministic") else "not declared; ") + \
              ("identical reruns" if not differing else f"{differing} cases differ")
        excluded = ", ".join(f"{k} {n}" for k, n in sorted(d["excluded"].items())) or "0"
        lines.append(f"| `{d['implementation']}` | `{json.dumps(d['declared'])}` | {excluded} | " + " | ".join(prof)
                     + f" | {others} | {det} | {d['seconds_per_case']:.3f} |")
    for d in doc["implementations"]:
        lines += ["", f"### `{d['implementation']}`", ""]
        shown = False
        for f in d["failures"]:
            if f["shrunk"] is not None:
                shown = True
                lines.append(f"- first `{f['property']}` failure (case {f['case_index']}), shrunk to "
                             f"`{f['shrunk']['description']}`: {f['detail'][:400]}")
        for p, v in d["profiles"].items():
            s = v.get("smallest_failure")
            if s and p != d["profile"]:  # the sweep's own profile: its shrunk failure is listed above
                shown = True
                lines.append(f"- `{p}`: smallest failing case `{s['description']}`: {s['detail'][:400]}")
        for t, s in sorted(d["spread"].items()):
            if s["cases_differing"]:
                shown = True
                lines.append(f"- run-to-run spread of {t}: {s['cases_differing']} of {s['cases_compared']} cases, "
                             f"max |diff| {s['max_abs']:.2e}, ||diff|| / ||out|| {s['max_rel']:.2e}")
        if not shown:
            lines.append("- no disagreement")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m simpo_verify.report", description=__doc__.split("\n\n")[0])
    p.add_argument("targets", nargs="+", help="MODULE:FUNCTION or FILE.py:FUNCTION, each an implementation")
    p.add_argument("--cases", type=int, default=200, help="cases per implementation (default 200)")
    p.add_argument("--seed", type=int, default=20260101, help="sweep seed: the same stream for every implementation")
    p.add_argument("--torch", action="store_true", help="pass torch tensors (default: numpy arrays)")
    p.add_argument("--device", default=None, help="torch device for --torch")
    p.add_argument("--out", default="simpo-peer-report", help="writes OUT.md and OUT.json")
    p.add_argument("--counterexample-dir", default="", help="where shrunk counterexamples' inputs files go")
    p.add_argument("--shapes", action="append", default=[], metavar="B,T,H,V",
                   help="every case's shape is one of these (repeat it): one compile per shape for torch.compile/Triton peers")
    p.add_argument("--hyperparameter-sets", type=int, default=0, help="> 0: that many fixed hyperparameter draws per shape")
    p.add_argument("--budget", type=float, default=0.0, help="seconds of cases per implementation (0: --cases decides)")
    p.add_argument("--shrink-seconds", type=float, default=30.0, help="per shrunk counterexample")
    a = p.parse_args(argv)
    if a.cases <= 0:
        p.error("--cases must be > 0")
    try:
        shapes = [tuple(int(v) for v in s.split(",")) for s in a.shapes]
    except ValueError:
        p.error(f"--shapes: expected B,T,H,V integers, got {a.shapes}")
    doc = peer_report(a.targets, cases=a.cases, seed=a.seed, arrays="torch" if a.torch else "numpy", device=a.device,
                      counterexample_dir=a.counterexample_dir, shapes=shapes, hyperparameter_sets=a.hyperparameter_sets,
                      shrink_seconds=a.shrink_seconds, time_budget_s=a.budget)
    text = markdown(doc)
    with open(a.out + ".md", "w") as f:
        f.write(text)
    with open(a.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
