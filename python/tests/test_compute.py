"""compute(): numpy in, SPEC's outputs out, every backend the machine has; SPEC's errors as InputError."""

import ml_dtypes
import numpy as np
import pytest

import simpo_verify as sv
from conftest import make_problem

OUTPUTS = {"loss", "nll_loss", "chosen_logps", "rejected_logps", "chosen_logits_mean", "rejected_logits_mean",
           "chosen_rewards", "rejected_rewards", "grad_x", "grad_weight"}


@pytest.mark.parametrize("impl", ["cpu", "auto", "reference"])
def test_outputs_and_dtypes(impl):
    x, w, t, b = make_problem(bias=True)
    out = sv.compute(x, w, t, b, impl=impl)
    assert set(out) == OUTPUTS | {"grad_bias"}
    P = x.shape[0] // 2
    assert out["chosen_logps"].shape == (P,) and out["loss"].shape == ()
    assert out["grad_x"].shape == x.shape and out["grad_weight"].shape == w.shape and out["grad_bias"].shape == b.shape
    if impl == "reference":
        assert all(v.dtype == np.float64 for v in out.values())
    else:  # SPEC's fused dtypes
        assert out["loss"].dtype == np.float32 and out["grad_x"].dtype == ml_dtypes.bfloat16
        assert sv.check({"x": x, "weight": w, "target": t, "bias": b}, out).passed


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_float16_and_float32_inputs(impl, dtype):
    """SPEC's other input dtypes: gradients in the inputs' dtype (or f32 on request), judged strict against bounds
    for that dtype; the float64 reference reads them exactly."""
    x, w, t, b = make_problem(bias=True, dtype=dtype)
    out = sv.compute(x, w, t, b, impl=impl)
    assert set(out) == OUTPUTS | {"grad_bias"}
    if impl == "reference":
        assert all(v.dtype == np.float64 for v in out.values())
    else:
        assert out["loss"].dtype == np.float32
        assert out["grad_x"].dtype == dtype and out["grad_weight"].dtype == dtype and out["grad_bias"].dtype == dtype
        f32 = sv.compute(x, w, t, b, impl=impl, grad_f32=True)
        assert f32["grad_x"].dtype == dtype and f32["grad_weight"].dtype == np.float32
    inputs = {"x": x, "weight": w, "target": t, "bias": b}
    assert sv.check(inputs, out).passed
    # The same outputs through bf16 (inputs rounded, gradients as bf16 values in the inputs' dtype) fail f32's bounds.
    if impl == "cpu" and dtype == np.float32:
        via = sv.compute(*(a.astype(ml_dtypes.bfloat16) for a in (x, w)), t, b.astype(ml_dtypes.bfloat16), impl="cpu")
        via = {k: v.astype(np.float32) for k, v in via.items()}
        assert not sv.check(inputs, via).passed


def test_float32_reference_reads_values_bf16_cannot_hold():
    """An f32 input one f32 ulp away gives another reference result: nothing is rounded through bf16."""
    x, w, t, _ = make_problem(dtype=np.float32)
    w2 = w.copy()
    w2[3, 4] = np.nextafter(w2[3, 4], np.float32(np.inf))
    assert sv.compute(x, w, t, impl="reference")["loss"] != sv.compute(x, w2, t, impl="reference")["loss"]


def test_float16_and_float32_files_round_trip(tmp_path):
    for dtype in (np.float16, np.float32):
        x, w, t, b = make_problem(bias=True, dtype=dtype)
        path = str(tmp_path / f"in_{np.dtype(dtype).name}.safetensors")
        sv.save_inputs(path, x, w, t, b, beta=0.3)
        loaded = sv.load_inputs(path)
        assert loaded["x"].dtype == dtype and loaded["bias"].dtype == dtype
        np.testing.assert_array_equal(loaded["weight"], w)


def test_matches_the_numbers_of_spec():
    """One pair, one token each, V = 2, H = 1: the loss by hand from SPEC's formulas."""
    x = np.array([[[1.0]], [[1.0]]], dtype=ml_dtypes.bfloat16)
    w = np.array([[2.0], [0.0]], dtype=ml_dtypes.bfloat16)  # logits (2, 0) for both rows
    t = np.array([[0], [1]])  # chosen picks logit 2, rejected logit 0
    beta, gamma = 0.1, 0.5
    lse = np.log(np.exp(2.0) + 1.0)
    c, r = 2.0 - lse, 0.0 - lse
    s = beta * (c - r) - gamma
    pref = -np.log(1 / (1 + np.exp(-s)))
    nll = -c
    out = sv.compute(x, w, t, impl="reference", beta=beta, gamma=gamma)
    assert out["loss"] == pytest.approx(nll + pref, rel=1e-12)
    assert out["chosen_logits_mean"] == pytest.approx(1.0, rel=1e-12)


def test_forward_only_and_f32_gradients():
    x, w, t, _ = make_problem()
    fwd = sv.compute(x, w, t, impl="cpu", gradients=False)
    assert not any(k.startswith("grad_") for k in fwd)
    f32 = sv.compute(x, w, t, impl="cpu", grad_f32=True)
    assert f32["grad_weight"].dtype == np.float32
    assert sv.check({"x": x, "weight": w, "target": t}, fwd, gradients=False).passed


def test_hyperparameters_reach_the_kernel():
    x, w, t, _ = make_problem()
    base = sv.compute(x, w, t, impl="reference")
    other = sv.compute(x, w, t, impl="reference", beta=2.0, alpha=0.0, label_smoothing=0.2)
    assert other["loss"] != base["loss"]
    assert other["chosen_rewards"] == pytest.approx(2.0 * other["chosen_logps"], rel=1e-12)
    scaled = sv.compute(x, w, t, impl="reference", grad_scale=3.0)
    np.testing.assert_allclose(scaled["grad_x"], 3.0 * base["grad_x"], rtol=1e-12, atol=1e-300)


def test_integer_targets_are_widened():
    x, w, t, _ = make_problem()
    a = sv.compute(x, w, t, impl="cpu")
    b = sv.compute(x, w, t.astype(np.int32), impl="cpu")
    assert a["loss"] == b["loss"]


@pytest.mark.parametrize("mutate, message", [
    (lambda x, w, t: (x[:3], w, t[:3]), "B must be even"),
    (lambda x, w, t: (x.astype(np.float32), w, t), "x is F32 but weight is BF16"),
    (lambda x, w, t: (x.astype(np.float16), w.astype(np.float32), t), "x is F16 but weight is F32"),
    (lambda x, w, t: (x.astype(np.float64), w, t), "x is F64, SPEC says BF16, F16 or F32"),
    (lambda x, w, t: (x, w, np.where(np.arange(t.shape[1]) < 99, -100, t)), "has no completion token"),
    (lambda x, w, t: (x, w, np.where(t >= 0, t + 1000, t)), "is outside [0, V)"),
    (lambda x, w, t: (x, w[:, :5], t), "shapes disagree"),
])
def test_spec_errors(mutate, message):
    x, w, t, _ = make_problem()
    with pytest.raises(sv.InputError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        sv.compute(*mutate(x, w, t), impl="cpu")


def test_non_finite_input_is_named():
    x, w, t, _ = make_problem()
    x = x.copy()
    x[1, 2, 3] = np.nan
    with pytest.raises(sv.InputError, match=r"non-finite input: x\(1, 2, 3\)"):
        sv.compute(x, w, t, impl="cpu")


def test_bad_keyword_and_impl():
    x, w, t, _ = make_problem()
    with pytest.raises(sv.InputError, match="unknown hyperparameter 'betta'"):
        sv.compute(x, w, t, betta=0.2)
    with pytest.raises(sv.InputError, match="out of range"):
        sv.compute(x, w, t, label_smoothing=0.7)
    with pytest.raises(sv.InputError, match="impl 'gpu'"):
        sv.compute(x, w, t, impl="gpu")


def test_empty_sequence_zero_option():
    x, w, t, _ = make_problem()
    t = t.copy()
    t[1, :] = -100
    out = sv.compute(x, w, t, impl="cpu", empty_sequence="zero")
    assert out["chosen_logps"][1] == 0 and np.isfinite(out["loss"])
