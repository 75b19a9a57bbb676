"""When a loop saves (spec/RUN.md §5.5): every N steps, every T seconds of wall time, on a new best
of a metric, composed; the manager's decisions, their reasons in the history, where a resumed run
goes on from, and one agreed decision per step under torchrun."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfmt.run import Policy, Run, SaveClock, SavePolicy, roots
from ckptfmt.run import history as hist
from ckptfmt.run.saving import best_in_history
from ckptfmt.torch import CheckpointManager

ROOT = Path(__file__).resolve().parents[2]


def manager(path, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if "retention" not in kw:
        kw["keep_last"] = None
    return CheckpointManager(path, model, opt, handle_signals=False, **kw)


def saves(run) -> list[tuple[int, str]]:
    """(step, reason) of every checkpoint event in the history."""
    return [(r["step"], r["reason"]) for r in hist.read(Path(run) / ".loss.json").events() if r["event"] == "checkpoint"]


# ---------------------------------------------------------------- the value and its clock
def test_a_save_policy_takes_durations_and_refuses_what_is_no_rule():
    assert SavePolicy(every_seconds="30m").every_seconds == 1800
    for bad in ({"every_seconds": "5x"}, {"every_seconds": "0s"}, {"every_seconds": 0}, {"every_seconds": 1.5},
                {"every": 0}, {"every": True}, {"on_best": ""}, {"mode": "median"}, {"min_delta": -1},
                {"min_delta": float("nan")}):
        with pytest.raises(ValueError):
            SavePolicy(**bad)


def test_the_interval_counts_from_the_newest_save_of_any_reason():
    clock = SaveClock(SavePolicy(every=10, every_seconds=60))
    assert clock.due(1, {}, now=1000.0) == []              # from the first step, not from start-up
    assert clock.due(10, {}, now=1050.0) == ["cadence"]
    clock.saved(1050.0)
    assert clock.due(11, {}, now=1100.0) == []             # 50 s since the cadence save
    assert clock.due(12, {}, now=1110.0) == ["interval"]


def test_a_new_best_must_beat_the_best_so_far_by_more_than_min_delta():
    clock = SaveClock(SavePolicy(on_best="loss", min_delta=0.1))
    assert [clock.due(s, {"loss": v}, now=0.0) for s, v in enumerate((1.0, 0.95, 0.85, 0.8, 0.7), 1)] == [
        ["best loss"], [], ["best loss"], [], ["best loss"]]
    assert SaveClock(SavePolicy(on_best="tag")).due(1, {"tag": "5"}, now=0.0) == []    # a string is no number


@given(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none()), min_size=1, max_size=30),
       st.sampled_from(["min", "max"]))
@settings(max_examples=60, deadline=None)
def test_a_new_best_is_a_finite_value_better_than_every_earlier_finite_one(values, mode):
    clock = SaveClock(SavePolicy(on_best="m", mode=mode))
    best = None
    for step, value in enumerate(values, 1):
        due = clock.due(step, {} if value is None else {"m": value}, now=0.0)
        finite = value is not None and math.isfinite(value)
        improves = finite and (best is None or (value < best if mode == "min" else value > best))
        assert due == (["best m"] if improves else [])
        best = value if improves else best


def test_the_best_so_far_of_a_history_leaves_out_a_lost_timeline(tmp_path):
    path = tmp_path / ".loss.json"
    lines = [{"step": 1, "val": 3.0}, {"step": 2, "val": "nan"}, {"step": 3, "val": 0.5},
             {"event": "resume", "step": 2}, {"step": 3, "val": 2.0}, {"step": 4, "val": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert best_in_history(path, "val", "min", upto=3) == 2.0     # 0.5 was on the lost timeline
    assert best_in_history(path, "val", "min", upto=4) == 1.0
    assert best_in_history(path, "val", "max", upto=4) == 3.0
    assert best_in_history(path, "other", "min", upto=4) is None


# ---------------------------------------------------------------- the manager
def test_the_manager_saves_at_each_new_best_and_says_why(tmp_path):
    val = {1: 5.0, 2: 4.0, 3: math.nan, 4: 4.5, 5: 3.0, 6: 3.0, 7: float("-inf")}
    with manager(tmp_path / "run", saving=SavePolicy(every=4, on_best="val_loss")) as mgr:
        for step in range(1, 8):
            mgr.step(step, loss=1.0, val_loss=val[step])
    assert saves(tmp_path / "run") == [(1, "best val_loss"), (2, "best val_loss"), (4, "cadence"),
                                       (5, "best val_loss")]
    assert [g.step for g in Run(tmp_path / "run").generations()] == [1, 2, 4, 5]
    run = tmp_path / "run"                 # each event names the generation it committed
    recorded = roots.recorded(run / ".loss.json")
    assert recorded == {s: roots.of_step(run, s) for s in (1, 2, 4, 5)} and None not in recorded.values()


def test_the_manager_saves_when_the_wall_time_since_the_newest_save_has_passed(tmp_path):
    with manager(tmp_path / "run", saving=SavePolicy(every_seconds=2)) as mgr:
        mgr.step(1, loss=1.0)
        mgr.step(2, loss=1.0)
        time.sleep(2.1)
        mgr.step(3, loss=1.0)
        mgr.step(4, loss=1.0)
    assert saves(tmp_path / "run") == [(3, "interval")]


def test_a_resumed_run_goes_on_from_the_best_its_history_holds(tmp_path):
    run = tmp_path / "run"
    with manager(run, saving=SavePolicy(on_best="val_loss")) as mgr:
        for step, value in ((1, 2.0), (2, 1.0), (3, 1.5)):
            mgr.step(step, val_loss=value)
        mgr.save(3, "requested")
    with manager(run, saving=SavePolicy(on_best="val_loss")) as mgr:
        assert mgr.restore() == 3
        assert mgr.metric("val_loss") == 1.5                   # the restored generation's record
        mgr.step(4, val_loss=1.2)                              # not better than step 2's 1.0
        mgr.step(5, val_loss=0.9)
    assert saves(run)[-1] == (5, "best val_loss") and (4, "best val_loss") not in saves(run)


def test_a_generation_after_a_resume_records_the_metrics_reported_before_it(tmp_path):
    run = tmp_path / "run"
    with manager(run, every=2) as mgr:
        mgr.step(1, val_loss=0.25)
        mgr.step(2, loss=1.0)
    with manager(run, every=2) as mgr:
        mgr.restore()
        mgr.step(3, loss=0.5)
        mgr.step(4, loss=0.5)
    doc = json.loads((run / "step_000004.json").read_text())
    assert doc["metrics"]["val_loss"] == {"value": 0.25, "step": 1}
    assert doc["metrics"]["loss"] == {"value": 0.5, "step": 4}


def test_every_and_saving_together_are_refused(tmp_path):
    with pytest.raises(TypeError, match="saving=SavePolicy"):
        manager(tmp_path / "run", every=10, saving=SavePolicy(every=5))
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- torchrun
AGREE = r'''
import sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from ckptfmt.run import SavePolicy
from ckptfmt.torch import CheckpointManager
from ckptfmt.torch.distributed import exit_worker
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
net = DistributedDataParallel(model)
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
# rank 0's metric improves at steps 1, 2 and 4; rank 1's at 1, 3 and 5
val = {0: [5, 4, 4, 3, 3, 3], 1: [9, 9, 8, 9, 7, 9]}[rank]
mgr = CheckpointManager(sys.argv[1], model, opt, handle_signals=False, keep_last=None,
                        saving=SavePolicy(on_best="val"))
for step in range(1, 7):
    loss = net(torch.ones(1, 2)).pow(2).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    mgr.step(step, val=val[step - 1])
mgr.close()
dist.destroy_process_group()
exit_worker(0)
'''


@pytest.mark.xdist_group("torchrun")      # 2 ranks: never beside another torchrun job
@pytest.mark.timeout(45)                   # 5-8 s; a rank left alone in the save fails here, not at 10 min
def test_under_torchrun_rank_0s_new_best_is_every_ranks_save(tmp_path):
    """Each rank's metric may differ: a rank whose own value improved would enter the save (a
    collective) alone and wait for ever. The decision is agreed, and a new best is rank 0's (the
    values its history records, where a resumed run's best comes from): every rank saves there,
    and only there."""
    from torchrun import standalone, succeeds
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    run = tmp_path / "run"
    succeeds([*standalone(2), script, run], tmp_path / "agree.log", timeout=35, cwd=ROOT)
    assert [g.step for g in Run(run).generations() if g.committed] == [1, 2, 4]
    assert [s for s, _ in saves(run)] == [1, 2, 4]   # rank 1's 3 and 5 are no save


def test_a_metric_not_reported_yet_keeps_the_generations_until_it_is(tmp_path):
    """A loop's own best-K policy names a metric its first generations lack (no evaluation yet):
    retention after each commit keeps them ('no val_loss') instead of refusing the save, and
    ``ls`` under the recorded policy says so; ``gc`` with the same flags refuses the unknown name."""
    from ckptfmt.run.ops import gc, ls_run
    run = tmp_path / "run"
    with pytest.warns(UserWarning, match="metric val_loss not reported to step"), \
            manager(run, every=1, retention=Policy(keep_last=1, keep_best=1, metric="val_loss")) as mgr:
        for step in range(1, 4):
            mgr.step(step, loss=1.0)
    assert [g.step for g in Run(run).generations()] == [1, 2, 3]
    assert {g["step"]: g["kept_by"] for g in ls_run(run)["generations"]} == {
        1: ["no val_loss"], 2: ["no val_loss"], 3: ["last", "no val_loss", "newest valid"]}
    with pytest.raises(Exception, match="no generation records metric 'val_loss'"):
        gc(run, Policy(keep_best=1, metric="val_loss"))
    assert [g.step for g in Run(run).generations()] == [1, 2, 3]


def test_a_damaged_policy_record_is_replaced_and_never_fails_a_save(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".policy.json").write_text("{torn")
    with manager(run, every=2) as mgr:
        for step in range(1, 5):
            mgr.step(step, loss=1.0)
    assert [g.step for g in Run(run).generations()] == [2, 4]
    assert json.loads((run / ".policy.json").read_text())["saving"] == {"every": 2}


@pytest.mark.parametrize("kw,recorded,kept", [
    ({"retention": None}, None, [1, 2, 3, 4, 5, 6]),
    ({"retention": Policy.KEEP_ALL}, {"keep_all": True}, [1, 2, 3, 4, 5, 6]),
    ({"keep_last": None, "keep_every": 3}, {"keep_every": 3}, [3, 6]),
    ({"keep_every": 3}, {"keep_last": 3, "keep_every": 3}, [3, 4, 5, 6]),
    ({}, {"keep_last": 3}, [4, 5, 6]),
])
def test_the_managers_retention_arguments_mean_what_they_say(tmp_path, kw, recorded, kept):
    """``retention=None`` and ``Policy.KEEP_ALL`` keep every generation (as for mirror and the trainer); ``keep_every``
    alone is a policy, as on the command line; the defaults keep the last 3."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path / "run", model, opt, every=1, handle_signals=False, **kw) as mgr:
        for step in range(1, 7):
            mgr.step(step, loss=1.0)
    assert [g.step for g in Run(tmp_path / "run").generations()] == kept
    assert json.loads((tmp_path / "run" / ".policy.json").read_text())["retention"] == recorded


@pytest.mark.parametrize("kw,error", [
    ({"retention": Policy(keep_last=1), "keep_last": 2}, "not both"),
    ({"retention": {"keep_last": 1}}, "retention must be a Policy"),
    ({"saving": 10}, "saving must be a SavePolicy"),
])
def test_policy_arguments_that_are_no_policy_are_refused_before_anything_is_written(tmp_path, kw, error):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises((TypeError, ValueError), match=error):
        CheckpointManager(tmp_path / "run", model, opt, handle_signals=False, **kw)
    assert not (tmp_path / "run").exists()


def test_a_metric_the_loop_never_reports_is_said_once(tmp_path):
    said = []
    with manager(tmp_path / "run", every=1, log=said.append,
                 retention=Policy(keep_last=1, keep_best=1, metric="val_los")) as mgr:
        for step in range(1, 4):
            mgr.step(step, loss=1.0, val_loss=2.0)
    assert [m for m in said if "val_los " in m] == [m for m in said if "not reported" in m]
    assert len([m for m in said if "not reported" in m]) == 1 and "(reported: loss, val_loss)" in said[0]


@pytest.mark.parametrize("records,then", [
    ([{"step": 1, "val": 2.0}, {"step": 2, "val": 1.0}], 1.0),
    ([{"step": 1, "val": 2.0}], 2.0),
    ([{"step": 1, "loss": 2.0}], None),
])
def test_the_best_of_a_history_is_its_best_value_of_the_metric_or_none(tmp_path, records, then):
    path = tmp_path / ".loss.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert best_in_history(path, "val", "min", upto=5) == then


def test_keeping_every_generation_hashes_nothing_after_a_commit(tmp_path, monkeypatch):
    """``Policy.KEEP_ALL`` deletes nothing, so the manager's retention after each commit does not
    run (no newest generation deep-verified for nothing), as with ``retention=None``; ``ls``
    says it keeps every generation."""
    from conftest import cli
    chosen = []
    real = Run.choose
    monkeypatch.setattr(Run, "choose", lambda self, *a, **k: chosen.append(k) or real(self, *a, **k))
    with manager(tmp_path / "run", every=1, retention=Policy.KEEP_ALL) as mgr:
        for step in range(1, 5):
            mgr.step(step, loss=1.0)
    assert chosen == [] and [g.step for g in Run(tmp_path / "run").generations()] == [1, 2, 3, 4]
    assert "retention (recorded in .policy.json): keeps every generation" in cli("ls", str(tmp_path / "run")).stdout
