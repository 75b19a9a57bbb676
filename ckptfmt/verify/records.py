"""verify-resume for a loop on the manager that writes no summary.json: its run directory is the record.

A loop that saves through ``CheckpointManager`` leaves in {output} a run whose history holds, for
every step, its loss, its metrics and the digests of every piece of state the next step starts
from (spec/RUN.md §3.9), and whose newest generation holds the final weights, m and v. That is
what the protocol compares when there is no summary.json: step by step, each recorded component
(``loss``, ``metric.NAME``, ``rng.torch``, ``state.data``, ``lr.0``, ...) of a resumed run against
the continuous run's, and the final generations' regions by value. The checks table then names
the piece a resume broke, as it does for a loop that records its own summary.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ..run import timeline
from ..run.directory import Run
from ..run.causes import rank
from ..run import divergence
from ..run.divergence import outputs, states
from .deviation import Deviation, compare

REGIONS = ("weights", "m", "v")
_MISSING = object()


def has_run(output: Path) -> bool:
    """Whether ``output`` holds a run's history (a loop on the manager wrote there)."""
    return (output / ".loss.json").is_file()


def summary_of_run(output: Path) -> dict[str, Any]:
    """The summary of a run directory: ``records`` (its canonical step records), ``checkpoint``
    (the newest committed generation's ``.bin``, or its manifest for a sharded one: what the
    resume is given) and ``final`` (that generation's ``weights``, ``m``, ``v`` as arrays)."""
    run = Run(output)
    gen = run.latest()
    if gen is None:
        return {"records": list(timeline.canonical(run.history.source)), "checkpoint": None, "final": {}}
    with gen.open() as ck:
        final = {r: np.array(ck.region(r)) for r in REGIONS}
    name = gen.bin.name if gen.bin is not None else gen.manifest.name
    return {"records": list(timeline.canonical(run.history.source)), "checkpoint": name, "final": final}


def value_of(rec: dict[str, Any], component: str) -> Any:
    """One component of a step record (an output or a state digest), NaN and inf as floats."""
    found = outputs(rec).get(component, (states(rec) or {}).get(component, _MISSING))
    return float(found) if found in ("nan", "inf", "-inf") else found


def components(records: list[dict[str, Any]]) -> list[str]:
    """Every component the records hold, in the order of ``causes.rank`` as the diagnosis lists them."""
    names = {c for rec in records for c in (*outputs(rec), *(states(rec) or {}))}
    return sorted(names, key=rank)


def left_out(continuous: dict[str, Any], cut: dict[str, Any], ignore: Iterable[str] = ()) -> list[str]:
    """The digests left out of every check: those that differ in the first record of the
    continuous run and the cut run (both from scratch) while its loss agrees, by the rule
    ``bisect`` applies (``divergence.from_start``): an RNG the loop neither seeds nor draws from."""
    ra, rb = (next(iter(run["records"]), None) for run in (continuous, cut))
    if ra is None or rb is None or ra["step"] != rb["step"]:
        return []
    return divergence.from_start(ra, rb, ignore)


def check_records(reference: dict[str, Any], candidate: dict[str, Any], cut: int, atol: float, rtol: float,
                  *, final: bool = True, ignore: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """Per-check verdicts of ``candidate`` against ``reference`` (the continuous run) over the
    steps after ``cut``: ``steps``, each recorded component, and (``final``) the last
    generations' regions. A digest that differs fails its check and says at which step first.
    The components in ``ignore`` (``rng.numpy``, or ``step_s`` for ``metric.step_s``: a metric
    that measures time) are not checked."""
    ref = [r for r in reference["records"] if r["step"] > cut]
    cand = candidate["records"]
    out = {"steps": _check([r["step"] for r in ref], [r["step"] for r in cand], atol, rtol)}
    skip = set(ignore)
    for name in components(ref + cand):
        if name not in skip and name.removeprefix("metric.") not in skip:
            out[name] = _component(name, ref, cand, atol, rtol)
    for region in REGIONS if final else ():
        out[region] = _region(reference["final"].get(region), candidate["final"].get(region), atol, rtol)
    return out


def _check(a: Any, b: Any, atol: float, rtol: float, name: str = "steps") -> dict[str, Any]:
    dev = Deviation()
    hit = compare(a, b, name, dev, atol, rtol)
    return {"max_deviation": dev.max_abs, "ok": dev.ok(atol, hit), "structural": dev.structural[:5],
            "non_finite": dev.non_finite[:5]}


def _component(name: str, ref: list[dict[str, Any]], cand: list[dict[str, Any]], atol: float, rtol: float) -> dict[str, Any]:
    """One component step by step: numbers within the tolerance, anything else (a digest) equal."""
    dev, first, by_step = Deviation(), None, {r["step"]: r for r in cand}
    for rec in ref:
        a = value_of(rec, name)
        b = value_of(by_step[rec["step"]], name) if rec["step"] in by_step else _MISSING
        if a is _MISSING or b is _MISSING:
            dev.structural.append(f"{name}: step {rec['step']}: missing in {'reference' if a is _MISSING else 'candidate'}")
        elif _number(a) and _number(b):
            if compare(a, b, f"{name}[{rec['step']}]", dev, atol, rtol) and first is None:
                first = rec["step"]
        elif a != b and first is None:
            first = rec["step"]
    return {"max_deviation": dev.max_abs, "ok": first is None and dev.ok(atol, False),
            "structural": dev.structural[:5], "non_finite": dev.non_finite[:5], "first_difference": first}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _region(a: np.ndarray | None, b: np.ndarray | None, atol: float, rtol: float) -> dict[str, Any]:
    """A final generation's region by value: the largest deviation, within ``atol + rtol |b|``."""
    out: dict[str, Any] = {"max_deviation": 0.0, "ok": False, "structural": [], "non_finite": []}
    if a is None or b is None or a.shape != b.shape:
        out["structural"] = ["no final generation in " + ("reference" if a is None else "candidate")
                             if a is None or b is None else f"sizes {a.size} != {b.size}"]
        return out
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(a64) & np.isfinite(b64)
    if not finite.all():
        out["non_finite"] = [f"{int(np.count_nonzero(~finite))} non-finite values"]
    delta = np.abs(a64 - b64)[finite]
    out["max_deviation"] = float(delta.max()) if delta.size else 0.0
    out["ok"] = finite.all() and bool((delta <= atol + rtol * np.abs(b64[finite])).all()) \
        and not math.isnan(out["max_deviation"])
    return out
