"""tools/bench_quack.py's host side on fabricated timings: the impl names, the table, the plot, error cells, the
QuACK import patch's predicate. Needs no GPU, no torch and no QuACK (the plot test needs matplotlib)."""

import os
import subprocess
import sys
import types

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools")
sys.path.insert(0, TOOLS)

import bench_quack as bq  # noqa: E402


def fake_result():
    """Two rows as main() writes them: ours and torch eager timed, QuACK's base timed, scaled-exp failing at one
    chunk size and not eligible at the other."""
    impls = bq.canonical_impls("ours,quack_base,quack_scaled_exp,quack_scaled_exp@8192,torch_eager_ce")

    def ok(fwd, full, mf, mb):
        return {"fwd_ms": fwd, "full_ms": full, "fwd_extra_mib": mf, "full_extra_mib": mb, "loss": 12.3,
                "first_call_s": 1.0, "wall_s": 2.0}

    rows = []
    for B, ff, fl in ((2, 2.0, 8.0), (4, 4.0, 16.0)):
        rows.append({"B": B, "floor_fwd_ms": ff, "floor_full_ms": fl, "quack_auto": "scaled_exp", "impls": {
            "ours": ok(ff * 1.5, fl * 1.25, 1034, 2084),
            "quack_base@4096": ok(ff * 1.1, fl * 1.1, 501, 1002),
            "quack_scaled_exp@4096": ({"status": "fails", "short": "m == n", "error": "AssertionError: "}
                                      if B == 4 else ok(ff, fl * 1.3, 10, 20)),
            "quack_scaled_exp@8192": {"status": "not eligible", "error": "scaled_exp_lce_supported() is False"},
            "torch_eager_ce": ok(ff * 2, fl * 1.5, 2004, 2489)}})
    return {"schema": bq.SCHEMA, "workload": {"T": 1024, "H": 4096, "V": 128256, "dtype": "bf16"},
            "device": "fake GPU", "torch": "0", "reps": 5, "units": {"time": "ms (median)", "memory": "MiB"},
            "quack": {"version": "0.6.5", "cutlass_dsl": "4.7.1"}, "impls": impls, "rows": rows,
            "cuda_lost": None}


def test_canonical_impls():
    assert bq.canonical_impls("ours, quack_base,quack_scaled_exp@8192,quack_base@4096") == [
        "ours", "quack_base@4096", "quack_scaled_exp@8192"]
    for bad, words in (("foo", "unknown impl"), ("ours@4096", "only the QuACK"), ("quack_base@x", "integer"),
                       ("quack_base@12", "multiple of 8"), (",", "no impl")):
        with pytest.raises(ValueError, match=words):
            bq.canonical_impls(bad)


def test_table():
    text = bq.markdown_tables(fake_result())
    assert "mean cross-entropy, ours SimPO" in text
    assert "| B | floor fwd / full | ours (SimPO) fwd / full | QuACK base, chunk 4096 fwd / full |" in text
    # ms (ratio to the same row's floor)
    assert "| 2 | 2.00 / 8.00 | 3.00 (1.50) / 10.00 (1.25) | 2.20 (1.10) / 8.80 (1.10) | 2.00 (1.00) / 10.40 (1.30)" \
        in text
    assert "fails (m == n)" in text and "not eligible" in text
    assert "| 4 | 1034 / 2084 | 501 / 1002 | fails (m == n) | not eligible | 2004 / 2489 |" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert len({ln.count("|") for ln in lines[:4]}) == 1  # header, rule and rows have the same columns


def test_not_installed_and_lost_cells():
    r = fake_result()
    for row in r["rows"]:
        for n in r["impls"]:
            if n.startswith("quack_"):
                row["impls"][n] = {"status": "not installed", "error": "ModuleNotFoundError: No module named 'cutlass'"}
    r["rows"][1]["impls"]["torch_eager_ce"] = {"status": "not run", "error": "CUDA context lost"}
    r["cuda_lost"] = "quack_base@4096 at B=4: RuntimeError: illegal memory access"
    text = bq.markdown_tables(r)
    assert text.count("not installed") == 2 * 3 * 2  # 3 QuACK columns, 2 rows, both tables
    assert "later cells did not run" in text


def test_pipe_in_error_is_escaped():
    r = fake_result()
    r["rows"][0]["impls"]["ours"] = {"status": "fails", "short": "unsupported operand type(s) for |", "error": "x"}
    text = bq.markdown_tables(r)
    assert "fails (unsupported operand type(s) for \\|)" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| 2 |"))
    assert row.replace("\\|", "").count("|") == 2 + len(r["impls"]) + 1  # B, floor, one per impl


def test_short_error(tmp_path):
    src = tmp_path / "gemm.py"  # a bare assert outside pytest's assertion rewriting, as in QuACK: no message
    src.write_text("def check(m, n):\n    assert m == n\n")
    ns = {}
    exec(compile(src.read_text(), str(src), "exec"), ns)
    with pytest.raises(AssertionError) as info:
        ns["check"](1, 2)
    assert str(info.value) == ""
    assert bq.short_error(info.value) == "m == n"
    assert "gemm.py:2: assert m == n" in bq.error_text(info.value)
    assert bq.short_error(RuntimeError("first line\nsecond")) == "first line"
    assert len(bq.short_error(RuntimeError("x" * 200))) == 60


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "quack.png"
    assert bq.write_plot(fake_result(), str(out)) is None
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = fake_result()
    for row in r["rows"]:
        row["impls"] = {}
    assert bq.write_plot(r, str(tmp_path / "none.png")) == "nothing timed"


def test_extern_predicate(tmp_path):
    """The import patch's widened _is_extern_function: code outside QuACK under a root counts as installed, QuACK's
    own code and code elsewhere do not, and what the original accepted stays accepted."""
    root = tmp_path / "site-quack"
    (root / "cutlass").mkdir(parents=True)
    src = root / "cutlass" / "logger.py"
    src.write_text("def log(msg):\n    return msg\n")

    def load(path, module):
        ns = {"__name__": module}
        exec(compile(path.read_text(), str(path), "exec"), ns)
        return ns["log"]

    is_extern = bq.make_is_extern(lambda fn: getattr(fn, "__name__", "") == "accepted", [str(root)])
    assert is_extern(load(src, "cutlass.logger"))
    assert not is_extern(load(src, "quack.epilogue.math"))  # QuACK's own: keyed by source
    other = tmp_path / "site-quack2"
    other.mkdir()
    (other / "m.py").write_text(src.read_text())
    assert not is_extern(load(other / "m.py", "m"))  # a sibling folder sharing the prefix is not under the root

    def accepted():
        pass

    assert is_extern(accepted)
    assert not is_extern(types.SimpleNamespace(__module__="x"))  # no code object


def test_help_needs_no_torch():
    """--help and argument errors come before torch is imported (the device's python has it; a host may not)."""
    code = ("import sys, runpy; sys.modules['torch'] = None; sys.argv = ['bench_quack.py', '--help']; "
            f"runpy.run_path({os.path.join(TOOLS, 'bench_quack.py')!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--impls" in r.stdout and "QuACK" in r.stdout
