"""The published workload as one case for every peer: T=1024, H=4096, V=128256, B=2, the project's generator
(`simpo-verify case --B 2 --T 1024 --H 4096 --V 128256 --seed 0`), the float64 reference computed once (on the GPU
where reference-cuda is built: `Judge` asks for SPEC's --reference auto) and the error model's scales once (from
the reference's own softmax pass), each peer judged under strict and peer. Writes OUT/published.json after every peer; the log has
the time of each step.

    python3 published_case.py OUT_DIR [PEER,PEER,...]"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import simpo_verify as sv  # noqa: E402
from simpo_verify import _core  # noqa: E402
from peers import PEERS  # noqa: E402


def main():
    out_dir = sys.argv[1]
    peers = sys.argv[2].split(",") if len(sys.argv) > 2 else list(PEERS)
    t0 = time.time()
    problem = _core.generate(2, 1024, 4096, 128256, 0, False, 2.0, "prompt_prefix")
    tensors, meta = problem.tensors()
    inputs = {k: sv.from_wire(w) for k, w in tensors.items()}
    hp = sv.hyperparameters_of(meta)
    t1 = time.time()
    # the reference (reference-cuda where the wheel has it and a device is present) and the error model's scales,
    # which take each row's softmax norms from the reference's dz pass (O(N))
    judge = sv.Judge(dict(inputs, **{k: v for k, v in hp.items()}))
    result = {"case": "B=2 T=1024 H=4096 V=128256 seed=0 ignore=prompt_prefix scale=2 (simpo-verify case defaults)",
              "generate_s": t1 - t0, "reference_and_scales_s": time.time() - t1, "peers": {}}
    print(f"generate {result['generate_s']:.1f} s, reference and scales {result['reference_and_scales_s']:.1f} s",
          flush=True)
    dev = {k: (torch.from_numpy(v.view("int16")).view(torch.bfloat16) if str(v.dtype) == "bfloat16"
               else torch.from_numpy(v)).cuda() for k, v in inputs.items()}
    for name in peers:
        t1 = time.time()
        try:
            out = PEERS[name](dev["x"], dev["weight"], dev["target"], dev.get("bias"), gradients=True, **hp)
            torch.cuda.synchronize()
            reports = {p: judge.check(out, p) for p in ("strict", "bf16_logits", "peer")}
            del out
            result["peers"][name] = {p: {"passed": r.passed, "failed": r.failed(),
                                         "rows": [{k: row[k] for k in ("name", "verdict", "rel_frob", "ratio",
                                                                       "max_abs", "margin", "reason")}
                                                  for row in r.rows]} for p, r in reports.items()}
            print(f"{name}: strict {'passed' if reports['strict'].passed else 'FAILED ' + str(reports['strict'].failed())}"
                  f", bf16_logits {'passed' if reports['bf16_logits'].passed else 'FAILED ' + str(reports['bf16_logits'].failed())}"
                  f", peer {'passed' if reports['peer'].passed else 'FAILED ' + str(reports['peer'].failed())}"
                  f" ({time.time() - t1:.1f} s)\n{reports['strict']}", flush=True)
        except Exception as e:  # a peer that breaks is a result, not the end of the run
            result["peers"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: ERROR {e}", flush=True)
        torch.cuda.empty_cache()
        with open(os.path.join(out_dir, "published.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
