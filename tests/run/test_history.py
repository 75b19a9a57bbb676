"""The streamed history is the history as it was read whole: the same
canonical records, counts, warnings and problems, the same first difference for bisect, and
plot's downsampled curve keeps the lowest and highest loss of each bucket.

The oracle is the reader as it was before streaming (``old_read``, ``old_canonical``,
``old_series_curve`` below, copied verbatim from the code they replaced), run on the same
files: random histories with resumes, forks, re-done steps, out-of-order and repeated steps,
NaN losses, torn and NUL-filled tails and damage in the middle.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ckptfmt.errors import HistoryCorruptError
from ckptfmt.run import history as hist
from ckptfmt.run import timeline
from ckptfmt.run.divergence import first_loss_difference
from ckptfmt.run.ops import bisect
from ckptfmt.tools.plot import Curve, series


# ---------------------------------------------------------------- the oracle: the reader before streaming
def old_read(path, length=None) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """(records, warnings, problems) exactly as ``history.read`` computed them in memory."""
    records, warnings, problems = [], [], []
    with open(path, "rb") as f:
        lines = f.read(-1 if length is None else length).split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    bad: list[int] = []
    for i, raw in enumerate(lines):
        rec = old_parse(raw) if raw.strip(b"\0 \r") else None
        if rec is None:
            bad.append(i)
            continue
        if bad and bad[-1] == i - 1 and rec.get("event") == "resume":
            warnings.append(f"{path}: line {i}: torn line before a resume marker (recovered)")
        elif bad and bad[-1] == i - 1:
            problems.append(f"{path}: line {bad[-1] + 1}: corrupt record in the middle of the history")
        records.append(rec)
    if bad and bad[-1] == len(lines) - 1:
        warnings.append(f"{path}: line {len(lines)}: torn last line ignored")
    return records, warnings, problems


def old_parse(line: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
        return None
    return rec


def old_canonical(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_step: dict[int, dict[str, Any]] = {}
    for rec in records:
        if rec.get("event") in ("resume", "fork", "start"):
            cut = rec["step"]
            by_step = {s: r for s, r in by_step.items() if s <= cut}
        elif "event" not in rec:
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def old_first_difference(canon_a, canon_b) -> int | None:
    losses = [{r["step"]: r.get("loss") for r in c} for c in (canon_a, canon_b)]
    steps = sorted(set(losses[0]) | set(losses[1]))
    return next((s for s in steps if losses[0].get(s, "missing") != losses[1].get(s, "missing")), None)


# ---------------------------------------------------------------- random histories
LOSS = st.one_of(st.floats(0.5, 9.0), st.sampled_from(["nan", "inf", "-inf", "1.5", [1], True, 2 ** 70, {"a": 1}]),
                 st.integers(0, 3), st.none())
LINE = st.one_of(
    st.tuples(st.just("step"), st.integers(0, 40), LOSS, st.sampled_from(["code", "topics", None])),
    st.tuples(st.just("event"), st.sampled_from(["resume", "fork", "checkpoint", "pivot", "start"]),
              st.integers(0, 40)),
    st.tuples(st.just("junk"), st.sampled_from([b"XXXX", b"", b"\0\0\0", b'{"step": 4, "lo', b"[1, 2]",
                                                b'{"step": "7"}', b'{"step": 1.5}', b"  \r",
                                                b'{"step": 99999999999999999999}', b'{"step": 2} ',
                                                b'{"step": 2}\r', b'{"step": 2}x', b' {"step": 2}',
                                                b'\xef\xbb\xbf{"step": 2}', '{"step": 2}'.encode("utf-16-le"),
                                                b'{"step": 2, "a": "\xff"}', b'{"step": 2, "a": "\xed\xa0\x80"}',
                                                b'{"step": 2, "loss": NaN}', b'{"step": 2}{"step": 3}',
                                                b'{"step": 2, "step": 5}', b'{"step": true, "loss": 1}'])),
)


def render(lines) -> bytes:
    """The bytes of a history made of step records, events and damaged lines."""
    out = []
    for line in lines:
        if line[0] == "step":
            rec = {"step": line[1]}
            if line[2] is not None:
                rec["loss"] = line[2]
            if line[3] is not None:
                rec["source"] = line[3]
            out.append(json.dumps(rec).encode())
        elif line[0] == "event":
            out.append(json.dumps({"event": line[1], "step": line[2]}).encode())
        else:
            out.append(line[1])
    return b"\n".join(out)


HISTORY = st.tuples(st.lists(LINE, max_size=60), st.sampled_from([b"", b"\n", b"\0\0\0\0", b'{"step":3,"lo']))


def write(tmp_path, name, history) -> str:
    lines, tail = history
    path = tmp_path / name
    path.write_bytes(render(lines) + (b"\n" if lines else b"") + tail)
    return str(path)


# ---------------------------------------------------------------- the reader
@settings(max_examples=300, deadline=None)
@given(history=HISTORY, data=st.data())
def test_streamed_history_is_the_history_read_whole(tmp_path_factory, history, data):
    path = write(tmp_path_factory.mktemp("h"), ".loss.json", history)
    size = len(open(path, "rb").read())
    for length in (None, data.draw(st.integers(0, size), label="length")):
        records, warnings, problems = old_read(path, length)
        got = hist.read(path, length)
        assert (got.records, got.warnings, got.problems) == (records, warnings, problems)
        found = hist.survey(path, length)
        assert (found.record_count, found.warnings, found.problems) == (len(records), warnings, problems)
        canon = hist.index(path, length, events=("resume", "pivot"))
        assert list(canon.records()) == old_canonical(records) == got.canonical()
        assert list(canon.steps) == [r["step"] for r in old_canonical(records)]
        assert canon.events == [(r["event"], r["step"]) for r in records if r.get("event") in ("resume", "pivot")]
        lean = hist.index(path, length, offsets=False)
        assert list(lean.steps) == list(canon.steps) and lean.offsets is None
        assert (canon.warnings, canon.problems) == (warnings, problems)
        for parse in (False, True):
            plan = timeline.plan(path, length, events=("resume", "pivot"), parse=parse)
            assert list(plan.records()) == old_canonical(records)
            assert plan.events == canon.events
            assert_last_step(plan, old_canonical(records))


def assert_last_step(plan: timeline.Timeline, canon: list) -> None:
    """The plan's last step is the last canonical step (None: no records), before any record is
    read back (also where the history ends in a resume between two records' steps)."""
    assert plan.last_step == (canon[-1]["step"] if canon else None)


# A trainer's history: steps go forward; a crash loses the steps after the last generation and
# the run resumes from it (or a fork starts from an earlier one), sometimes after a torn append.
TRAINER_LINE = st.one_of(
    st.tuples(st.just("steps"), st.integers(1, 12), st.integers(1, 3)),       # how many, stride
    st.tuples(st.just("back"), st.sampled_from(["resume", "fork"]), st.integers(0, 20)),
    st.tuples(st.just("event"), st.sampled_from(["checkpoint", "pivot", "start"])),
    st.tuples(st.just("torn"), st.sampled_from([b'{"step": 4, "lo', b"\0\0\0", b"XXXX"])),
    # a line that looks like a writer's record up to its step and is not one (read unparsed in the
    # first pass, found in the second): near the current step, before, at or after it
    st.tuples(st.just("looks"), st.integers(-3, 3), st.sampled_from([
        b',"lo', b',"loss":1}x', b',"loss":}', b',"loss":1}{"a":1}', b'5,"loss":1}', b',"loss":NaN}',
        b',"loss":1,"note":"\xff"}', b',"loss":1} ', b"}", b',"event":"resume"}', b',"step":1}'])),
)


def trainer_history(path, plan) -> None:
    """Render a trainer-like plan: every record's step above the last one kept (forward only)."""
    out, step = [], 0
    for item in plan:
        if item[0] == "steps":
            for _ in range(item[1]):
                step += item[2]
                out.append(json.dumps({"step": step, "loss": step / 7 if step % 5 else "nan"}).encode())
        elif item[0] == "back":
            step = max(0, step - item[2])
            out.append(json.dumps({"event": item[1], "step": step}).encode())
        elif item[0] == "event":
            out.append(json.dumps({"event": item[1], "step": step}).encode())
        elif item[0] == "looks":
            out.append(b'{"step":%d' % max(0, step + item[1]) + item[2])
        else:
            out.append(item[1])
    path.write_bytes(b"".join(line + b"\n" for line in out))


@settings(max_examples=600, deadline=None)
@given(plan=st.lists(TRAINER_LINE, max_size=40), data=st.data())
def test_a_trainers_history_is_read_in_segments(tmp_path_factory, plan, data):
    """Forward-only histories (what the trainer and the manager write) take the two-pass path,
    and give the canonical records read whole; a prefix (a live run) too."""
    path = tmp_path_factory.mktemp("t") / ".loss.json"
    trainer_history(path, plan)
    size = path.stat().st_size
    for length in (None, data.draw(st.integers(0, size), label="length")):
        records = old_read(path, length)[0]
        got = timeline.plan(path, length, events=("resume", "fork"))
        assert got.forward or any(item[0] in ("looks", "torn") for item in plan)   # misread: replanned
        assert list(got.records()) == old_canonical(records)
        assert got.events == [(r["event"], r["step"]) for r in records if r.get("event") in ("resume", "fork")]
        if got.forward:
            assert len(got.segments) <= 1 + sum(1 for item in plan if item[0] in ("back", "looks", "torn"))
        assert_last_step(got, old_canonical(records))


def test_a_run_with_resumes_and_redone_steps(tmp_path):
    """A trainer's history: crashes after steps 7 and 15, resumes from 5 and 12, the steps in
    between done again; a torn append before the second resume."""
    h = hist.History(tmp_path / ".loss.json")
    for s in range(1, 8):
        h.append({"step": s, "loss": 10.0 - s})
    h.event("resume", 5)
    for s in range(6, 16):
        h.append({"step": s, "loss": 20.0 - s})
    h.close()
    with open(tmp_path / ".loss.json", "ab") as f:
        f.write(b'{"step":16,"lo')
    h.event("resume", 12)
    for s in range(13, 18):
        h.append({"step": s, "loss": hist.encode_float(math.nan) if s == 14 else 30.0 - s})
    h.close()
    canon = hist.index(tmp_path / ".loss.json")
    got = [(r["step"], r["loss"]) for r in canon.records()]
    assert got == [(s, 10.0 - s) for s in range(1, 6)] + [(s, 20.0 - s) for s in range(6, 13)] \
        + [(13, 17.0), (14, "nan"), (15, 15.0), (16, 14.0), (17, 13.0)]
    assert len(canon) == 17 and canon.warnings and not canon.problems
    assert "torn line before a resume marker" in canon.warnings[0]


def test_corruption_in_the_middle_gives_the_same_problem(tmp_path):
    path = tmp_path / ".loss.json"
    path.write_bytes(b'{"step": 1, "loss": 1.0}\nXXXX\n{"step": 3, "loss": 3.0}\n')
    expected = f"{path}: line 2: corrupt record in the middle of the history"
    assert hist.survey(path).problems == [expected] == hist.index(path).problems == old_read(path)[2]
    assert [r["step"] for r in hist.index(path).records()] == [1, 3]


def test_the_index_holds_positions_not_records(tmp_path):
    """16 bytes per canonical step, whatever the records hold; a missing history is empty."""
    h = hist.History(tmp_path / ".loss.json")
    for s in range(1, 1001):
        h.append({"step": s, "loss": 1.0, "note": "x" * 200})
    h.close()
    canon = hist.index(tmp_path / ".loss.json")
    assert canon.steps.itemsize == canon.offsets.itemsize == 8 and len(canon) == 1000
    assert next(canon.records(999))["step"] == 1000
    with pytest.raises(ValueError, match="without offsets"):
        next(hist.index(tmp_path / ".loss.json", offsets=False).records())
    missing = hist.index(tmp_path / "missing.json")
    assert len(missing) == 0 and list(missing.records()) == [] and hist.survey(tmp_path / "missing.json").record_count == 0


def test_a_trainers_history_is_streamed_in_a_few_numbers_per_resume(tmp_path):
    """60,000 steps and three crashes: four segments, and reading the canonical history back
    holds no more than a few lines (the index of the same history holds 16 bytes a step)."""
    import tracemalloc
    h = hist.History(tmp_path / ".loss.json")
    step = 0
    for crash in (20_000, 40_000, 60_000, None):
        while step < (crash or 60_000):
            step += 1
            h.append({"step": step, "loss": 2.5, "lr": 3e-4, "source": "code"})
        if crash:
            h.event("resume", step - 50)
            step -= 50
    h.close()
    tracemalloc.start()
    try:
        plan = timeline.plan(tmp_path / ".loss.json")
        steps = [0, 0]
        for rec in plan.records():
            steps = [steps[1], rec["step"]] if rec["step"] == steps[1] + 1 else [-1, -1]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert plan.forward and len(plan.segments) == 4 and steps[1] == 60_000
    assert [(s.first, s.last) for s in plan.segments] == [(1, 19_950), (19_951, 39_950), (39_951, 59_950),
                                                          (59_951, 60_000)]
    assert peak < 256 << 10, peak
    tracemalloc.start()
    try:
        hist.index(tmp_path / ".loss.json")
        _, index_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index_peak > 16 * 60_000


def test_a_step_beyond_64_bits_is_kept(tmp_path):
    path = tmp_path / ".loss.json"
    path.write_bytes(b'{"step": 1}\n{"step": 9223372036854775808}\n{"step": -9223372036854775809}\n{"step": 2}\n')
    canon = hist.index(path)
    assert list(canon.records()) == old_canonical(old_read(path)[0]) and len(canon) == 4


# ---------------------------------------------------------------- bisect
@settings(max_examples=200, deadline=None)
@given(a=HISTORY, b=HISTORY, shared=st.lists(LINE, max_size=30))
def test_first_loss_difference_is_the_one_found_in_memory(tmp_path_factory, a, b, shared):
    d = tmp_path_factory.mktemp("b")
    pa = write(d, "a.json", (shared + a[0], a[1]))
    pb = write(d, "b.json", (shared + b[0], b[1]))
    expected = old_first_difference(old_canonical(old_read(pa)[0]), old_canonical(old_read(pb)[0]))
    ca, cb = (old_canonical(old_read(p)[0]) for p in (pa, pb))
    assert first_loss_difference(timeline.canonical(pa), timeline.canonical(pb)) == (expected, [len(ca), len(cb)])
    assert first_loss_difference(timeline.canonical(pa), timeline.canonical(pa)) == \
        (old_first_difference(ca, ca), [len(ca)] * 2)


SMALL = st.sampled_from([1.0, 2.0, -0.0, 0.0, 0, 1, True, "nan", "inf", math.nan, None, [1], "no loss"])


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.integers(0, 30), unique=True, max_size=30), data=st.data())
def test_first_loss_difference_of_histories_with_the_same_steps(tmp_path_factory, steps, data):
    """The same steps on both sides (the common case, walked in step) with losses of every
    kind: floats, -0.0, ints, bools, strings, a NaN literal, null, a list, no loss at all."""
    d = tmp_path_factory.mktemp("s")
    paths = []
    for name in ("a", "b"):
        lines = []
        for s in steps:
            loss = data.draw(SMALL, label=f"{name}{s}")
            lines.append(json.dumps({"step": s} if loss == "no loss" else {"step": s, "loss": loss}))
        paths.append(d / f"{name}.json")
        paths[-1].write_text("".join(line + "\n" for line in lines))
    expected = old_first_difference(*[old_canonical(old_read(p)[0]) for p in paths])
    assert first_loss_difference(*[timeline.canonical(p) for p in paths]) == (expected, [len(steps)] * 2)


def test_bisect_of_runs_without_generations(tmp_path):
    for name, losses in (("a", [1.0, 2.0, "nan"]), ("b", [1.0, 2.0, "nan", 4.0])):
        (tmp_path / name).mkdir()
        h = hist.History(tmp_path / name / ".loss.json")
        for s, x in enumerate(losses, 1):
            h.append({"step": s, "loss": x})
        h.close()
    r = bisect(tmp_path / "a", tmp_path / "b")
    assert r["first_history_difference"] == 4 and r["history_steps"] == [3, 4] and not r["identical"]


# ---------------------------------------------------------------- plot
def old_series_curve(canon, ema):
    steps = [r["step"] for r in canon]
    loss = [hist.decode_float(r["loss"]) if "loss" in r else math.nan for r in canon]   # none: a gap
    smooth, acc = [], None
    for x in loss:
        acc = x if acc is None or acc != acc else ema * acc + (1 - ema) * x
        smooth.append(acc)
    return steps, loss, smooth


def old_shares(canon, window):
    sources = sorted({r.get("source") for r in canon if r.get("source")})
    shares: dict[str, list[float]] = {s: [] for s in sources}
    share_steps = []
    for start in range(0, len(canon), window):
        block = Counter(r.get("source") for r in canon[start:start + window])
        chunk = canon[start:start + window]
        share_steps.append((chunk[0]["step"] + chunk[-1]["step"]) / 2)
        for s in sources:
            shares[s].append(block[s] / sum(block.values()))
    return share_steps, shares


def same(xs, ys) -> bool:
    return len(xs) == len(ys) and all(x == y or (x != x and y != y) for x, y in zip(xs, ys))


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(LINE.filter(lambda x: x[0] != "step" or x[2] is not None), max_size=60),
       ema=st.sampled_from([0.0, 0.5, 0.9]), window=st.integers(1, 7))
def test_series_at_full_resolution_is_the_series_of_before(tmp_path_factory, lines, ema, window):
    d = tmp_path_factory.mktemp("p")
    write(d, ".loss.json", (lines, b""))
    canon = old_canonical(old_read(d / ".loss.json")[0])
    try:
        steps, loss, smooth = old_series_curve(canon, ema)
    except (TypeError, ValueError):              # a loss that is not a number: refused
        with pytest.raises(HistoryCorruptError, match="has a loss that is not a number"):
            series(str(d), ema=ema, window=window)
        return
    got = series(str(d), ema=ema, window=window)
    assert got["steps"] == steps and same(got["loss"], loss) and same(got["ema"], smooth)
    assert (got["share_steps"], got["shares"]) == old_shares(canon, window)
    assert got["history_steps"] == len(canon)


@settings(max_examples=200, deadline=None)
@given(losses=st.lists(st.one_of(st.floats(-5, 5), st.just(math.nan), st.just(math.inf)), min_size=1, max_size=300),
       buckets=st.integers(1, 20), stride=st.integers(1, 3))
@example(losses=[1.0, 1.2, 0.2], buckets=1, stride=1)      # 0.8000000000000002 against 3.12's sum()
def test_downsampled_curve_keeps_each_buckets_lowest_and_highest_loss(losses, buckets, stride):
    """Each bucket is two points (its first and last step) with the bucket's lowest, highest and
    mean finite loss (NaN: a gap) and the EMA, over every step, at both steps."""
    steps = [1 + i * stride for i in range(len(losses))]
    curve = Curve(0.5, buckets, (steps[0], steps[-1]), {steps[-1]})
    for s, x in zip(steps, losses):
        curve.add(s, x)
    drawn = curve.drawn()
    width = steps[-1] - steps[0] + 1
    _, _, smooth = old_series_curve([{"step": s, "loss": x} for s, x in zip(steps, losses)], 0.5)
    ema_at = dict(zip(steps, smooth))
    assert drawn["steps"] == sorted(drawn["steps"]) and len(drawn["steps"]) <= 2 * buckets
    shown = 0
    for b in range(buckets):
        members = [(s, x) for s, x in zip(steps, losses) if (s - steps[0]) * buckets // width == b]
        if not members:
            continue
        finite = [x for _, x in members if math.isfinite(x)]
        at = [k for k, s in enumerate(drawn["steps"]) if (s - steps[0]) * buckets // width == b]
        assert [drawn["steps"][k] for k in at] == [members[0][0], members[-1][0]]
        for k in at:
            got = (drawn["low"][k], drawn["high"][k], drawn["loss"][k])
            want = (min(finite), max(finite), sum(finite) / len(finite)) if finite else (math.nan,) * 3
            # the mean to 1e-12: Python 3.12's sum() compensates, the curve's running total does not
            assert same(got[:2], want[:2]) and (same(got[2:], want[2:]) or math.isclose(got[2], want[2], rel_tol=1e-12))
        shown += 2
    assert shown == len(drawn["steps"])
    assert same(drawn["ema"], [ema_at[s] for s in drawn["steps"]])
    assert same([v for _, v in drawn["generation_ema"]], [ema_at[steps[-1]]])


def test_plot_of_a_long_history_draws_buckets_and_reports_every_step(tmp_path):
    """5,000 steps with a resume: the chart draws two points per bucket, the result says 5,000
    steps (the history's length, as before)."""
    from ckptfmt.tools.plot import plot
    run = tmp_path / "run"
    run.mkdir()
    h = hist.History(run / ".loss.json")
    for s in range(1, 3001):
        h.append({"step": s, "loss": 1.0 + (s % 7), "source": "code"})
    h.event("resume", 2500)
    for s in range(2501, 5001):
        h.append({"step": s, "loss": 2.0 + (s % 5), "source": "topics"})
    h.close()
    drawn = series(str(run), points=1000)
    assert drawn["history_steps"] == 5000 and len(drawn["steps"]) == 2000
    assert min(drawn["low"]) == 1.0 and max(drawn["high"]) == 7.0
    assert drawn["events"] == [{"event": "resume", "step": 2500}]
    out = plot([str(run)], str(tmp_path / "p.png"))
    assert out["runs"][0]["steps"] == 5000 and out["runs"][0]["events"] == 1
    assert out["legend"] == ["run (EMA)", "resume", "committed generation"]     # no pivot, no fork
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@settings(max_examples=200, deadline=None)
@given(sources=st.lists(st.sampled_from(["code", "topics", None]), min_size=1, max_size=300),
       window=st.integers(1, 5), most=st.sampled_from([2, 4, 6, 10]))
def test_share_windows_are_merged_in_pairs_beyond_the_most_a_chart_holds(sources, window, most):
    """At most ``most`` windows: a longer history has windows of ``window * 2**k`` steps, the
    smallest that fits, each source's share in each exactly as over windows of that width."""
    from ckptfmt.tools.plot import Shares
    shares = Shares(window, most)
    canon = [{"step": 3 * i + 1, "source": src} for i, src in enumerate(sources)]
    for rec in canon:
        shares.add(rec["step"], rec["source"])
    width = window
    while len(canon) > most * width:
        width *= 2
    got = shares.drawn()
    assert len(got["share_steps"]) <= most and shares.window == width
    assert (got["share_steps"], got["shares"]) == old_shares(canon, width)


def test_a_run_without_a_history_has_an_empty_timeline(tmp_path):
    plan = timeline.plan(tmp_path / ".loss.json", events=("resume",))
    assert plan.forward and plan.segments == [] and plan.last_step is None and list(plan.records()) == []
    assert first_loss_difference(timeline.canonical(tmp_path / "a"), timeline.canonical(tmp_path / "b")) == (None, [0, 0])


# ---------------------------------------------------------------- review findings
def _run_with(tmp_path, name: str, lines: list[bytes]) -> str:
    run = tmp_path / name
    run.mkdir()
    (run / ".loss.json").write_bytes(b"".join(line + b"\n" for line in lines))
    return str(run)


def test_a_damaged_last_line_shaped_like_a_record_does_not_stretch_the_chart(tmp_path):
    """The last line looks like a writer's record of a far step and is none (a trailing comma):
    the plan's last step is the last canonical one, and the chart is the chart without that
    line (it was drawn in one bucket from step 1 to 10^8)."""
    steps = [b'{"step":%d,"loss":%d.0}' % (s, s % 7) for s in range(1, 3001)]
    damaged = _run_with(tmp_path, "damaged", steps + [b'{"step":100000000,"loss":1,}'])
    plan = timeline.plan(Path(damaged) / ".loss.json")
    assert plan.last_step == 3000 and [r["step"] for r in plan.records()] == list(range(1, 3001))
    got, want = series(damaged, points=2000), series(_run_with(tmp_path, "clean", steps), points=2000)
    assert got.pop("run") != want.pop("run") and got == want and len(got["steps"]) == 4000


@pytest.mark.parametrize("length", [3000, 30_000])
def test_a_history_ending_in_a_resume_between_steps_is_charted_as_before(tmp_path, length):
    """A resume at a step no record has (a step logged every 10, or a jump) cuts the last
    segment between two records' steps; the plan's last step is still the last record's, so the
    chart is bucketed over the real steps, as before, whether it holds the history whole or not
    (it was six buckets of 2,000, or 120 points for 30,000 steps)."""
    steps = [b'{"step":%d,"loss":%d.0}' % (s, s % 7) for s in range(1, length + 1)]
    cut = _run_with(tmp_path, "cut", steps + [b'{"step":1000000,"loss":1.0}', b'{"event":"resume","step":999999}'])
    assert timeline.plan(Path(cut) / ".loss.json").last_step == length
    got, want = series(cut, points=2000), series(_run_with(tmp_path, "clean", steps), points=2000)
    assert got.pop("events") == [{"event": "resume", "step": 999999}]
    assert got.pop("run") != want.pop("run") and want.pop("events") == [] and got == want
    assert len(got["steps"]) == 4000


def test_a_history_cut_short_between_the_two_passes_is_an_error(tmp_path):
    """Planned, then truncated before its records are read back: an error naming the history
    (the index's "changed while it was read"), not a shorter history (fork would copy it)."""
    path = tmp_path / ".loss.json"
    lines = [b'{"step":%d,"loss":1.0}' % s for s in range(1, 11)] + [b'{"event":"resume","step":5}'] \
        + [b'{"step":%d,"loss":2.0}' % s for s in range(6, 11)]
    data = b"".join(line + b"\n" for line in lines)
    for after in (data[:len(data) // 3], b""):
        path.write_bytes(data)
        plan = timeline.plan(path)
        path.write_bytes(after)
        with pytest.raises(HistoryCorruptError, match="changed while it was read"):
            list(plan.records())


def test_a_damaged_line_that_opened_the_last_segment_is_not_its_last_step(tmp_path):
    """A damaged line shaped like a record (invalid UTF-8) opens a segment that later resumes
    leave on top: the canonical history is empty and so is its last step (it was the damaged
    line's step, 2)."""
    path = tmp_path / ".loss.json"
    path.write_bytes(b'{"step": 2, "a": "\xff"}\n{"event": "resume", "step": 2}\n{"step": 3, "source": "code"}\n'
                     b'{"event": "resume", "step": 2}\n')
    plan = timeline.plan(path)
    assert plan.last_step is None and list(plan.records()) == [] == hist.read(path).canonical()


def test_runs_on_one_chart_are_smoothed_alike(tmp_path):
    """A run and its 300-step fork: each alone would get its own EMA span and share window (1/50
    of its length), so their common first 300 steps would be drawn differently; on one chart
    both take the longest run's, and the fork's curve is the run's over those steps."""
    from ckptfmt.tools.plot import plot
    for name, last in (("run", 2000), ("fork", 300)):
        (tmp_path / name).mkdir()
        h = hist.History(tmp_path / name / ".loss.json")
        for s in range(1, last + 1):
            h.append({"step": s, "loss": 1.0 + (s * 7919 % 13) / 10, "source": "code" if s % 3 else "topics"})
        h.close()
    alone = [series(str(tmp_path / name))["smoothing"] for name in ("run", "fork")]
    assert alone[0] != alone[1]
    out = plot([str(tmp_path / "run"), str(tmp_path / "fork")], str(tmp_path / "p.png"))
    assert [r["smoothing"] for r in out["runs"]] == [alone[0], alone[0]]
    run, fork = (series(str(tmp_path / name), **alone[0]) for name in ("run", "fork"))
    full = len(fork["shares"]["code"]) - 1                    # the fork's last window ends early
    assert fork["ema"] == run["ema"][:300] and fork["shares"]["code"][:full] == run["shares"]["code"][:full]
