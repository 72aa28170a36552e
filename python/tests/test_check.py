"""check(): dicts or files, the strict/peer/user profiles, the report object."""

import json

import ml_dtypes
import numpy as np
import pytest

import simpo_verify as sv
from conftest import make_problem


@pytest.fixture
def case():
    x, w, t, b = make_problem(bias=True, seed=3)
    inputs = {"x": x, "weight": w, "target": t, "bias": b, "beta": 0.3}
    return inputs, sv.compute(x, w, t, b, impl="cpu", beta=0.3)


def test_passes_and_prints_the_cli_table(case):
    inputs, out = case
    r = sv.check(inputs, out)
    assert r.passed and r.profile == "strict"
    assert "grad_weight" in str(r) and "PASSED" in str(r)
    assert json.loads(r.to_json())["passed"] is True
    assert r.row("loss")["verdict"] == "passed"


def test_wrong_hyperparameter_fails(case):
    inputs, out = case
    r = sv.check(dict(inputs, beta=0.1), out)  # the candidate computed beta = 0.3
    assert not r.passed and "chosen_rewards" in r.failed()


def test_a_perturbed_gradient_fails_strict_but_passes_peer(case):
    inputs, out = case
    bad = dict(out)
    g = out["grad_weight"].astype(np.float32)
    # 1% too large everywhere: six times the bf16 floor (strict's Frobenius bound is about twice the floor),
    # inside Liger's elementwise 5e-3 + 5e-3 |exact| while |exact| < 1
    assert np.abs(g).max() < 1
    bad["grad_weight"] = (g * 1.01).astype(ml_dtypes.bfloat16)
    strict = sv.check(inputs, bad)
    assert not strict.passed and strict.failed() == ["grad_weight"]
    assert sv.check(inputs, bad, profile="peer").passed
    assert not sv.check(inputs, bad, rtol=0, atol=1e-9).passed  # the user profile


def test_missing_tensor_is_not_passed(case):
    inputs, out = case
    partial = {k: v for k, v in out.items() if k != "grad_bias"}
    r = sv.check(inputs, partial)
    assert not r.passed and r.row("grad_bias")["verdict"] == "not checked"


def test_nan_fails(case):
    inputs, out = case
    bad = dict(out, loss=np.float32(np.nan))
    assert not sv.check(inputs, bad).passed


def test_files_round_trip(case, tmp_path):
    inputs, out = case
    ip, op = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    sv.save_inputs(ip, inputs["x"], inputs["weight"], inputs["target"], inputs["bias"], beta=0.3)
    sv.save_outputs(op, out)
    assert sv.check(ip, op).passed
    loaded = sv.load_inputs(ip)
    assert loaded["beta"] == 0.3 and loaded["x"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(loaded["target"], inputs["target"])
    exact = sv.reference(ip)
    assert sv.check(ip, op, exact=exact).passed


def test_unknown_output_name_is_an_error(case):
    inputs, out = case
    with pytest.raises(sv.InputError, match="unknown output tensor"):
        sv.check(inputs, dict(out, grad_z=out["grad_x"]))


def test_judge_takes_the_softmax_norms_from_its_own_reference(case):
    """Judge(inputs) computes the reference itself and takes each row's off-target softmax from its dz pass (O(N));
    given exact=, it recomputes them from fp32 logits (O(N H V)). The same reference outputs, and bounds that agree
    to the fp32 recomputation's rounding, so the same verdicts."""
    inputs, out = case
    own = sv.Judge(inputs)
    given = sv.Judge(inputs, exact=sv.reference(inputs))
    for k, v in given.exact.items():
        np.testing.assert_array_equal(own.exact[k], v)
    bad = dict(out, grad_x=(out["grad_x"].astype(np.float32) * 1.01).astype(ml_dtypes.bfloat16))
    for cand in (out, bad):
        a, b = own.check(cand), given.check(cand)
        assert [r["verdict"] for r in a.rows] == [r["verdict"] for r in b.rows]
        for ra, rb in zip(a.rows, b.rows):
            assert ra["frob_bound"] == pytest.approx(rb["frob_bound"], rel=1e-4), ra["name"]
    assert own.check(out).passed and own.check(bad).failed() == ["grad_x"]
