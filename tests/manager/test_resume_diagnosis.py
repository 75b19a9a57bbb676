"""A resume that goes wrong is diagnosed: ``bisect`` of a straight run and an interrupted + resumed
run of the same loop names the first step and the piece of state a user's resume bug breaks.

Each bug is put into a small loop on ``CheckpointManager`` (tests/resume_bugs.py); the straight
run trains 6 steps, the other trains 3, closes (the interruption) and a fresh manager restores and
trains 3 more, in this process. The run's history records, per step, the digests of the state
the next step starts from (spec/RUN.md §3.9), and a generation every step; the diagnosis
(spec/RUN.md §6.5) must name the resume step (4) and the exact component broken there.
"""
import json
import re

import pytest

pytest.importorskip("torch")

from ckptfmt.run import causes  # noqa: E402
from ckptfmt.run import history as hist  # noqa: E402
from ckptfmt.run.ops import bisect  # noqa: E402
from conftest import ROOT, cli  # noqa: E402
from resume_bugs import train  # noqa: E402

CUT, STEPS = 3, 6
RESUMED = CUT + 1             # the resumed run's first step: its record is the first after restore


def straight_and_resumed(tmp_path, bug=None):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, STEPS, bug=bug)
    train(resumed, STEPS, bug=bug, stop_at=CUT)
    train(resumed, STEPS, bug=bug)
    return straight, resumed


# (bug, the component named, words its causes hold, a piece that must be listed as identical)
BUGS = [
    ("reseed-torch", "rng.torch", "torch.manual_seed", "state.data"),
    ("unregistered-generator", "undigested", "did not register", "rng.torch"),
    ("dataloader-without-state", "rng.torch", "DataLoader without state", "lr.0"),
    ("scheduler-after-restore", "lr.0", "scheduler was built after", "optimizer.step"),
    ("scaler-not-given", "optimizer.step", "GradScaler not given", "lr.0"),
    ("ema-outside-state", "metric.ema_loss", "EMA", "loss"),
    ("moments-reset", "m", "moments were reset", "optimizer.step"),
    ("lr-overwritten", "lr.0", "set by hand", "rng.torch"),
    ("cursor-off-by-one", "state.data", "off by one", "rng.torch"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bug,component,cause,same", BUGS, ids=[b[0] for b in BUGS])
def test_each_resume_bug_is_named_at_the_resume_step(tmp_path, bug, component, cause, same):
    found = bisect(*straight_and_resumed(tmp_path, bug))
    d = found["diagnosis"]
    assert not found["identical"]
    assert (d["step"], d["component"]) == (RESUMED, component), d["message"]
    assert cause in d["causes"] and same in d["equal"], d["message"]
    assert d["before"] == CUT and f"weights, m and v at step {CUT} identical" in d["message"]
    assert d["resumed"] == {"a": [], "b": [CUT]} and f"B resumed at step {CUT}" in d["message"]
    assert d["message"].startswith(f"step {RESUMED}: ")


@pytest.mark.timeout(60)
def test_a_resume_without_a_bug_is_identical_through_the_cli(tmp_path):
    straight, resumed = straight_and_resumed(tmp_path)
    done = cli("bisect", str(straight), str(resumed))
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "identical", done.stdout
    doc = json.loads(cli("bisect", str(straight), str(resumed), "--json").stdout)
    assert doc["identical"] and doc["diagnosis"]["step"] is None and doc["history_steps"] == [STEPS, STEPS]
    records = [json.loads(x) for x in (resumed / ".loss.json").read_text().splitlines()]
    assert all("rng.torch" in r["state"] for r in records if "step" in r and "event" not in r)   # digests compared


@pytest.mark.timeout(60)
def test_a_diverged_resume_exits_1_and_says_why_in_one_line(tmp_path):
    straight, resumed = straight_and_resumed(tmp_path, "reseed-torch")
    done = cli("bisect", str(straight), str(resumed))
    assert done.returncode == 1
    steps, why = done.stdout.splitlines()
    assert steps == f"generations: first differ at step {RESUMED} (last identical: step {CUT}); history: first differ at step {RESUMED}"
    assert why.startswith(f"step {RESUMED}: rng.torch differs (also: loss); generation {RESUMED} differs in m 0.weight")
    assert "-> torch's CPU RNG: something reseeded or drew from it after restore" in why


# ---------------------------------------------------------------- from the histories alone
def write_runs(tmp_path, a, b):
    """Two runs whose histories are the records ``a`` and ``b`` (no generations)."""
    for name, records in (("a", a), ("b", b)):
        (tmp_path / name).mkdir(parents=True)
        h = hist.History(tmp_path / name / ".loss.json")
        for rec in records:
            h.append(rec)
        h.close()
    return bisect(tmp_path / "a", tmp_path / "b")["diagnosis"]


def rec(step, loss=1.0, **state):
    return {"step": step, "time": float(step), "loss": loss,
            "state": {"rng.torch": "t", "state.data": f"d{step}", "lr.0": 0.1, "scheduler": "s", **state}}


def test_the_piece_that_feeds_the_others_is_named_first(tmp_path):
    """A reseeded RNG, a moved data position and a changed lr at one step: the RNG is named (it
    is drawn from first), the others listed as also differing; the clock never differs."""
    d = write_runs(tmp_path, [rec(1), rec(2)],
                   [rec(1), {**rec(2, loss=2.0, **{"lr.0": 0.2, "rng.torch": "x", "state.data": "y"}), "time": 9.0}])
    assert (d["step"], d["component"]) == (2, "rng.torch")
    assert d["differ"] == ["rng.torch", "state.data", "lr.0", "loss"] and d["equal"] == ["scheduler"]


def test_a_step_one_run_lacks_and_histories_without_digests(tmp_path):
    """A step only one run has parts them there; a digest only one run records is not recorded
    there, never a difference (spec/RUN.md §3.9); without digests only the loss says where."""
    d = write_runs(tmp_path / "short", [rec(1), rec(2)], [rec(1)])
    assert (d["step"], d["component"], d["only_in"]) == (2, "step", "a")
    assert d["message"].startswith("step 2: recorded by run A only")
    d = write_runs(tmp_path / "piece", [rec(1), rec(2, loss=2.0)], [rec(1, **{"rng.noise": "n"}), rec(2, **{"rng.noise": "n"})])
    assert (d["step"], d["component"], d["one_only"]) == (2, "undigested", ["rng.noise"])
    bare = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]
    d = write_runs(tmp_path / "bare", bare, [bare[0], {"step": 2, "loss": 3.0}])
    assert (d["step"], d["component"]) == (2, "loss") and "record digests" in d["causes"]
    d = write_runs(tmp_path / "half", [rec(1), rec(2)], bare)    # one run without digests: not compared
    assert (d["step"], d["component"], d["equal"]) == (2, "loss", [])


def test_a_digest_that_differs_from_the_first_record_on_is_the_runs_not_the_resume(tmp_path):
    """NumPy's global RNG, seeded by neither run, differs in every record while the losses agree:
    left out (and said), so the runs are identical, and a reseed after a resume is still named."""
    unseeded = lambda run, recs: [{**r, "state": {**r["state"], "rng.numpy": f"{run}{r['step']}"}} for r in recs]  # noqa: E731
    same = [rec(1), rec(2), rec(3)]
    d = write_runs(tmp_path / "same", unseeded("a", same), unseeded("b", same))
    assert d["step"] is None and d["from_start"] == ["rng.numpy"] and d["message"].startswith("identical (rng.numpy differs")
    d = write_runs(tmp_path / "reseeded", unseeded("a", same), unseeded("b", [rec(1), rec(2), rec(3, **{"rng.torch": "x"})]))
    assert (d["step"], d["component"], d["from_start"]) == (3, "rng.torch", ["rng.numpy"])
    d = write_runs(tmp_path / "drawn", unseeded("a", same), unseeded("b", [rec(1, loss=5.0), rec(2), rec(3)]))
    assert (d["step"], d["component"], d["from_start"]) == (1, "rng.numpy", [])    # the loop draws from it


def test_a_metric_that_measures_time_can_be_left_out(tmp_path):
    a = [{**rec(1), "step_s": 0.5}, {**rec(2), "step_s": 0.4}]
    b = [{**rec(1), "step_s": 0.6}, {**rec(2), "step_s": 0.3}]
    d = write_runs(tmp_path, a, b)
    assert (d["step"], d["component"]) == (1, "metric.step_s")
    done = cli("bisect", str(tmp_path / "a"), str(tmp_path / "b"), "--ignore", "step_s")
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "identical", done.stdout


def test_the_spec_shows_the_table_the_messages_come_from():
    """spec/RUN.md §6.5 holds ckptfmt.run.causes.TABLE row for row (one place: the code's)."""
    spec = (ROOT / "spec" / "RUN.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| (.+) \| (.+) \|$", spec[spec.index("6.5. **Why two runs part"):], re.M)
    assert rows == [(c.component, c.what, c.causes) for c in causes.TABLE]
    assert causes.row_of("rng.cuda.0").component == "rng.cuda.I" and causes.row_of("rng.noise").component == "rng.NAME"
    assert causes.described("rng.generators.numpy")[0] == "the registered generator `numpy`"
    assert causes.described("state.data")[0] == "the state object `data` (its `state_dict()`)"


def test_a_timing_metric_does_not_hide_an_unseeded_rng_nor_blame_a_resume(tmp_path):
    """An unseeded NumPy RNG and a timing metric: the first record's loss agrees, so rng.numpy is
    left out from the start (the metric does not decide); the metric is named at step 1 with the
    causes of a difference of the runs, never "after restore" (neither run resumed before it)."""
    a = [{**rec(1, **{"rng.numpy": "a1"}), "step_s": 0.5}, {**rec(2, **{"rng.numpy": "a2"}), "step_s": 0.4}]
    b = [{**rec(1, **{"rng.numpy": "b1"}), "step_s": 0.6}, {**rec(2, **{"rng.numpy": "b2"}), "step_s": 0.3}]
    d = write_runs(tmp_path, a, b)
    assert (d["step"], d["component"], d["from_start"]) == (1, "metric.step_s", ["rng.numpy"]), d["message"]
    assert d["causes"] == causes.BEFORE_ANY_RESUME and "after restore" not in d["message"]
    done = cli("bisect", str(tmp_path / "a"), str(tmp_path / "b"), "--ignore", "step_s")
    assert done.returncode == 0 and done.stdout.splitlines()[-1].startswith("identical (rng.numpy"), done.stdout


@pytest.mark.timeout(60)
def test_a_numeric_piece_is_shown_with_both_values(tmp_path):
    """A step count and an lr are numbers: the message and --json give A's and B's, and a step
    count one behind says the update was skipped."""
    d = bisect(*straight_and_resumed(tmp_path / "scaler", "scaler-not-given"))["diagnosis"]
    assert d["values"] == {"optimizer.step": [2, 1]}, d["message"]
    assert d["message"].startswith("step 4: optimizer.step differs (A 2, B 1: B's step count did not advance: "
                                   "a skipped update)"), d["message"]
    doc = json.loads(cli("bisect", *map(str, straight_and_resumed(tmp_path / "lr", "lr-overwritten")), "--json").stdout)
    a, b = doc["diagnosis"]["values"]["lr.0"]
    assert a != b and doc["diagnosis"]["message"].startswith(f"step 4: lr.0 differs (A {a:g}, B {b:g})")


def resumed_by_hand(tmp_path, bug, every):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, STEPS, bug=bug, every=every)
    train(resumed, STEPS, bug=bug, stop_at=CUT, every=every)
    train(resumed, STEPS, bug=bug, every=every)
    return bisect(straight, resumed)["diagnosis"]


@pytest.mark.timeout(60)
def test_moments_reset_without_a_generation_at_the_resume_step_is_named_by_its_loss(tmp_path):
    """Moments zeroed after restore, generations every 3 steps: no generation at step 4 shows
    them; step 4's record agrees (its loss came before the update), step 5's loss differs with
    every digest equal: the weights step 5 began from differ, and the moments are among the causes."""
    d = resumed_by_hand(tmp_path, "moments-reset", every=3)
    assert (d["step"], d["component"]) == (RESUMED + 1, "undigested"), d["message"]
    assert "the weights step 5 began from differ (step 4's update differed" in d["message"]
    assert "moments reset" in d["causes"] and "optimizer.step" in d["equal"], d["message"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("every", [1, 3])
def test_a_scheduler_built_then_loaded_by_hand_after_restore_is_named(tmp_path, every):
    """``mgr.restore()``, then ``LambdaLR(opt, ...)`` built (it writes its first lr into the
    optimizer), then ``sched.load_state_dict(saved)`` (which does not write the lr back): step 4's
    update used the warm-up's first lr while its record's ``lr.0`` shows the scheduler's. The lr
    the update used (``update.lr.0``, seen as ``optimizer.step()`` runs) names it at step 4,
    whether or not a generation was saved there, with both values."""
    d = resumed_by_hand(tmp_path, "scheduler-loaded-after-restore", every)
    assert (d["step"], d["component"]) == (RESUMED, "update.lr.0"), d["message"]
    a, b = d["values"]["update.lr.0"]
    assert a != b and "update.lr.0 differs (A " in d["message"], d["message"]
    assert "scheduler built or loaded after restore" in d["causes"] and "lr.0" in d["equal"], d["message"]
