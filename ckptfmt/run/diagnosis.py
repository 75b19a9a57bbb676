"""Why two runs part: the first step at which they differ and the first piece of state that differs
there (spec/RUN.md §6.5), for ``bisect``.

Two sources say where: the histories' step records (the loss and metrics each step put out, and
the state digests a writer records: what step k+1 starts from, at step k) and the generations
both runs committed (weights, m and v by parameter name, the companion's tensors). The earlier of
the two firsts is the step named. Of what differs there, the piece that comes first in the order
of what feeds what (``causes.rank``) is named, with its likely causes (``causes.TABLE``); what is
equal is listed too, since what agrees rules causes out. When only the loss or a metric differs
and every digest is equal, what differs is something no digest covers: the message says so, and
the generations at and before that step say whether the weights and moments were the same.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..generation import Generation
from . import causes
from .divergence import Comparison, Parting, Records, states

SHOWN = 6          # tensors named per region in a message (the JSON lists them all)
MOMENTS_FIRST = ("m", "v", "weights")   # a step's update reads the moments: they name the cause first


def differing_tensors(a: Generation, b: Generation) -> dict[str, list[str]]:
    """region -> the parameters (by name, in A's layout order) whose values differ bit for bit
    between two generations of the same parameters, for ``m``, ``v``, ``weights``, and
    ``companion`` -> the companion tensors that differ or are in one only. A generation without
    a layout names its region's differing element range instead."""
    with a.open() as ca, b.open() as cb:
        out: dict[str, list[str]] = {}
        rows = {r["name"]: r for r in (cb.layout or [])}
        for region in MOMENTS_FIRST:
            ra, rb = ca.region(region), cb.region(region)
            names = [row["name"] for row in ca.layout or [] if _differs(ra, rb, row, rows.get(row["name"]))]
            if not ca.layout and ra.size == rb.size and not np.array_equal(ra.view(np.uint32), rb.view(np.uint32)):
                names = [f"elements {int(np.argmax(ra.view(np.uint32) != rb.view(np.uint32)))}.."]
            if names:
                out[region] = names
        companions = _companion_differs(ca.companion(), cb.companion())
        if companions:
            out["companion"] = companions
    return out


def _differs(ra: np.ndarray, rb: np.ndarray, row: dict[str, Any], other: dict[str, Any] | None) -> bool:
    if other is None or list(other["shape"]) != list(row["shape"]):
        return True
    n = int(np.prod(row["shape"], dtype=np.int64))
    x, y = ra[row["offset"]:row["offset"] + n], rb[other["offset"]:other["offset"] + n]
    return not np.array_equal(x.view(np.uint32), y.view(np.uint32))


def _companion_differs(fa: Any, fb: Any) -> list[str]:
    names_a, names_b = set(fa.names()) if fa else set(), set(fb.names()) if fb else set()
    out = names_a ^ names_b
    for name in names_a & names_b:
        ta, tb = fa.tensor(name), fb.tensor(name)
        if ta.dtype != tb.dtype or ta.shape != tb.shape or ta.tobytes() != tb.tobytes():
            out.add(name)
    return sorted(out)


def diagnose(parted: Parting, gens: tuple[dict[int, Generation], dict[int, Generation]],
             first_gen: int | None, resumes: tuple[list[int], list[int]], records: Records,
             compared: bool = True) -> dict[str, Any]:
    """The diagnosis of ``bisect``: ``step`` (None: identical), ``component`` (the piece named),
    ``differ`` / ``equal`` / ``one_only`` (the components of that step's records), ``tensors``
    (region -> parameter names, where a generation at that step differs), ``before`` (the newest
    common generation before the step, identical), ``what``, ``causes`` and ``message``;
    ``from_start``: the digests left out, as they differ from the runs' first record on;
    ``compared``: False where a run's generations are not compared (a Trainer's output directory:
    the histories alone say where)."""
    steps = [s for s in (parted.step, first_gen) if s is not None]
    from_start = records.from_start or []
    if not steps:
        return {"step": None, "component": None, "from_start": from_start, "message": "identical" + _from_start(from_start)}
    step = min(steps)
    common = sorted(set(gens[0]) & set(gens[1]))
    before = max((s for s in common if s < step), default=None)
    out: dict[str, Any] = {"step": step, "before": before, "differ": [], "equal": [], "one_only": [], "tensors": {},
                           "from_start": from_start, "compared": compared}
    if first_gen == step:
        try:
            out["tensors"] = differing_tensors(gens[0][step], gens[1][step])
        except (CheckpointError, OSError) as exc:     # removed by a live run's retention since, damaged
            out["tensors_problem"] = str(exc)
    if parted.step == step and (parted.a is None or parted.b is None):
        out["component"] = "step"
        out["only_in"] = "a" if parted.b is None else "b"
    else:
        pair = (parted.a, parted.b) if parted.step == step else parted.watched
        found = records.compare(*pair) if None not in pair else Comparison()
        out.update(differ=found.differ, equal=found.equal, one_only=found.one_only)
        out["values"] = numeric_values(found, *pair) if None not in pair else {}
        out["component"] = _named(found, out["tensors"])
    out["resumed"] = {"a": [s for s in resumes[0] if s < step], "b": [s for s in resumes[1] if s < step]}
    out["what"], out["causes"] = causes.for_step(out["component"], any(out["resumed"].values()))
    out["message"] = message(out)
    return out


def numeric_values(found: Comparison, ra: dict[str, Any], rb: dict[str, Any]) -> dict[str, list[Any]]:
    """component -> [A's, B's] for the digests that differ and are held as numbers (``lr.G``,
    ``optimizer.step``, ``amp.scale``: spec/RUN.md §3.9): the values say more than "differs"
    (an lr a new scheduler wrote, a step count one behind)."""
    sa, sb = states(ra) or {}, states(rb) or {}
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    return {c: [sa[c], sb[c]] for c in found.state_differs() if number(sa.get(c)) and number(sb.get(c))}


def _valued(name: str, values: dict[str, list[Any]]) -> str:
    """``optimizer.step (A 2, B 1: B's step count did not advance: a skipped update)``, or the
    name alone where the component is not a number (the message puts the values after "differs")."""
    if name not in values:
        return name
    a, b = values[name]
    said = f"{name} (A {a:g}, B {b:g}"
    if name == "optimizer.step":
        behind, by = ("B", a - b) if a > b else ("A", b - a)
        said += (f": {behind}'s step count did not advance: a skipped update" if by == 1 else
                 f": {behind}'s step count is {by:g} behind: skipped updates or an optimizer reset")
    return said + ")"


def _named(found: Comparison, tensors: dict[str, list[str]]) -> str:
    """The piece a step's differences name first: a digest that differs (the earliest in the
    order of ``causes.rank``), else what no digest covers (the loss differs), else a metric,
    else the first region of a generation that differs."""
    state = found.state_differs()
    if state:
        return state[0]
    if "loss" in found.differ:
        return "undigested" if found.digested else "loss"
    if found.differ:
        return found.differ[0]
    return next((r for r in (*MOMENTS_FIRST, "companion") if r in tensors), "weights")


def message(d: dict[str, Any]) -> str:
    """``step 13: rng.torch differs (also: loss); weights, m and v at step 12 identical; identical:
    ... -> torch's CPU RNG: likely causes``: the diagnosis in one line."""
    step, component = d["step"], d["component"]
    also = [c for c in d["differ"] if c != component]
    if component == "step":
        said = [f"step {step}: recorded by run {d['only_in'].upper()} only"]
    elif component == "undigested":
        said = [f"step {step}: the loss differs and every digest is identical: the weights step {step} began "
                f"from differ (step {step - 1}'s update differed, or the weights or moments were changed after "
                "its record)"]
        also = [c for c in also if c != "loss"]
    else:
        valued = _valued(component, d.get("values", {}))
        said = [f"step {step}: {component} differs{valued[len(component):]}"]
    if also:
        said[0] += f" (also: {', '.join(_valued(c, d.get('values', {})) for c in also)})"
    if d["tensors"]:
        said.append(f"generation {step} differs in " + "; ".join(_names(r, n) for r, n in d["tensors"].items()))
    if d.get("tensors_problem"):
        said.append(f"generation {step}'s tensors not read: {d['tensors_problem']}")
    said.append(f"weights, m and v at step {d['before']} identical" if d["before"] is not None
                else "no generation of both runs before it to compare" if d.get("compared", True)
                else "generations not compared: from the histories alone")
    if d["one_only"]:
        said.append(f"recorded by one run only: {', '.join(d['one_only'])}")
    said[-1] += _from_start(d["from_start"])
    if d["equal"]:
        said.append(f"identical: {', '.join(d['equal'])}")
    resumed = [f"{run.upper()} resumed at step {s[-1]}" for run, s in d["resumed"].items() if s]
    if resumed:
        said.append(", ".join(resumed))
    return "; ".join(said) + f" -> {d['what']}: {d['causes']}"


def _from_start(names: list[str]) -> str:
    if not names:
        return ""
    return (f" ({', '.join(names)} differ{'s' * (len(names) == 1)} from the first record on: a difference of the runs "
            "(an RNG neither seeds), not of a resume: left out)")


def _names(region: str, names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN]) + (f" (+{len(names) - SHOWN} more)" if len(names) > SHOWN else "")
    return f"{region} {shown}"
