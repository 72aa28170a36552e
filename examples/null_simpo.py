#!/usr/bin/python3
"""The trivial external implementation behind verifier/README.md's cases-per-second figure: it does no work,
writes an outputs file holding only loss = 0 (every case then fails, which costs the verifier as much as a
pass: the same calls are made), and speaks both exec forms:
    persistent: --impl 'exec:python3 examples/null_simpo.py'
    one-shot:   --impl 'exec:python3 examples/null_simpo.py {inputs} {outputs} {gradients}'"""
import json, struct, sys

def write(path):
    head = json.dumps({"loss": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}).encode()
    open(path, "wb").write(struct.pack("<Q", len(head)) + head + struct.pack("<f", 0.0))

if len(sys.argv) > 1:
    write(sys.argv[2])
else:
    for line in sys.stdin:
        write(json.loads(line)["outputs"])
        print('{"ok": true}', flush=True)
