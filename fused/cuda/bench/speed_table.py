#!/usr/bin/env python3
"""The speed table of the cuda backend as JSON and a PNG plot of time against B.

    speed_table.py BENCH_LOG [BENCH_LOG...] --json OUT.json [--png OUT.png] [--peers PEERS.json]
                   [--series TEXT [--series TEXT ...]]

BENCH_LOG: cuda_bench output; its "JSON {...}" lines (one per B: floor and fused times, extra memory, the logits
GEMM and full-step form used, where grad_W accumulated) are collected, the first line per (B, form, workspace) kept,
the form being the logits description and the grad_W one together. PEERS.json (optional, measured with
torch, Liger and CCE in the same device call): {"peers": {"name": {"B": [..], "full_ms": [..], "fwd_ms": [..]}}}.
The plot (matplotlib, present on the GPU machine) shows the fused full step and forward, the floors (bf16-output
cuBLAS GEMMs, 3 and 1), the 1.15x / 1.10x bars and the peers' full steps. The fused series plotted: the first
form in the log (gpu_run.sh runs the default first), or each --series (rows whose form contains TEXT,
LABEL=TEXT to name it; the floors are each B's first series' own).
"""
import argparse
import json
import sys
import textwrap


def form(row):
    """What was measured: the logits GEMM and the full step's form, and where grad_W accumulated."""
    return row["logits"] + "; grad_W: " + row.get("grad_w", "")


def read_rows(paths):
    rows, seen = [], set()
    for path in paths:
        with open(path) as f:
            for line in f:
                if not line.startswith("JSON "):
                    continue
                row = json.loads(line[5:])
                key = (row["B"], form(row), row["workspace_mib"])
                if key not in seen:
                    seen.add(key)
                    rows.append(row)
    for row in rows:
        row["fwd_over_floor"] = row["fused_fwd_ms"] / row["floor_fwd_ms"]
        row["full_over_floor"] = row["fused_full_ms"] / row["floor_full_ms"]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--json", required=True)
    ap.add_argument("--png")
    ap.add_argument("--peers")
    ap.add_argument("--series", action="append", default=[])
    args = ap.parse_args()
    rows = read_rows(args.logs)
    if not rows:
        print("speed_table.py: no JSON lines in " + ", ".join(args.logs), file=sys.stderr)
        return 2
    peers = {}
    if args.peers:
        with open(args.peers) as f:
            peers = json.load(f).get("peers", {})
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "peers": peers}, f, indent=1)
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        widest = max(x["workspace_mib"] for x in rows)
        default = sorted((r for r in rows if r["workspace_mib"] == widest), key=lambda r: r["B"])
        # The first run in the log is the default one (gpu_run.sh runs it first).
        first = form(default[0] if default else rows[0])
        pick = lambda text: [r for r in default if (text in form(r) if text else form(r) == first)]
        # --series LABEL=TEXT names the series LABEL in the legend (TEXT alone: the text itself).
        split = [(a.split("=", 1) if "=" in a else [a, a]) for a in args.series] or [[None, None]]
        series = [(label, pick(text)) for label, text in split]
        fig, ax = plt.subplots(figsize=(10, 4.8))
        name = first if series[0][0] is None else "; ".join(label for label, _ in series)
        floors = {}  # per B, the floors measured with the first series that has that B (the same process)
        for _, rs in series:
            for r in rs:
                floors.setdefault(r["B"], r)
        for r in default:
            floors.setdefault(r["B"], r)
        B = sorted(floors)
        ax.plot(B, [floors[b]["floor_full_ms"] for b in B], "k--", label="floor: 3 bf16 cuBLAS GEMMs")
        ax.plot(B, [1.15 * floors[b]["floor_full_ms"] for b in B], "k:", label="bar: 1.15x floor")
        ax.plot(B, [floors[b]["floor_fwd_ms"] for b in B], "--", color="gray", label="floor: 1 GEMM")
        ax.plot(B, [1.10 * floors[b]["floor_fwd_ms"] for b in B], ":", color="gray", label="bar: 1.10x floor (forward)")
        for i, (text, rs) in enumerate(series):
            tag = "" if len(series) == 1 else " [" + (text or first) + "]"
            ax.plot([r["B"] for r in rs], [r["fused_full_ms"] for r in rs], "o-", label="fused full step" + tag)
            ax.plot([r["B"] for r in rs], [r["fused_fwd_ms"] for r in rs], "s-", label="fused forward" + tag)
        for peer, p in peers.items():  # "ours" there is the python module driven by torch (python/README.md)
            ax.plot(p["B"], p["full_ms"], "^-", alpha=0.7, label=peer + " full step (peers JSON)")
        ax.set_xlabel("B (sequences of T=1024; H=4096, V=128256)")
        ax.set_ylabel("ms (median)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(B, [str(b) for b in B])
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title("\n".join(textwrap.wrap(name, 110)), fontsize=7)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
    for r in rows:
        print("B=%-3d %-48s ws %5d MiB | fwd %7.2f / %7.2f = %.3f | full %7.2f / %7.2f = %.3f | extra %.0f MiB" % (
            r["B"], form(r), r["workspace_mib"], r["fused_fwd_ms"], r["floor_fwd_ms"], r["fwd_over_floor"],
            r["fused_full_ms"], r["floor_full_ms"], r["full_over_floor"], r["extra_mib"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
