"""The retention policy (spec/RUN.md §5): one pure ``plan``, a kept set that is exactly the union
of its rules, the pins and the guards, over random runs (hypothesis; CKPTFMT_PROPERTY_EXAMPLES
sets the budget, as in tests/manager/test_mapping_properties.py)."""
from __future__ import annotations

import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfmt.run import Candidate, Policy, parse_duration, plan, plan_retention
from ckptfmt.run.retention import candidate

PROPERTY = settings(max_examples=int(os.environ.get("CKPTFMT_PROPERTY_EXAMPLES", "25")) * 4, deadline=None)

VALUES = st.one_of(st.floats(-10, 10), st.sampled_from([math.nan, math.inf, -math.inf]))


@st.composite
def runs(draw):
    """(candidates, pins, diverged steps) of a random run."""
    steps = sorted(draw(st.sets(st.integers(0, 60).map(lambda s: s * 10), min_size=1, max_size=12)))
    gens = []
    for step in steps:
        metrics = {} if draw(st.booleans()) and draw(st.booleans()) else {"val_loss": draw(VALUES)}
        when = draw(st.one_of(st.none(), st.integers(0, 40 * 3600).map(float)))
        gens.append(Candidate(step, metrics, when))
    pins = draw(st.sets(st.sampled_from(steps + [9999])))
    diverged = draw(st.sets(st.sampled_from(steps)))
    return gens, pins, diverged


POLICIES = st.fixed_dictionaries({
    "keep_last": st.none() | st.integers(1, 4), "keep_every": st.none() | st.integers(1, 100),
    "keep_best": st.none() | st.integers(1, 3), "mode": st.sampled_from(["min", "max"]),
    "keep_missing": st.booleans(), "keep_within": st.none() | st.integers(1, 20 * 3600),
    "keep_interval": st.none() | st.integers(1, 10 * 3600)}).map(
    lambda p: Policy(**p, metric="val_loss" if p["keep_best"] else None)
    if any(p[k] is not None for k in ("keep_last", "keep_every", "keep_best", "keep_within", "keep_interval"))
    else Policy.KEEP_ALL)                   # no rule drawn: the explicit keep-everything value


def guards(gens, diverged):
    """The guards ``Run.plan_gc`` passes: the newest (valid) and the newest finite generation."""
    steps = [g.step for g in gens]
    finite = [s for s in steps if s not in diverged]
    out = {max(steps): "newest valid"}
    if finite:
        out.setdefault(max(finite), "newest finite")
    return out


def by_rule(policy, gens):
    """Each rule restated directly from spec/RUN.md §5.1, as {step}."""
    steps = [g.step for g in gens]
    if policy.keep_all:
        return set(steps)
    kept = set(steps[-policy.keep_last:]) if policy.keep_last else set()
    kept |= {s for s in steps if policy.keep_every and s % policy.keep_every == 0}
    if policy.keep_best:
        finite = [g for g in gens if policy.metric in g.metrics and math.isfinite(g.metrics[policy.metric])]
        sign = 1 if policy.mode == "min" else -1
        kept |= {g.step for g in sorted(finite, key=lambda g: (sign * g.metrics["val_loss"], -g.step))[:policy.keep_best]}
        kept |= {g.step for g in gens if policy.keep_missing and policy.metric not in g.metrics}
    if policy.keep_within or policy.keep_interval:
        kept |= {g.step for g in gens if g.committed_at is None}
        timed = [g for g in gens if g.committed_at is not None]
        if policy.keep_within and timed:
            newest = max(g.committed_at for g in timed)
            kept |= {g.step for g in timed if newest - g.committed_at <= policy.keep_within}
        for bucket in {math.floor(g.committed_at / policy.keep_interval) for g in timed} if policy.keep_interval else ():
            first = min((g for g in timed if math.floor(g.committed_at / policy.keep_interval) == bucket),
                        key=lambda g: (g.committed_at, g.step))
            kept.add(first.step)
    return kept


@PROPERTY
@given(runs(), POLICIES)
def test_the_kept_set_is_the_union_of_the_rules_pins_and_guards(run, policy):
    gens, pins, diverged = run
    protect = guards(gens, diverged)
    result = plan(policy, gens, pinned=pins, protect=protect)
    steps = {g.step for g in gens}
    assert set(result.kept) | set(result.doomed) == steps and not set(result.kept) & set(result.doomed)
    assert set(result.kept) == by_rule(policy, gens) | (pins & steps) | set(protect)
    assert set(protect) <= set(result.kept) and pins & steps <= set(result.kept)       # the guards hold
    assert all(result.kept[s] for s in result.kept)                                     # each says why


@PROPERTY
@given(runs(), st.integers(1, 3), st.sampled_from(["min", "max"]))
def test_a_non_finite_value_is_never_best(run, k, mode):
    gens, _, _ = run
    result = plan(Policy(keep_best=k, metric="val_loss", mode=mode, keep_missing=False), gens)
    for step, why in result.kept.items():
        value = next(g for g in gens if g.step == step).metrics["val_loss"]
        assert why == ["best val_loss"] and math.isfinite(value)


@PROPERTY
@given(runs(), st.integers(1, 5 * 3600))
def test_a_generation_kept_by_interval_stays_kept_as_the_run_grows(run, interval):
    gens, _, _ = run
    policy = Policy(keep_interval=interval)
    before = {s for s, why in plan(policy, gens).kept.items() if "interval" in why}
    later = max((g.committed_at or 0 for g in gens)) + 1
    grown = gens + [Candidate(max(g.step for g in gens) + 10, {}, later + k * 600.0) for k in range(5)]
    after = {s for s, why in plan(policy, grown).kept.items() if "interval" in why}
    assert before <= after


def test_reasons_name_each_rule_and_guard():
    gens = [Candidate(100, {"val_loss": 3.0}, 0.0), Candidate(200, {"val_loss": math.nan}, 3600.0),
            Candidate(300, {"val_loss": 1.0}, 7200.0), Candidate(400, {}, 7300.0), Candidate(500, {"val_loss": 2.0})]
    result = plan(Policy(keep_last=1, keep_best=1, metric="val_loss", keep_within=200), gens,
                  pinned=[100], protect={400: "newest finite"})
    assert result.kept == {100: ["pinned"], 300: ["best val_loss", "within"], 400: ["no val_loss", "within", "newest finite"],
                           500: ["last", "no commit time"]}
    assert result.doomed == [200]


def test_the_step_only_form_is_the_same_plan():
    assert plan_retention([100, 200, 300, 400, 500], keep_last=2, keep_every=200, pinned=[100],
                          protect=[300]) == []
    assert plan_retention([1, 2, 3], keep_last=1) == [1, 2]
    with pytest.raises(ValueError, match="keep_last"):
        plan_retention([1], keep_last=0)


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("30m", 1800), ("6h", 21600), ("2d", 172800)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "6", "h", "0h", "-1h", "1.5h", "6H", "6 hours", "1w", "6h30m"])
def test_anything_else_is_not_a_duration(text):
    with pytest.raises(ValueError, match="not a duration.*90s, 30m, 6h, 2d"):
        parse_duration(text)


@pytest.mark.parametrize("fields,match", [({"keep_best": 2}, "metric"), ({"metric": "loss"}, "metric"),
                                          ({"keep_last": 0}, "keep_last"), ({"keep_every": True}, "keep_every"),
                                          ({"keep_best": 1, "metric": "x", "mode": "best"}, "mode"),
                                          ({}, r"needs a keep rule.*Policy\.KEEP_ALL keeps every generation"),
                                          ({"keep_within": None, "metric": None}, "needs a keep rule"),
                                          ({"keep_all": True, "keep_last": 1}, "takes no other rule"),
                                          ({"keep_all": 1}, "takes no other rule")])
def test_a_policy_that_cannot_be_is_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        Policy(**fields)


def test_the_keep_everything_policy_keeps_every_generation_and_is_recorded_as_such():
    gens = [Candidate(s) for s in (10, 20, 30)]
    assert plan(Policy.KEEP_ALL, gens).kept == {10: ["keep all"], 20: ["keep all"], 30: ["keep all"]}
    assert Policy.KEEP_ALL.to_json() == {"keep_all": True} and Policy.from_json({"keep_all": True}) == Policy.KEEP_ALL


def test_a_candidate_from_a_manifest():
    doc = {"created": 12.5, "metrics": {"val_loss": {"value": {"__float__": "nan"}, "step": 300},
                                        "loss": {"value": 2, "step": 300}, "odd": {"value": "x"}, "bad": 3}}
    got = candidate(300, doc)
    assert got.committed_at == 12.5 and got.metrics["loss"] == 2.0 and math.isnan(got.metrics["val_loss"])
    assert set(got.metrics) == {"loss", "val_loss"}
    assert candidate(1, {"step": 1}) == Candidate(1) and candidate(1, None) == Candidate(1)
