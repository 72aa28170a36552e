"""One process times ours, QuACK's chunked linear cross-entropy (its base and scaled-exp pipelines), torch eager
cross-entropy and the cuBLAS GEMM floor on bench_peers.py's workload, and writes a JSON file, a markdown table
(stdout) and, with --png, a plot of each time's ratio to the floor against B.

    python3 bench_quack.py OUT.json [--batches 2,4,8,16] [--reps 5] [--impls NAME,...] [--png OUT.png]
                           [--budget S] [--quack-untuned]

Workload: T=1024, H=4096, V=128256, bf16, no bias, every token a target, x ~ N(0, 1), W ~ N(0, 4/H) (logits of
standard deviation 2), the same generator and seed as bench_peers.py, so the same inputs at each B. Per B, in this
order: the floor (bench_peers.gemm_floor: fwd = the logits GEMM, full = the three bf16 GEMMs of a training step),
then each impl through bench_peers.measure: fwd = the loss alone under torch.no_grad, full = forward +
loss.backward() with every gradient; medians of --reps after a warm-up, CUDA events; extra MiB = peak device memory
above the steady state (plus, for ours, what its kernel holds outside torch's allocator).

Impls (--impls, comma-separated, in the order given; a QuACK name may end in @CHUNK, its chunk_size, else QuACK's
default 4096):
  ours              simpo_verify.torch.FusedLinearSimPOLoss: the SimPO loss (its NLL term and the preference term)
  quack_base        quack.linear_cross_entropy.chunked_linear_cross_entropy(..., use_scaled_exp=False): a logits
                    chunk in bf16, QuACK's CE row kernel, two GEMMs; mean cross-entropy
  quack_scaled_exp  the same call with use_scaled_exp=True: the pipeline QuACK picks by itself on sm_90 with bf16 and
                    V % 128 == 0 (this workload); mean cross-entropy. Under no_grad both pipelines take their
                    loss-only paths (the chunk size matters only to the full step there). In 0.6.5's source the
                    full step raises ValueError ("m == n makes row/col inference ambiguous") when a chunk's rows
                    (the last one padded to 128) equal H: the dx GEMM's epilogue tells its per-row vector from a
                    per-column one by its length. Here H = 4096, so chunk 4096 fails from B = 4 on and chunk 8192
                    at B = 4; quack_scaled_exp@2048 avoids it at every B
  torch_eager_ce    F.cross_entropy of the logits cast to fp32, mean: what the fused losses replace
The losses differ: QuACK and torch eager compute a mean cross-entropy, ours SimPO, so QuACK is a speed anchor, not
a SimPO peer (it returns no per-token log-probabilities for SimPO's per-sequence averages).

A cell that cannot run is reported and the run goes on: "not installed" (the package does not import: QuACK's
reason once in the JSON's quack.error and on stderr), "not eligible" (scaled_exp_lce_supported() is false for that
chunk size: not sm_90, ...), "fails (...)" (the exception, shortened; whole in the JSON), "not run" (the budget ran
out, or an earlier cell left the CUDA context unusable, after which nothing on the device can run).

QuACK 0.6.5 cannot import quack.linear_cross_entropy from a `pip install --target` tree without
patch_quack_extern_roots() (its docstring says why); the patch is applied before that import and recorded in the
JSON.

OUT.json (rewritten after each cell, so a run cut short keeps what it timed):
{"schema": "simpo-verify quack benchmark v1 (python/tools/bench_quack.py)",
 "workload": {"T", "H", "V", "dtype": "bf16", "bias": false, "ignore": "none", "losses": {NAME: text}},
 "device", "torch", "python", "date", "command", "reps", "units": {"time": "ms (median)", "memory": "MiB"},
 "quack": {"version", "cutlass_dsl", "tuned", "error" (null when it imports), "patch"},
 "impls": [NAME, ...],          # canonical: ours, torch_eager_ce, quack_base@4096, quack_scaled_exp@8192, ...
 "rows": [{"B", "floor_fwd_ms", "floor_full_ms",
           "quack_auto": "scaled_exp" | "base" | null,   # what chunked_linear_cross_entropy picks by default here
           "impls": {NAME: {"fwd_ms", "full_ms", "fwd_extra_mib", "full_extra_mib", "loss", "first_call_s",
                            "wall_s"}
                         | {"status": "not installed" | "not eligible" | "fails" | "not run", "error",
                            "short" (the table's words, for "fails" and a failed import)}}}],
 "cuda_lost": null | "NAME at B=..: error",
 "png": path | "skipped: reason" | null,
 "wall_s"}
loss: the fwd value (its first, untimed call); first_call_s: that call's wall time (QuACK's JIT compiles, ours'
first launch); wall_s: the whole cell, compiles and timings.
"""

import argparse
import json
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_peers

SCHEMA = "simpo-verify quack benchmark v1 (python/tools/bench_quack.py)"
QUACK_DEFAULT_CHUNK = 4096  # chunked_linear_cross_entropy's default chunk_size
IMPLS = ("ours", "quack_base", "quack_scaled_exp", "torch_eager_ce")
# QuACK as called by default (scaled-exp at chunk 4096 on sm_90), its base pipeline, and scaled-exp at chunks
# that avoid its m == n failure (the docstring's quack_scaled_exp entry): 8192 from B = 8 on, 2048 at every B.
DEFAULT_IMPLS = "ours,quack_base,quack_scaled_exp,quack_scaled_exp@8192,quack_scaled_exp@2048,torch_eager_ce"
QUACK_NEEDS = ("quack-kernels 0.6.5, nvidia-cutlass-dsl 4.7.1 (with nvidia-cutlass-dsl-libs-base, -libs-core and "
               "-libs-cu13), apache-tvm-ffi, torch-c-dlpack-ext; on the device: python/tools/device_quack.sh")
LOSSES = {
    "ours": "SimPO (NLL of the chosen half + the preference term), simpo_verify.torch.FusedLinearSimPOLoss",
    "quack_base": "mean cross-entropy, chunked_linear_cross_entropy(use_scaled_exp=False)",
    "quack_scaled_exp": "mean cross-entropy, chunked_linear_cross_entropy(use_scaled_exp=True)",
    "torch_eager_ce": "mean cross-entropy, F.cross_entropy((x @ W^T).float(), t)",
}


def canonical_impls(spec):
    """'ours,quack_base,quack_scaled_exp@8192' -> ['ours', 'quack_base@4096', 'quack_scaled_exp@8192']; ValueError
    naming what is wrong otherwise."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        base, _, chunk = item.partition("@")
        if base not in IMPLS:
            raise ValueError(f"unknown impl {base!r} (known: {', '.join(IMPLS)})")
        if base.startswith("quack_"):
            try:
                c = int(chunk) if chunk else QUACK_DEFAULT_CHUNK
            except ValueError:
                raise ValueError(f"{item!r}: the chunk size after @ must be an integer") from None
            if c <= 0 or c % 8:
                raise ValueError(f"{item!r}: QuACK needs a positive chunk size that is a multiple of 8")
            item = f"{base}@{c}"
        elif chunk:
            raise ValueError(f"{item!r}: only the QuACK impls take @CHUNK")
        if item not in out:
            out.append(item)
    if not out:
        raise ValueError("no impl named")
    return out


def label(name):
    """The table's and the plot's name of an impl."""
    base, _, chunk = name.partition("@")
    return {"ours": "ours (SimPO)", "torch_eager_ce": "torch eager CE",
            "quack_base": f"QuACK base, chunk {chunk}",
            "quack_scaled_exp": f"QuACK scaled-exp, chunk {chunk}"}[base]


def short_error(e):
    """An exception as a table cell's few words: its message's first line, or for a bare `assert m == n` the
    asserted expression ("m == n"), at most 60 characters."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if not msg and e.__traceback__ is not None:
        line = (traceback.extract_tb(e.__traceback__)[-1].line or "").strip()
        msg = line[len("assert "):] if line.startswith("assert ") else line
    msg = msg or type(e).__name__
    return msg if len(msg) <= 60 else msg[:57] + "..."


def error_text(e):
    """An exception whole for the JSON: type, message, and where it was raised (file:line and the source line),
    since a bare assert has no message."""
    where = ""
    if e.__traceback__ is not None:
        fr = traceback.extract_tb(e.__traceback__)[-1]
        where = f" [at {os.path.basename(fr.filename)}:{fr.lineno}: {(fr.line or '').strip()}]"
    return f"{type(e).__name__}: {e}{where}"


def make_is_extern(orig, roots):
    """QuACK's _is_extern_function widened to functions outside QuACK whose file lies under one of roots (absolute
    folder paths): see patch_quack_extern_roots."""
    roots = tuple(os.path.join(os.path.abspath(r), "") for r in roots)

    def is_extern(fn):
        if orig(fn):
            return True
        module = getattr(fn, "__module__", None) or ""
        if module == "quack" or module.startswith("quack."):
            return False
        code = getattr(fn, "__code__", None)
        return code is not None and os.path.abspath(code.co_filename).startswith(roots)

    return is_extern


def patch_quack_extern_roots():
    """Lets quack.linear_cross_entropy import from a `pip install --target DIR` tree. -> what was done (text).

    QuACK 0.6.5 keys its JIT cache of epilogue kernels by a fingerprint of each epilogue function
    (quack.gemm_runtime.identity.function_semantic_key): its source, plus a key of every global it reads, recursing
    into the functions it calls. A value it cannot key (semantic_value_key) raises TypeError, on purpose: too coarse
    a key would reuse a wrong kernel. Functions of installed packages are not recursed into but keyed by their
    qualified name (their source is pinned by the installed version, which the disk cache stamps with cutlass's),
    and _is_extern_function recognises installed code by a path containing site-packages/ or dist-packages/, or the
    standard library's. A --target tree (/tmp/site-quack on the device) has neither, so the CuTe DSL's functions
    are recursed into, down to a logging.Logger (the DSL's logger, read by cutlass.base_dsl.utils.logger.log), and
    the TypeError is raised while quack.linear_cross_entropy builds its module-level @gemm_epilogue objects: the
    module does not import. The patch counts as installed, in addition, a function outside QuACK whose file lies
    under the folder QuACK was imported from or the folder the cutlass package was imported from (the DSL's
    dsl_packages/): the keying QuACK gives site-packages, applied to the folder the packages are in. QuACK's own
    functions are still keyed by their source, and every other value as before: the epilogues' keys come out
    equal to those of the same wheels installed under a site-packages/ folder without the patch (checked on
    scaled_exp_target_epi, identity_epi and _lce_vscale_epi's semantic digests). Must run before
    quack.linear_cross_entropy (or anything that builds epilogues) is imported: the keys are built at import."""
    import cutlass
    import quack
    import quack.gemm_runtime.identity as ident

    orig = getattr(ident, "_is_extern_function", None)
    if orig is None:
        return "not applied: quack.gemm_runtime.identity._is_extern_function not found (another QuACK version)"
    if getattr(orig, "_bench_quack_patch", None):  # applied earlier in this process
        return orig._bench_quack_patch
    roots = [os.path.dirname(os.path.dirname(os.path.abspath(m.__file__))) for m in (quack, cutlass)]
    roots = list(dict.fromkeys(roots))
    patched = make_is_extern(orig, roots)
    patched._bench_quack_patch = ("quack.gemm_runtime.identity._is_extern_function also counts functions outside "
                                  "quack under " + ", ".join(roots) + " as installed code (keyed by qualified name)")
    ident._is_extern_function = patched
    return patched._bench_quack_patch


def import_quack(tuned):
    """-> (quack.linear_cross_entropy or None, info for the JSON's "quack")."""
    info = {"version": None, "cutlass_dsl": None, "tuned": tuned, "error": None, "patch": None}
    try:
        import cutlass
        import quack

        info["version"] = getattr(quack, "__version__", None)
        info["cutlass_dsl"] = getattr(cutlass, "__version__", None)
        info["patch"] = patch_quack_extern_roots()
        import quack.linear_cross_entropy as lce
    except Exception as e:
        info["error"] = error_text(e)
        return None, info
    return lce, info


def fmt_ms(ms, floor):
    return f"{ms:.2f} ({ms / floor:.2f})"


def cell_text(c):
    """A failed cell's table text ('|' escaped: an error message may hold one)."""
    if c.get("status") == "fails":
        return f"fails ({c.get('short') or 'see JSON'})".replace("|", "\\|")
    return c.get("status", "?")


def markdown_tables(result):
    """The time table (ms and ratio to the same run's floor, per B) and the extra-memory table, as markdown text."""
    impls = result["impls"]
    unit = result.get("units", {}).get("time", "ms (median)")
    lines = [
        f"Times: {unit} of {result.get('reps', '?')} after a warm-up; in parentheses the ratio to the same run's "
        "cuBLAS floor (fwd: the logits GEMM; full: the three bf16 GEMMs). fwd: the loss under no_grad; full: "
        "forward + backward. QuACK and torch eager compute a mean cross-entropy, ours SimPO (not the same loss: "
        f"a speed anchor). T={result['workload']['T']}, H={result['workload']['H']}, V={result['workload']['V']}, "
        f"{result['workload']['dtype']}; {result.get('device', '?')}, torch {result.get('torch', '?')}"
        + (f", QuACK {result['quack']['version']} / CuTe DSL {result['quack']['cutlass_dsl']}"
           if result.get("quack", {}).get("version") else "") + ".",
        "",
        "| B | floor fwd / full | " + " | ".join(f"{label(n)} fwd / full" for n in impls) + " |",
        "|---|---|" + "---|" * len(impls),
    ]
    for row in result["rows"]:
        ff, fl = row["floor_fwd_ms"], row["floor_full_ms"]
        cells = []
        for n in impls:
            c = row["impls"].get(n, {"status": "not run"})
            if "full_ms" in c:
                cells.append(f"{fmt_ms(c['fwd_ms'], ff)} / {fmt_ms(c['full_ms'], fl)}")
            else:
                cells.append(cell_text(c))
        lines.append(f"| {row['B']} | {ff:.2f} / {fl:.2f} | " + " | ".join(cells) + " |")
    lines += ["", "Extra device memory, MiB (peak above the steady state; fwd / full):", "",
              "| B | " + " | ".join(label(n) for n in impls) + " |", "|---|" + "---|" * len(impls)]
    for row in result["rows"]:
        cells = []
        for n in impls:
            c = row["impls"].get(n, {"status": "not run"})
            cells.append(f"{c['fwd_extra_mib']:.0f} / {c['full_extra_mib']:.0f}" if "full_ms" in c else cell_text(c))
        lines.append(f"| {row['B']} | " + " | ".join(cells) + " |")
    if result.get("cuda_lost"):
        lines += ["", f"The CUDA context was lost ({result['cuda_lost']}): later cells did not run."]
    return "\n".join(lines) + "\n"


def write_plot(result, path):
    """Each impl's time over the floor against B, fwd and full side by side, as a PNG at path. -> None when written,
    else why not (matplotlib missing, nothing timed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on the device
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib not importable ({e})"
    series = {}
    for kind in ("fwd", "full"):
        for n in result["impls"]:
            pts = [(row["B"], row["impls"][n][f"{kind}_ms"] / row[f"floor_{kind}_ms"])
                   for row in result["rows"] if f"{kind}_ms" in row["impls"].get(n, {})]
            if pts:
                series[(kind, n)] = pts
    if not series:
        return "nothing timed"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    Bs = sorted({row["B"] for row in result["rows"]})
    for ax, kind, title in zip(axes, ("fwd", "full"), ("forward (no_grad)", "full step (forward + backward)")):
        for i, n in enumerate(result["impls"]):  # one colour per impl in both panels
            if (kind, n) in series:
                xs, ys = zip(*series[(kind, n)])
                ax.plot(xs, ys, marker="o", color=f"C{i % 10}", label=label(n))
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(Bs)
        ax.set_xticklabels([str(b) for b in Bs])
        ax.set_xlabel(f"B (sequences of T = {result['workload']['T']})")
        ax.set_ylabel("time / cuBLAS floor of the same run")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{result.get('device', '?')}: QuACK and torch eager: mean CE; ours: SimPO "
                 f"(H = {result['workload']['H']}, V = {result['workload']['V']}, {result['workload']['dtype']})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_json(result, path):
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)


def parse_args(argv):
    a = argparse.ArgumentParser(
        description="Times ours, QuACK's chunked linear cross-entropy (base and scaled-exp), torch eager CE and "
                    "the cuBLAS floor in one process (T=1024, H=4096, V=128256, bf16); the module docstring has "
                    "the details and the JSON schema.")
    a.add_argument("out", help="the JSON file to write (rewritten after each cell)")
    a.add_argument("--batches", default="2,4,8,16", help="B values, comma-separated (default 2,4,8,16)")
    a.add_argument("--reps", type=int, default=5, help="timed repetitions after one warm-up (default 5)")
    a.add_argument("--impls", default=DEFAULT_IMPLS,
                   help=f"comma-separated, of {', '.join(IMPLS)}; QuACK's may end in @CHUNK (default "
                        f"{DEFAULT_IMPLS})")
    a.add_argument("--png", help="also write the plot (ratio to the floor against B) here; needs matplotlib")
    a.add_argument("--budget", type=float, default=0,
                   help="seconds: no new B row or cell starts after this (0: no limit)")
    a.add_argument("--quack-untuned", action="store_true",
                   help="QuACK's base pipeline with tuned=False (no autotuning of its GEMMs on the first call)")
    args = a.parse_args(argv)
    try:
        args.impls = canonical_impls(args.impls)
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError as e:
        a.error(str(e))
    if not args.batches or min(args.batches) <= 0:
        a.error("--batches: positive integers, comma-separated")
    if args.reps < 1:
        a.error("--reps must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    import torch  # after the arguments: --help and argument errors need neither torch nor a device
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        sys.exit("bench_quack: no CUDA device visible to torch (torch.cuda.is_available() is False)")
    from bench_peers import H, T, V, gemm_floor, loss_fn, measure, workload_rows, workload_weight

    impls = args.impls
    t_start = time.time()
    lce, qinfo = None, {"version": None, "cutlass_dsl": None, "tuned": not args.quack_untuned,
                        "error": "not asked for", "patch": None}
    if any(n.startswith("quack_") for n in impls):
        lce, qinfo = import_quack(not args.quack_untuned)
        if lce is None:
            print(f"bench_quack: QuACK does not import: {qinfo['error']}\n  needs {QUACK_NEEDS}\n  its columns are "
                  "marked 'not installed'; the rest is timed", file=sys.stderr, flush=True)
        else:
            print(f"bench_quack: QuACK {qinfo['version']}, CuTe DSL {qinfo['cutlass_dsl']}; patch: {qinfo['patch']}",
                  flush=True)

    def torch_eager_ce(x, w, t):
        logits = (x @ w.t()).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1))

    def make_fn(name):
        base, _, chunk = name.partition("@")
        if base == "ours":
            return loss_fn("ours")
        if base == "torch_eager_ce":
            return torch_eager_ce
        scaled = base == "quack_scaled_exp"
        return lambda x, w, t: lce.chunked_linear_cross_entropy(
            x, w, t, chunk_size=int(chunk), reduction="mean", tuned=not args.quack_untuned, use_scaled_exp=scaled)

    g = torch.Generator(device="cuda").manual_seed(0)  # bench_peers.py's inputs, in its order
    w = workload_weight(g)
    result = {
        "schema": SCHEMA,
        "workload": {"T": T, "H": H, "V": V, "dtype": "bf16", "bias": False, "ignore": "none",
                     "losses": {n: LOSSES[n.partition("@")[0]] for n in impls}},
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": "python3 python/tools/bench_quack.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "reps": args.reps, "units": {"time": "ms (median)", "memory": "MiB"},
        "quack": qinfo, "impls": impls, "rows": [], "cuda_lost": None, "png": None,
    }
    for B in args.batches:
        if args.budget and time.time() - t_start > args.budget:
            print(f"bench_quack: budget of {args.budget:.0f} s spent: no row from B={B} on", flush=True)
            break
        x, t = workload_rows(g, B)
        floor_fwd, floor_full = gemm_floor(x, w, args.reps)
        row = {"B": B, "floor_fwd_ms": floor_fwd, "floor_full_ms": floor_full, "quack_auto": None, "impls": {}}
        if lce is not None:
            try:
                row["quack_auto"] = ("scaled_exp" if lce.scaled_exp_lce_supported(x, w, QUACK_DEFAULT_CHUNK, "mean")
                                     else "base")
            except Exception as e:
                row["quack_auto"] = f"unknown: {error_text(e)}"
        print(f"B={B} floor fwd {floor_fwd:.2f} full {floor_full:.2f} ms", flush=True)
        result["rows"].append(row)
        for name in impls:
            c0 = time.time()
            if result["cuda_lost"]:
                cell = {"status": "not run", "error": f"CUDA context lost: {result['cuda_lost']}"}
            elif args.budget and c0 - t_start > args.budget:
                cell = {"status": "not run", "error": f"budget of {args.budget:.0f} s spent"}
            elif name.startswith("quack_") and lce is None:
                cell = {"status": "not installed", "error": qinfo["error"]}
            elif (name.startswith("quack_scaled_exp")
                  and not lce.scaled_exp_lce_supported(x, w, int(name.partition("@")[2]), "mean")):
                cell = {"status": "not eligible",
                        "error": "quack.linear_cross_entropy.scaled_exp_lce_supported() is False (it needs sm_90, "
                                 "bf16, V % 128 == 0, a chunk size divisible by 128)"}
            else:
                try:
                    f = make_fn(name)
                    with torch.no_grad():
                        loss = float(f(x, w, t))  # also the first call: JIT compiles land here
                    first = time.time() - c0
                    cell = measure(f, x, w, t, args.reps, ours=name == "ours")
                    cell.update(loss=loss, first_call_s=first, wall_s=time.time() - c0)
                except Exception as e:
                    missing = isinstance(e, ImportError)
                    cell = {"status": "not installed" if missing else "fails", "short": short_error(e),
                            "error": error_text(e)}
                    try:  # an asynchronous kernel fault surfaces here and poisons the context for good
                        torch.cuda.synchronize()
                    except Exception as e2:
                        result["cuda_lost"] = f"{name} at B={B}: {error_text(e2)}"
            row["impls"][name] = cell
            print(f"B={B} {name}: {cell}", flush=True)
            write_json(result, args.out)
            try:
                torch.cuda.empty_cache()
            except Exception:
                pass
        del x, t
        if result["cuda_lost"]:
            print(f"bench_quack: CUDA context lost ({result['cuda_lost']}): no further rows", file=sys.stderr)
            break
    if args.png:
        why = write_plot(result, args.png)
        result["png"] = args.png if why is None else f"skipped: {why}"
        print(f"bench_quack: plot {result['png']}", flush=True)
    result["wall_s"] = time.time() - t_start
    write_json(result, args.out)
    print()
    print(markdown_tables(result), end="", flush=True)


if __name__ == "__main__":
    main()
