"""The published workload as one case for every peer: T=1024, H=4096, V=128256, B=2, the project's generator
(`simpo-verify case --B 2 --T 1024 --H 4096 --V 128256 --seed 0`), the float64 reference computed once (on the GPU
where reference-cuda is built: `Judge` asks for SPEC's --reference auto) and the error model's scales once (from
the reference's own softmax pass), each peer judged under strict, bf16_logits and peer. Where the reference runs on
the GPU its gradients stay there and each candidate is compared there, read in place. Writes OUT/published.json
after every peer; the log has the time of each step (generation and upload apart, not counted).

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
    profiles = ("strict", "bf16_logits", "peer")
    t0 = time.time()
    problem = _core.generate(2, 1024, 4096, 128256, 0, False, 2.0, "prompt_prefix")
    tensors, meta = problem.tensors()
    hp = sv.hyperparameters_of(meta)
    # the inputs on the device for the peers, straight from the generator's bytes (bf16 as int16, viewed back)
    dev = {k: (torch.from_numpy(w[2].view("int16")).view(torch.bfloat16) if w[0] == "BF16"
               else torch.from_numpy(w[2])).reshape(w[1]).cuda() for k, w in tensors.items()}
    del tensors
    torch.cuda.synchronize()
    t1 = time.time()
    # the reference (reference-cuda where the wheel has it and a device is present: its gradients then stay on the
    # device and candidates are compared there) and the error model's scales, which take each row's softmax norms
    # from the reference's dz pass (O(N))
    judge = sv.Judge(problem)
    t2 = time.time()
    judge.prepare("bf16_logits")  # that profile's scales: O(N H V), on the device where there is one, once per problem
    t3 = time.time()
    result = {"case": "B=2 T=1024 H=4096 V=128256 seed=0 ignore=prompt_prefix scale=2 (simpo-verify case defaults)",
              "generate_and_upload_s": t1 - t0, "reference_and_scales_s": t2 - t1, "bf16_logits_scales_s": t3 - t2,
              "judged_on_device": judge.on_device, "peers": {}}
    print(f"generate and upload {result['generate_and_upload_s']:.1f} s (not counted), reference and scales "
          f"{result['reference_and_scales_s']:.2f} s, bf16_logits scales {result['bf16_logits_scales_s']:.1f} s, "
          f"judged on the {'device' if judge.on_device else 'host'}", flush=True)
    for name in peers:
        t1 = time.time()
        try:
            out = PEERS[name](dev["x"], dev["weight"], dev["target"], dev.get("bias"), gradients=True, **hp)
            torch.cuda.synchronize()
            t2 = time.time()
            reports, judge_s = {}, {}
            for p in profiles:
                tp = time.time()
                reports[p] = judge.check(out, p)
                judge_s[p] = time.time() - tp
            del out
            result["peers"][name] = {p: {"passed": r.passed, "failed": r.failed(), "judge_s": judge_s[p],
                                         "rows": [{k: row[k] for k in ("name", "verdict", "rel_frob", "ratio",
                                                                       "max_abs", "margin", "reason")}
                                                  for row in r.rows]} for p, r in reports.items()}
            result["peers"][name]["run_s"] = t2 - t1
            verdicts = ", ".join(f"{p} {'passed' if r.passed else 'FAILED ' + str(r.failed())}" for p, r in reports.items())
            print(f"{name}: {verdicts} (run {t2 - t1:.2f} s; judged "
                  + ", ".join(f"{p} {judge_s[p]:.2f} s" for p in profiles) + f")\n{reports['strict']}", flush=True)
        except Exception as e:  # a peer that breaks is a result, not the end of the run
            result["peers"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: ERROR {e}", flush=True)
        torch.cuda.empty_cache()
        with open(os.path.join(out_dir, "published.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
