"""One peer's sweep on the device:

    python3 sweep_peer.py PEER OUT_DIR [--cases 300] [--budget S] [--seed N] [--fixed] [--shrink-seconds S]

Writes OUT_DIR/sweep-PEER[-fixed].json (SweepReport.to_dict(), plus wall time and, for liger, its compile counts)
and the shrunk counterexamples' inputs files under OUT_DIR/ce/; prints the sweep table.

--fixed: the cases' shapes are the three of FIXED_SHAPES and their hyperparameters one of two fixed sets per shape
(sweep's shapes= and hyperparameter_sets=, the C++ case distribution's CaseDistribution), so a peer that compiles
per shape or per hyperparameter value (Liger: torch.compile; CCE: Triton) pays each compile once; values, bias,
ignore pattern and logit scale are drawn for every case as always. The same seed gives every peer the same stream.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import simpo_verify as sv  # noqa: E402
import peers  # noqa: E402

# Awkward on purpose: a prime vocabulary with aligned H; odd H and T (unaligned rows for Triton's masks); three pairs
# and a vocabulary of 3 (every softmax wide). Each is a few ms for the float64 reference.
FIXED_SHAPES = [(2, 16, 64, 1021), (4, 13, 37, 509), (6, 9, 96, 3)]
HYPERPARAMETER_SETS = 2


def main():
    a = argparse.ArgumentParser()
    a.add_argument("peer", choices=sorted(peers.PEERS))
    a.add_argument("out")
    a.add_argument("--cases", type=int, default=300)
    a.add_argument("--budget", type=float, default=0.0, help="seconds of cases; 0: no limit")
    a.add_argument("--seed", type=int, default=20260101)
    a.add_argument("--fixed", action="store_true", help="FIXED_SHAPES and HYPERPARAMETER_SETS")
    a.add_argument("--shrink-seconds", type=float, default=10.0)
    args = a.parse_args()
    tag = args.peer + ("-fixed" if args.fixed else "")
    if args.peer == "liger":  # each recompile and the guard that failed, in the log
        import torch._logging

        torch._logging.set_logs(recompiles=True)
    os.makedirs(os.path.join(args.out, "ce"), exist_ok=True)
    start = time.time()
    r = sv.sweep(peers.PEERS[args.peer], cases=args.cases, seed=args.seed, also_judge=("bf16_logits", "peer"), arrays="torch",
                 device="cuda", time_budget_s=args.budget, counterexample_dir=os.path.join(args.out, "ce"),
                 name=f"exec:python3 -m simpo_verify.serve peers:{args.peer} --torch", shrink_attempts=60,
                 shrink_seconds=args.shrink_seconds, shapes=FIXED_SHAPES if args.fixed else (),
                 hyperparameter_sets=HYPERPARAMETER_SETS if args.fixed else 0)
    d = r.to_dict()
    d["wall_s"] = time.time() - start
    d["distribution"] = ({"shapes": FIXED_SHAPES, "hyperparameter_sets": HYPERPARAMETER_SETS} if args.fixed
                         else "the sweep's own")
    if args.peer == "liger":
        d["liger_compiles"] = dict(peers.LIGER_STATS)
        print(f"liger compiles: {peers.LIGER_STATS}")
    with open(os.path.join(args.out, f"sweep-{tag}.json"), "w") as f:
        json.dump(d, f, indent=1)
    print(r)
    print(f"wall {d['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
