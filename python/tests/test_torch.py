"""simpo_verify.torch: the Liger-compatible module. Needs torch (skipped, with this reason, where it is absent)."""

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed here: the torch module's tests run where it is "
                                             "(the device run in python/README.md)")

import simpo_verify as sv  # noqa: E402
from simpo_verify.torch import FusedLinearSimPOLoss, fused_linear_simpo  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and sv.cuda_available() else [])


def make(device, B=4, T=8, H=32, V=48, bias=True, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=g).to(dtype).to(device)
    w = (torch.randn(V, H, generator=g) / H ** 0.5 * 2).to(dtype).to(device)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype).to(device) if bias else None
    t = torch.randint(0, V, (B, T), generator=g).to(device)
    t[:, :2] = -100
    return x, w, t, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("device", DEVICES)
def test_module_outputs_and_gradients_pass_strict(device, dtype):
    x, w, t, b = make(device, dtype=dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    b.requires_grad_(True)
    loss, aux = FusedLinearSimPOLoss(beta=0.2, gamma=0.3)(w, x, t, b)
    assert len(aux) == 7 and loss.device.type == device and loss.dtype == torch.float32
    loss.backward()
    names = ["chosen_logps", "rejected_logps", "chosen_logits_mean", "rejected_logits_mean", "nll_loss",
             "chosen_rewards", "rejected_rewards"]
    candidate = dict(zip(names, aux), loss=loss, grad_x=x.grad, grad_weight=w.grad, grad_bias=b.grad)
    inputs = {"x": x.detach(), "weight": w.detach(), "target": t, "bias": b.detach(), "beta": 0.2, "gamma": 0.3}
    r = sv.check(inputs, candidate)
    assert r.passed, str(r)
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == dtype  # SPEC: gradients in the inputs' dtype


@pytest.mark.parametrize("device", DEVICES)
def test_grad_output_is_grad_scale(device):
    x, w, t, _ = make(device, bias=False)
    x1 = x.clone().requires_grad_(True)
    loss, _ = fused_linear_simpo(x1, w, t, compute_nll_loss=True)
    (loss * -2.5).backward()
    exact = sv.compute(x.cpu(), w.cpu(), t.cpu(), impl="reference", grad_scale=-2.5)
    got = x1.grad.float().cpu().numpy()
    rel = np.linalg.norm(got - exact["grad_x"].numpy()) / np.linalg.norm(exact["grad_x"].numpy())
    assert rel < 4e-3  # a bf16 gradient of the scaled loss (twice the bf16 floor of ~1.7e-3 at most)


@pytest.mark.parametrize("device", DEVICES)
def test_grad_output_scales_every_gradient_within_strict(device):
    """grad_output s (gradient accumulation's loss / n, a loss weight, a sign): every gradient meets strict for SPEC's
    grad_scale s. On CUDA bf16 with the hi/lo pair (sm_90a) grad_weight's last GEMM runs in backward with s in its
    epilogue: at s = 1 the gradients are the whole step's (sv.compute) bit for bit. A second backward through the
    same graph (retain_graph) runs the step again at its own grad_output."""
    from simpo_verify import _device

    x, w, t, b = make(device)
    names = ["chosen_logps", "rejected_logps", "chosen_logits_mean", "rejected_logits_mean", "nll_loss",
             "chosen_rewards", "rejected_rewards"]
    inputs = {"x": x, "weight": w, "target": t, "bias": b, "beta": 0.2, "gamma": 0.3}
    for scale in (1.0, 1 / 3, -0.25):
        xg, wg, bg = (v.detach().clone().requires_grad_(True) for v in (x, w, b))
        loss, aux = FusedLinearSimPOLoss(beta=0.2, gamma=0.3)(wg, xg, t, bg)
        if device == "cuda" and torch.cuda.get_device_capability(x.device) == (9, 0):
            assert "deferred" in _device.last_info["plan"], _device.last_info["plan"]
        for second, s in ((False, scale), (True, 2.0)):
            xg.grad = wg.grad = bg.grad = None
            (loss * s).backward(retain_graph=not second)
            candidate = dict(zip(names, (a.detach() for a in aux)), loss=loss.detach(), grad_x=xg.grad,
                             grad_weight=wg.grad, grad_bias=bg.grad)
            r = sv.check(dict(inputs, grad_scale=s), candidate)
            assert r.passed, f"grad_output {s}{' (second backward)' if second else ''}:\n{r}"
        if scale == 1.0 and device == "cuda":
            xg.grad = wg.grad = bg.grad = None
            loss, _ = FusedLinearSimPOLoss(beta=0.2, gamma=0.3)(wg, xg, t, bg)
            loss.backward()
            whole = sv.compute(x, w, t, b, beta=0.2, gamma=0.3)
            for name, g in (("grad_x", xg.grad), ("grad_weight", wg.grad), ("grad_bias", bg.grad)):
                assert torch.equal(g, whole[name]), name


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_runs_the_forward_only_schedule(device, monkeypatch):
    import simpo_verify.torch as svt

    x, w, t, b = make(device)
    w.requires_grad_(True)  # an evaluation loop: the LM head's parameters still require grad
    asked = []
    real_run = svt._run
    monkeypatch.setattr(svt, "_run", lambda *a, **k: asked.append(a[5]) or real_run(*a, **k))
    with_grad, aux_with_grad = FusedLinearSimPOLoss()(w, x, t, b)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            loss, aux = FusedLinearSimPOLoss()(w, x, t, b)
        assert loss.grad_fn is None and len(aux) == 7
        assert float(loss) == pytest.approx(float(with_grad), rel=1e-6)
        # every auxiliary output in its shape and value (on CUDA views of one buffer: each its own part of it); the
        # two schedules' row statistics differ by fp32 rounding, which the logits means (near 0) see absolutely
        for a, g in zip(aux, aux_with_grad):
            assert a.shape == g.shape and a.dtype == g.dtype == torch.float32
            torch.testing.assert_close(a, g.detach(), rtol=1e-6, atol=1e-6)
    assert asked == [True, False, False], asked


def test_liger_defaults_and_signature():
    m = FusedLinearSimPOLoss()
    assert (m.ignore_index, m.beta, m.alpha, m.label_smoothing, m.compute_nll_loss, m.gamma) == (-100, 0.1, 1.0, 0.0,
                                                                                                True, 0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_or_unsupported_dtypes_are_type_errors_naming_them(device):
    x, w, t, _ = make(device, bias=False)
    with pytest.raises(TypeError, match="float32"):
        FusedLinearSimPOLoss()(w.float(), x, t)  # weight float32, x bfloat16: never converted
    with pytest.raises(TypeError, match="float64"):
        FusedLinearSimPOLoss()(w.double(), x.double(), t)


@pytest.mark.parametrize("device", DEVICES)
def test_spec_errors_not_nan(device):
    x, w, t, _ = make(device, bias=False)
    t[0, :] = -100
    with pytest.raises(sv.InputError, match="no completion token"):
        FusedLinearSimPOLoss()(w, x, t)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs_give_the_contiguous_results(device):
    """Hidden states sliced as a model hands them over (hidden[:, :-1], Liger's usage) and a transposed-then-back
    weight: copied to contiguous memory, the same bits as the contiguous call, grad_x shaped like the slice."""
    x, w, t, b = make(device, T=9)
    xs, ts = x[:, :-1], t[:, 1:]
    wt = w.t().contiguous().t()  # same values, column-major strides
    assert not xs.is_contiguous() and not wt.is_contiguous()
    results = []
    for xi, wi in ((xs, wt), (xs.contiguous(), wt.contiguous())):
        xg, wg = xi.detach().requires_grad_(True), wi.detach().requires_grad_(True)
        loss, _ = FusedLinearSimPOLoss()(wg, xg, ts, b)
        loss.backward()
        results.append((loss.detach(), xg.grad, wg.grad))
    assert results[0][1].shape == xs.shape
    for a, c in zip(*results):
        assert torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
def test_validate_false_skips_only_the_value_scan(device):
    x, w, t, _ = make(device, bias=False)
    w[3, 2] = float("nan")  # in every row's logits, so in the loss
    with pytest.raises(sv.InputError, match=r"non-finite input: weight\(3, 2\)"):
        FusedLinearSimPOLoss()(w, x, t)
    loss, _ = FusedLinearSimPOLoss(validate=False)(w, x, t)  # the NaN flows through instead
    assert torch.isnan(loss)
    w[3, 2] = 0
    t[0, :] = -100  # an empty sequence: InputError on the CPU, NaN from the asynchronous CUDA call
    if device == "cpu":
        with pytest.raises(sv.InputError, match="no completion token"):
            FusedLinearSimPOLoss(validate=False)(w, x, t)
    else:
        loss, aux = FusedLinearSimPOLoss(validate=False)(w, x, t)
        assert torch.isnan(loss) and all(torch.isnan(a).all() for a in aux)


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device or no cuda backend in this build")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_validate_false_is_asynchronous_with_the_same_results(dtype):
    # No host synchronization: behind a second of queued device work the call returns at once, where the validated
    # call waits for its verdict (which needs the forward's statistics, so the queued work first); the outputs and
    # gradients are the validated call's.
    x, w, t, b = make("cuda", B=4, T=64, H=256, V=4096, dtype=dtype)
    for validate in (True, False):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))  # 2e9 cycles: a second or more at the card's clocks
        start = time.perf_counter()
        FusedLinearSimPOLoss(validate=validate)(w, x, t, b)
        waited = time.perf_counter() - start
        assert (waited > 0.4) == validate, f"validate={validate}: the call took {waited:.3f} s"
        torch.cuda.synchronize()
    results = []
    for validate in (True, False):
        xg, wg, bg = (a.detach().clone().requires_grad_(True) for a in (x, w, b))
        loss, aux = FusedLinearSimPOLoss(validate=validate)(wg, xg, t, bg)
        (loss / 3).backward()
        results.append([loss, *aux, xg.grad, wg.grad, bg.grad])
    for a, c in zip(*results):
        torch.testing.assert_close(a, c, rtol=2 ** -22, atol=0)
    t_bad = t.clone()
    t_bad[1, 5] = 4096  # past V
    loss, aux = FusedLinearSimPOLoss(validate=False)(w, x, t_bad, b)
    assert torch.isnan(loss) and all(torch.isnan(a).all() for a in aux)
    with pytest.raises(sv.InputError, match="target"):
        FusedLinearSimPOLoss()(w, x, t_bad, b)


@pytest.mark.skipif("cuda" not in DEVICES or torch.cuda.get_device_capability() != (9, 0),
                    reason="the deferred weight GEMM runs on the sm_90a kernels (compute capability 9.0)")
def test_backward_reads_grad_output_on_the_device():
    # The deferred finish and the residues' scaling read grad_output where they run: behind half a second of queued
    # device work, a step with validate=False (forward and backward) returns before the stream is done.
    x, w, t, b = make("cuda", B=4, T=64, H=256, V=4096)
    xg, wg, bg = (a.detach().clone().requires_grad_(True) for a in (x, w, b))
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))
    loss, _ = FusedLinearSimPOLoss(validate=False)(wg, xg, t, bg)
    (loss / 3).backward()
    assert not torch.cuda.current_stream().query(), "the step waited for the device"
    torch.cuda.synchronize()
    assert all(torch.isfinite(g).all() for g in (xg.grad, wg.grad, bg.grad))


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device or no cuda backend in this build")
def test_cuda_tensors_stay_on_device_and_compute_matches_host():
    x, w, t, b = make("cuda", H=37)  # H not a multiple of 8: the padded-copy path
    out = sv.compute(x, w, t, b)
    assert out["grad_x"].is_cuda and out["loss"].is_cuda
    host = sv.compute(x.cpu(), w.cpu(), t.cpu(), b.cpu(), impl="cuda")
    assert torch.equal(out["grad_weight"].cpu(), host["grad_weight"])
    x2 = x.clone()
    x2[0, 1, 2] = float("inf")
    with pytest.raises(sv.InputError, match=r"non-finite input: x\(0, 1, 2\)"):
        sv.compute(x2, w, t, b)


def test_custom_ops_pass_opcheck():
    """The ops' schemas, fake implementations and autograd registration (torch.library.opcheck)."""
    from simpo_verify._torch_op import fused_linear_simpo_op, scale_gradient_op

    x, w, t, b = make("cpu")
    x.requires_grad_(True)
    w.requires_grad_(True)
    args = (x, w, t, b, -100, 0.1, 1.0, 0.0, True, 0.5, "error", 1 << 26, True, True, True)
    torch.library.opcheck(fused_linear_simpo_op, args, test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(scale_gradient_op, (w.detach(), w.detach().new_empty(0), torch.tensor(0.25)))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_matches_eager(device):
    """torch.compile(fullgraph=True) of a step that calls the module compiles with no graph break (the op is
    opaque); at grad_output 1 its loss and gradients are the eager module's, and at 1/3 (the loss divided, as
    gradient accumulation does) they meet strict for SPEC's grad_scale 1/3."""
    x, w, t, b = make(device)
    loss_fn = FusedLinearSimPOLoss(beta=0.2, gamma=0.3)

    def step(x, w, t, b, divisor):
        loss, aux = loss_fn(w, x, t, b)
        return loss / divisor, aux

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    names = ["chosen_logps", "rejected_logps", "chosen_logits_mean", "rejected_logits_mean", "nll_loss",
             "chosen_rewards", "rejected_rewards"]
    for divisor in (1.0, 3.0):
        results = []
        for fn in (step, compiled):
            xg, wg, bg = (v.detach().clone().requires_grad_(True) for v in (x, w, b))
            loss, aux = fn(xg, wg, t, bg, divisor)
            loss.backward()
            results.append((loss.detach() * divisor, aux, xg.grad, wg.grad, bg.grad))
        (loss, aux, gx, gw, gb), eager = results[1], results[0]
        if divisor == 1.0:
            for e, c in zip(eager[2:], (gx, gw, gb)):
                assert torch.equal(e, c)
        candidate = dict(zip(names, (a.detach() for a in aux)), loss=loss, grad_x=gx, grad_weight=gw, grad_bias=gb)
        inputs = {"x": x, "weight": w, "target": t, "bias": b, "beta": 0.2, "gamma": 0.3, "grad_scale": 1 / divisor}
        r = sv.check(inputs, candidate)
        assert r.passed, str(r)


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device or no cuda backend in this build")
def test_cuda_graph_capture_is_refused_with_a_message():
    x, w, t, b = make("cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(sv.InputError, match="CUDA graph"):
        with torch.cuda.graph(graph):
            FusedLinearSimPOLoss()(w, x, t, b)
