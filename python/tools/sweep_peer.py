"""One peer's sweep on the device: python3 sweep_peer.py PEER OUT_DIR [--cases 300] [--budget S] [--seed N].

Writes OUT_DIR/sweep-PEER.json (SweepReport.to_dict()) and the shrunk counterexamples' inputs files under
OUT_DIR/ce/; prints the sweep table."""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import simpo_verify as sv  # noqa: E402
from peers import PEERS  # noqa: E402


def main():
    a = argparse.ArgumentParser()
    a.add_argument("peer", choices=sorted(PEERS))
    a.add_argument("out")
    a.add_argument("--cases", type=int, default=300)
    a.add_argument("--budget", type=float, default=0.0, help="seconds; 0: no limit")
    a.add_argument("--seed", type=int, default=20260101)
    args = a.parse_args()
    os.makedirs(os.path.join(args.out, "ce"), exist_ok=True)
    start = time.time()
    r = sv.sweep(PEERS[args.peer], cases=args.cases, seed=args.seed, also_judge=("peer",), arrays="torch",
                 device="cuda", time_budget_s=args.budget, counterexample_dir=os.path.join(args.out, "ce"),
                 name=f"exec:python3 -m simpo_verify.serve peers:{args.peer} --torch", shrink_attempts=60,
                 shrink_seconds=10)
    d = r.to_dict()
    d["wall_s"] = time.time() - start
    with open(os.path.join(args.out, f"sweep-{args.peer}.json"), "w") as f:
        json.dump(d, f, indent=1)
    print(r)


if __name__ == "__main__":
    main()
