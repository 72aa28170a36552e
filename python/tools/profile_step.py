"""Where the fused step's time goes, kernel by kernel: our forward + backward (simpo_verify.torch, the cuda backend)
on bench_peers.py's workload (T=1024, H=4096, V=128256, bf16) at one B, under torch.profiler, beside the three
bf16 GEMMs of the floor profiled the same way. Prints, per kernel (CUTLASS and cuBLAS names shortened to what
they compute), its device time per step and its share; the floor's GEMMs likewise.

    python3 profile_step.py [--B 8] [--steps 3] [--data normal|uniform] [--timeline] [--impl ours|ours_novalidate]
                            [--forward]

--timeline adds, for one more step of ours, the device's idle gaps with the host's CUDA runtime calls inside each
(step_timeline.py): where the step waits on the host (synchronizations, Python, validation) rather than on kernels.
--impl ours_novalidate profiles the module with validate=False (the asynchronous call: no host synchronization).
--forward profiles the forward under torch.no_grad (the drop-in's forward bar) against the logits GEMM alone.

Why a profiler and not events around each phase: the fused step is one call that enqueues ~15 kernels per chunk;
the profiler's CUPTI records give each kernel's own device time without changing what runs.
"""

import argparse
import collections
import os
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_peers import H, T, V, loss_fn, timed, training_step, workload_rows, workload_weight  # noqa: E402
from step_timeline import report  # noqa: E402

# Kernel-name patterns -> what the kernel computes (first match wins).
# Kernel-name patterns -> what the kernel computes (first match wins). CUTLASS kernels are told apart by the
# types in their names (our files' anonymous namespaces demangle without the file name).
NAMES = [
    (r"::Residual\b", "weight GEMM into the hi/lo pair (CUTLASS)"),
    (r"RowStats", "logits GEMM with epilogue statistics (CUTLASS)"),
    (r"MainloopSm90TmaGmmaWarpSpecializedFP8|SplitNMainloop", "logits GEMM, promoted (CUTLASS)"),
    (r"\b(?!device_kernel)(\w+_kernel)\b", None),  # ours (kernels.cu) and torch's, by their own name
    (r"gemm|xmma|nvjet|cutlass", "GEMM"),  # cuBLAS's: its kernel name says the tile and layout
]


def short(name):
    for pattern, label in NAMES:
        m = re.search(pattern, name)
        if m:
            return f"GEMM {name[:100]}" if label == "GEMM" else label or m.group(1)
    return name[:60]


def kernel_times(fn, steps):
    """{short kernel name: (device ms per step, launches per step)} of fn() run `steps` times under the profiler."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total = collections.defaultdict(float)
    count = collections.Counter()
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            key = short(e.name)
            total[key] += e.device_time_total / 1000.0  # us -> ms
            count[key] += 1
            spans.append((e.time_range.start, e.time_range.end, key))
    # The device's idle time inside the profiled steps, by the kernels on either side of each gap.
    spans.sort()
    gaps = collections.defaultdict(float)
    for (_, end, before), (start, _, after) in zip(spans, spans[1:]):
        if start > end:
            gaps[(before, after)] += (start - end) / 1000.0
    return {k: (total[k] / steps, count[k] / steps) for k in total}, {k: v / steps for k, v in gaps.items()}


def timeline(fn, min_us):
    """step_timeline.report of one fn() (after one untimed call): device spans and the host's CUDA runtime calls
    (the profiler's CPU events named cu*: cudaLaunchKernel, cudaMemcpyAsync, cudaStreamSynchronize, ...)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    device, host = [], []
    for e in prof.events():
        span = (e.time_range.start, e.time_range.end, short(e.name))
        if e.device_type == torch.autograd.DeviceType.CUDA:
            device.append(span)
        elif e.name.startswith("cu"):
            host.append((e.time_range.start, e.time_range.end, e.name))
    return report(device, host, min_us)


def show(title, profiled, wall):
    times, gaps = profiled
    whole = sum(ms for ms, _ in times.values())
    print(f"== {title}: {whole:.2f} ms of kernels per step, {wall:.2f} ms wall (median, CUDA events): "
          f"{wall - whole:.2f} ms with no kernel running")
    for k, (ms, n) in sorted(times.items(), key=lambda kv: -kv[1][0]):
        print(f"  {ms:8.3f} ms {100 * ms / whole:5.1f}%  x{n:5.1f}  {k}")
    print(f"  idle between kernels inside a step: {sum(gaps.values()):.3f} ms; the largest, by neighbours:")
    for (before, after), ms in sorted(gaps.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {ms:8.3f} ms  after {before[:50]}  before {after[:50]}")


def main():
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--B", type=int, default=8)
    a.add_argument("--steps", type=int, default=3)
    a.add_argument("--data", choices=["normal", "uniform"], default="normal",
                   help="normal: bench_peers.py's inputs; uniform: cuda_bench's (x and W uniform with the same "
                        "variances, the first tenth of each sequence a prompt of ignored targets)")
    a.add_argument("--timeline", action="store_true", help="also one step's idle gaps with the host's runtime calls")
    a.add_argument("--min-gap-us", type=float, default=10.0, help="--timeline: the shortest idle interval listed")
    a.add_argument("--impl", choices=["ours", "ours_novalidate"], default="ours",
                   help="the module as bench_peers.py names it (ours_novalidate: validate=False)")
    a.add_argument("--forward", action="store_true",
                   help="the forward under torch.no_grad (the forward-only schedule) instead of forward + backward; "
                        "the floor is then the logits GEMM alone")
    args = a.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.data == "normal":
        w = workload_weight(g)
        x, t = workload_rows(g, args.B)
    else:
        def uniform(*shape, half_width):
            return ((torch.rand(*shape, device="cuda", generator=g) * 2 - 1) * half_width).to(torch.bfloat16)

        w = uniform(V, H, half_width=(3.0 * 4.0 / H) ** 0.5)
        x = uniform(args.B, T, H, half_width=3.0 ** 0.5)
        t = torch.randint(0, V, (args.B, T), device="cuda", generator=g)
        t[:, : T // 10] = -100
    if args.forward:
        f = loss_fn(args.impl)

        def step():
            with torch.no_grad():
                f(x, w, t)
    else:
        step, _, _ = training_step(loss_fn(args.impl), x, w, t)

    print(f"B={args.B} T={T} H={H} V={V}, {args.data} inputs, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    show("ours, " + ("the forward under no_grad" if args.forward else "forward + backward"),
         kernel_times(step, args.steps), timed(step, 5))
    if args.timeline:
        print("== ours, one step's timeline (device idle gaps and the host's CUDA runtime calls inside them)")
        print(timeline(step, args.min_gap_us))
    N = args.B * T
    x2 = x.reshape(N, H)
    if args.forward:
        gemm = lambda: x2 @ w.t()  # noqa: E731
        show("floor: the logits GEMM", kernel_times(gemm, args.steps), timed(gemm, 5))
        return
    dz = (torch.randn(N, V, device="cuda", generator=g).to(torch.bfloat16) if args.data == "normal"
          else uniform(N, V, half_width=1e-3))
    gemms = lambda: (x2 @ w.t(), dz @ w, dz.t() @ x2)  # noqa: E731
    show("floor: the three bf16 GEMMs", kernel_times(gemms, args.steps), timed(gemms, 5))


if __name__ == "__main__":
    main()
