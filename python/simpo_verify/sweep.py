"""sweep(fn): the C++ random sweep, with its properties and shrinking, against a Python callable.

The library's run_sweep is bound directly (python/src/bindings.cpp: an Implementation whose compute calls fn
under the GIL), not driven through an `exec:` child process: no process start, file write and file read per
case (the device time the peers' sweeps spend is spent in the peers), fn may be a closure or hold CUDA tensors
between cases, and its exceptions keep their tracebacks. The replay command of a counterexample names
`exec:python3 -m simpo_verify.serve MODULE:FUNCTION`, the same fn through the exec: protocol, when fn is
importable by that name.
"""

from __future__ import annotations

import json
import sys
import traceback

from . import _core
from .serve import call


class SweepReport:
    """What the sweep found: per-property counts, failures (the first of each property shrunk, with its inputs
    file and replay command), and matches_reference re-judged under each further profile."""

    def __init__(self, raw: dict, profile: str):
        self.raw = raw
        self.profile = profile
        self.implementation: str = raw["implementation"]
        self.cases: int = raw["cases"]
        self.seconds: float = raw["seconds"]
        self.passed_by_property: dict = dict(raw["passed"])
        self.failed_by_property: dict = dict(raw["failed"])
        self.failures: list = list(raw["failures"])
        self.worst_margin: dict = dict(raw["worst_margin"])
        self.declared: dict = json.loads(raw["declared"])  # the capabilities fn was held to ({}: all of SPEC)
        self.excluded: dict = dict(raw["excluded"])  # drawn cases outside the declaration, by key
        # tensor -> {"cases_compared", "cases_differing", "max_elements_differing", "max_abs", "max_rel"}
        self.spread: dict = {k: dict(v) for k, v in raw["spread"].items()}
        # profile -> {"passed", "failed", "smallest_failure"} for matches_reference (strict: the sweep's own)
        self.profiles: dict = {profile: {"passed": self.passed_by_property.get("matches_reference", 0),
                                          "failed": self.failed_by_property.get("matches_reference", 0),
                                          "smallest_failure": self.counterexample("matches_reference")}}
        self.profiles.update({k: dict(v) for k, v in raw["profiles"].items()})

    def counterexample(self, prop: str):
        """The shrunk failure of property `prop`, or None."""
        for f in self.failures:
            if f["property"] == prop and f["shrunk"] is not None:
                return f
        return None

    @property
    def passed(self) -> bool:
        """No property failed (matches_reference judged under this sweep's profile)."""
        return not self.failures and not any(self.failed_by_property.values())

    def to_dict(self) -> dict:
        return {"implementation": self.implementation, "profile": self.profile, "cases": self.cases,
                "seconds": self.seconds, "passed": self.passed, "passed_by_property": self.passed_by_property,
                "failed_by_property": self.failed_by_property, "profiles": self.profiles,
                "failures": self.failures, "worst_margin": self.worst_margin, "declared": self.declared,
                "excluded": self.excluded, "spread": self.spread}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def __str__(self) -> str:  # the CLI's sweep table, then the other profiles' matches_reference
        lines = [f"{'sweep: ' + self.implementation:<34} {'passed':>10} {'failed':>8}"]
        for name, _claim in self.raw["properties"]:
            lines.append(f"  {name:<32} {self.passed_by_property.get(name, 0):>10} "
                         f"{self.failed_by_property.get(name, 0):>8}")
        for pname, p in self.profiles.items():
            if pname != self.profile:
                lines.append(f"  {'matches_reference (' + pname + ')':<32} {p['passed']:>10} {p['failed']:>8}")
        lines.append(f"  ({self.cases} cases in {self.seconds:.1f} s)")
        if self.excluded:
            lines.append(f"  excluded by the declaration {json.dumps(self.declared)}: "
                         + ", ".join(f"{k} {n}" for k, n in sorted(self.excluded.items())))
        for t, f in sorted(self.spread.items()):
            if f["cases_differing"]:
                lines.append(f"  run-to-run spread of {t}: {f['cases_differing']} of {f['cases_compared']} cases, "
                             f"max |diff| {f['max_abs']:.2e}" + (" (declared deterministic: failed)"
                                                               if self.declared.get("deterministic") else " (a finding)"))
        for f in self.failures:
            if f["shrunk"] is None:
                continue
            lines.append(f"FAILED {f['property']} on case {f['case_index']}: {f['detail']}")
            lines.append(f"  shrunk: {f['shrunk']['description']}")
            if f["inputs_path"]:
                lines.append(f"  inputs: {f['inputs_path']}")
            lines.append("  replay:\n" + f["replay"])
        unshrunk = sum(1 for f in self.failures if f["shrunk"] is None)
        if unshrunk:
            lines.append(f"  (+{unshrunk} more failures, not shrunk: .failures lists them)")
        for pname, p in self.profiles.items():
            s = p.get("smallest_failure")
            if pname != self.profile and s:
                lines.append(f"FAILED matches_reference ({pname}), smallest case: {s['description']}: {s['detail']}")
                if s["inputs_path"]:
                    lines.append(f"  inputs: {s['inputs_path']}")
        return "\n".join(lines)


def _name_of(fn) -> str:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if module and qualname and module != "__main__" and "<" not in qualname:
        return f"exec:python3 -m simpo_verify.serve {module}:{qualname}"
    return f"python:{qualname or type(fn).__name__}"


def sweep(fn, cases=300, seed=20260101, profile="strict", *, also_judge=(), arrays="numpy", device=None,
          time_budget_s=0.0, shrink=True, shrink_attempts=150, shrink_seconds=60.0,
          counterexample_dir="simpo-counterexamples", name=None, stop_at_first_failure=False,
          verbose_refusals=False, shapes=(), hyperparameter_sets=0, capabilities=None, dtypes=()) -> SweepReport:
    """Runs `cases` random cases (SPEC's properties against the float64 reference; at most time_budget_s seconds
    when > 0) against fn, shrinking the first failure of each property to a small counterexample whose inputs
    file goes to counterexample_dir ("" writes none).

    fn(x, weight, target, bias=None, *, gradients=True, **hyperparameters) -> dict of SPEC outputs, with numpy
    arrays or (arrays="torch") torch tensors on `device`; raising is refusing the inputs (what SPEC expects for
    the invalid ones).

    profile: the error-model profile matches_reference judges (and shrinks) with: "strict" (bounds derived from
    dtypes and shapes) or "peer" (Liger's atol = rtol = 5e-3). also_judge: further profiles under which every
    case's outputs are judged too, against the same reference outputs (the smallest failing case is written, unshrunk).

    shapes: (B, T, H, V) tuples; when given, every case's shape is one of them (picked uniformly) instead of drawn,
    so an implementation that compiles per shape (torch.compile, Triton) pays each compile once. values, bias,
    ignore pattern, logit scale and hyperparameters are still drawn. hyperparameter_sets: > 0 makes each case's
    hyperparameters one of that many fixed draws per shape (for an implementation that specializes on their
    values); 0 draws them for every case. Both are the C++ case distribution's (verifier/case.h,
    CaseDistribution); the shrinker is not held to them: a shrunk counterexample may have any shape.

    capabilities: what fn declares it supports (SPEC "External implementations": dtypes, bias, label_smoothing,
    empty_sequence, invalid_inputs, max_shape, deterministic), a dict; default fn.capabilities when fn has one,
    else all of SPEC. Drawn cases outside it are excluded (report.excluded counts them by key), never failures;
    "deterministic" holds fn to identical bits on a rerun, and otherwise report.spread lists the run-to-run
    differences. profile and also_judge also take "bf16_logits" (strict's derivation for logits rounded to bf16
    before the softmax, as TRL's eager loss and Liger do).
    dtypes: the input dtypes cases draw from ("bf16", "f16", "f32"; each case one, uniformly), so fn is called with
    float16 or float32 arrays too; () draws bf16 only, the same cases as ever.
    """
    for p in (profile, *also_judge):
        if p not in ("strict", "bf16_logits", "peer"):
            raise _core.InputError(f"profile {p!r}: expected 'strict', 'bf16_logits' or 'peer'")
    if capabilities is None:
        capabilities = getattr(fn, "capabilities", None)
    declared = "" if capabilities is None else json.dumps(capabilities)
    judged = [p for p in dict.fromkeys(also_judge) if p != profile]
    name = name or _name_of(fn)

    def case(tensors, meta, gradients):
        try:
            return call(fn, tensors, meta, gradients, arrays, device)
        except Exception:
            if verbose_refusals:
                traceback.print_exc(file=sys.stderr)
            raise

    shape_list = []
    for sh in shapes:
        if len(sh) != 4 or not all(isinstance(v, int) or hasattr(v, "__index__") for v in sh):
            raise _core.InputError(f"shapes: {sh!r} is not a (B, T, H, V) tuple of integers")
        shape_list.append(tuple(int(v) for v in sh))
    raw = _core.sweep(case, name, seed, cases, time_budget_s, shrink, counterexample_dir or "",
                      stop_at_first_failure, profile, judged, shrink_attempts, shrink_seconds, shape_list,
                      int(hyperparameter_sets), declared, [str(d) for d in dtypes])
    return SweepReport(raw, profile)
