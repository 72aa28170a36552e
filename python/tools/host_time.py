"""What one call of the torch drop-in costs the host, piece by piece, in microseconds per call.

    python3 host_time.py [--calls 300]

Wherever the caller synchronizes each step (an evaluation loop that reads the loss, a benchmark's reps), the host's
time before the call's first GEMM is device time lost. Each piece is timed by perf_counter over --calls calls
(after one untimed call), with nothing synchronized in between, so the host bounds it: the pieces of
simpo_verify._device.compute alone, then the whole no_grad forward at a tiny shape (B=2, T=64, H=256, V=1024), whose
kernels take less time than their launches, without validation (no synchronization) and with it (one each), beside
torch.mm at the same shape; last, the published shape's B = 2 forward and its logits GEMM, each synchronized per
call (what a synchronizing caller sees).
"""

import argparse
import time


def per_call_us(fn, calls):
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--calls", type=int, default=300, help="calls timed per piece (the synchronized ones: a tenth)")
    calls = a.parse_args().calls
    import torch  # after the arguments: --help needs neither torch nor a device

    from simpo_verify import _device
    from simpo_verify._arrays import metadata
    from simpo_verify.torch import _hyperparameters, fused_linear_simpo

    if not torch.cuda.is_available():
        raise SystemExit("host_time.py: no CUDA device (the drop-in's host path is the cuda backend's)")
    dev = torch.device("cuda")
    x = torch.randn(2, 1024, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(128256, 4096, device=dev, dtype=torch.bfloat16)
    t = torch.randint(0, 128256, (2, 1024), device=dev)
    hp = _hyperparameters(-100, 0.1, 1.0, 0.0, True, 0.5, "error")

    def device_context():
        with torch.cuda.device(dev):
            return torch.cuda.current_stream(dev).cuda_stream

    pieces = [
        ("check_tensors", lambda: _device.check_tensors(x, w, t, None)),
        ("metadata(hp)", lambda: metadata(hp)),
        ("8 torch.empty", lambda: [torch.empty((), dtype=torch.float32, device=dev) for _ in range(8)]),
        ("1 torch.empty", lambda: torch.empty((), dtype=torch.float32, device=dev)),
        ("device context + stream", device_context),
        ("detach/contiguous", lambda: (x.detach().contiguous(), w.detach().contiguous(),
                                       t.detach().to(torch.int64).contiguous())),
    ]
    for name, fn in pieces:
        print(f"{name:28s} {per_call_us(fn, calls):8.1f} us")
    xs = torch.randn(2, 64, 256, device=dev, dtype=torch.bfloat16)
    ws = torch.randn(1024, 256, device=dev, dtype=torch.bfloat16)
    ts = torch.randint(0, 1024, (2, 64), device=dev)
    with torch.no_grad():
        tiny = [
            ("tiny forward, validate=False", lambda: fused_linear_simpo(xs, ws, ts, validate=False)),
            ("tiny forward, validated", lambda: fused_linear_simpo(xs, ws, ts)),
            ("tiny _device.compute", lambda: _device.compute(xs, ws, ts, None, metadata(hp), gradients=False,
                                                             validate=False, workspace_bytes=2 << 30,
                                                             forward_on_device=True)),
            ("tiny torch.mm", lambda: torch.mm(xs[0], ws.t())),
        ]
        for name, fn in tiny:
            print(f"{name:28s} {per_call_us(fn, calls):8.1f} us")

        def forward_synchronized():
            fused_linear_simpo(x, w, t)
            torch.cuda.synchronize()

        def gemm_synchronized():
            torch.mm(x.view(-1, 4096), w.t())
            torch.cuda.synchronize()

        print(f"{'B=2 forward, synchronized':28s} {per_call_us(forward_synchronized, calls // 10):8.1f} us; "
              f"its logits GEMM {per_call_us(gemm_synchronized, calls // 10):8.1f} us")


if __name__ == "__main__":
    main()
