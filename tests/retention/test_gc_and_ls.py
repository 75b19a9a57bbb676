"""`ckptfmt gc` / `ls` with the retention policy (spec/RUN.md §5) on runs a real CheckpointManager
wrote: metrics recorded in each generation's manifest, best-K by a metric with a NaN among them,
time rules on recorded commit times, and the usage errors that delete nothing."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from ckptfmt import manifest as mf
from ckptfmt.cli import main
from ckptfmt.run import Policy, Run
from ckptfmt.torch import CheckpointManager
from models import tiny_linear, train_steps
from conftest import commit_rewritten

VAL_LOSS = {10: 5.0, 20: 3.0, 30: math.nan, 40: 4.0, 50: 2.0, 60: 6.0}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A run of six generations, each with the val_loss reported at its step (one NaN)."""
    model = tiny_linear()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = tmp_path_factory.mktemp("policy") / "run"
    with CheckpointManager(path, model, opt, every=10, keep_last=None, handle_signals=False) as mgr:
        for step in range(1, 61):
            loss = train_steps(model, opt, 1)
            mgr.step(step, loss=loss, **({"val_loss": VAL_LOSS[step]} if step in VAL_LOSS else {}))
    return path


@pytest.fixture
def run_dir(built, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(built, dest)
    return dest


def invoke(runner, *args):
    result = runner.invoke(main, list(map(str, args)), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def steps(run):
    return [g.step for g in Run(run).generations() if g.committed]


def test_each_generation_records_the_metrics_reported_at_or_before_its_step(run_dir):
    doc = mf.read(run_dir / "step_000030.json")
    assert doc["metrics"]["val_loss"] == {"value": {"__float__": "nan"}, "step": 30}
    assert doc["metrics"]["loss"]["step"] == 30 and isinstance(doc["metrics"]["loss"]["value"], float)
    assert mf.read(run_dir / "step_000050.json")["metrics"]["val_loss"] == {"value": 2.0, "step": 50}


def test_gc_keeps_the_two_best_finite_and_the_two_newest(runner, run_dir):
    code, out, _ = invoke(runner, "gc", run_dir, "--keep-last", 2, "--keep-best", 2, "--metric", "val_loss",
                          "--mode", "min", "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["deleted"] == [10, 30, 40] and steps(run_dir) == [20, 50, 60]
    assert {k["step"]: k["kept_by"] for k in doc["kept"]} == {
        20: ["best val_loss"], 50: ["last", "best val_loss"], 60: ["last", "newest valid"]}
    code, out, _ = invoke(runner, "validate", run_dir)
    assert code == 0, out


def test_gc_dry_run_says_what_and_why_and_deletes_nothing(runner, run_dir):
    code, out, _ = invoke(runner, "gc", run_dir, "--keep-best", 1, "--metric", "val_loss", "--mode", "max",
                          "--dry-run")
    assert code == 0
    assert out.splitlines()[0] == "would delete steps [10, 20, 30, 40, 50]"
    assert "  keep 60: best val_loss, newest valid" in out.splitlines()
    assert steps(run_dir) == [10, 20, 30, 40, 50, 60]


def test_ls_shows_metrics_and_what_keeps_each(runner, run_dir):
    code, out, _ = invoke(runner, "ls", run_dir, "--json", "--keep-last", 1, "--keep-every", 20)
    assert code == 0, out
    rows = {g["step"]: g for g in json.loads(out)["generations"]}
    assert rows[30]["metrics"]["val_loss"] == {"value": {"__float__": "nan"}, "step": 30}   # as recorded
    assert {s: g["kept_by"] for s, g in rows.items()} == {
        10: [], 20: ["every"], 30: [], 40: ["every"], 50: [], 60: ["last", "every", "newest valid"]}
    code, out, _ = invoke(runner, "ls", run_dir, "--json")
    assert all(g["kept_by"] == [] for g in json.loads(out)["generations"])
    code, out, _ = invoke(runner, "ls", run_dir, "--keep-best", 1, "--metric", "val_loss")
    assert code == 0 and "val_loss=nan" in out and "kept: best val_loss" in out


def test_time_rules_use_the_recorded_commit_times(runner, run_dir):
    hour = 3600.0
    times = {10: 0.5, 20: 0.9, 30: 1.2, 40: 5.0, 50: 9.5, 60: 10.0}       # hours
    for step, at in times.items():
        doc = mf.read(run_dir / f"step_{step:06d}.json")
        commit_rewritten(run_dir / f"step_{step:06d}.json", {**doc, "created": at * hour})
    del_created = mf.read(run_dir / "step_000040.json")
    del del_created["created"]
    commit_rewritten(run_dir / "step_000040.json", del_created)    # no commit time: kept by time rules
    code, out, _ = invoke(runner, "gc", run_dir, "--keep-within", "1h", "--keep-interval", "2h", "--json")
    assert code == 0, out
    kept = {k["step"]: k["kept_by"] for k in json.loads(out)["kept"]}
    assert kept == {10: ["interval"], 40: ["no commit time"], 50: ["within", "interval"],
                    60: ["within", "interval", "newest valid"]}
    assert steps(run_dir) == [10, 40, 50, 60]


@pytest.mark.parametrize("args,message", [
    ((), "gc: Missing a keep rule: --keep-last, --keep-every, --keep-best, --keep-within or --keep-interval"),
    (("--keep-best", 2), "--keep-best needs --metric"),
    (("--keep-within", "6 hours"), "not a duration: '6 hours'"),
    (("--keep-interval", "1w"), "not a duration: '1w'"),
    (("--keep-best", 2, "--metric", "val_los"), "no generation records metric 'val_los' (recorded: loss, val_loss)"),
    (("--keep-last", 1, "--mode", "max"), "--metric, --mode and --[no-]keep-missing-metric need --keep-best K"),
    (("--keep-last", 1, "--no-keep-missing-metric"), "need --keep-best K"),
])
def test_bad_policies_are_usage_errors_and_delete_nothing(runner, run_dir, args, message):
    code, _, err = invoke(runner, "gc", run_dir, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert steps(run_dir) == [10, 20, 30, 40, 50, 60]
    code, out, _ = invoke(runner, "gc", run_dir, *args, "--json")
    assert code == 2 and json.loads(out)["error"]["exit_code"] == 2


def test_without_a_metric_in_the_manifest_a_generation_has_none(runner, run_dir):
    for step in (10, 20):
        doc = mf.read(run_dir / f"step_{step:06d}.json")
        del doc["metrics"]
        commit_rewritten(run_dir / f"step_{step:06d}.json", doc)
    code, out, _ = invoke(runner, "gc", run_dir, "--keep-best", 1, "--metric", "val_loss",
                          "--no-keep-missing-metric", "--json")
    assert code == 0 and json.loads(out)["deleted"] == [10, 20, 30, 40]
    assert steps(run_dir) == [50, 60]


def test_the_mirror_destination_keeps_the_newest_finite_generation_of_a_diverged_run(tmp_path):
    """Local and remote retention are one plan with the same guards: a mirror with --keep-last 1
    of a run whose newest generations diverged keeps the last finite one there too."""
    import numpy as np

    from ckptfmt.run.mirror import mirror
    from conftest import arrays
    run = Run(tmp_path / "run", create=True)
    for step in (100, 200, 300, 400):
        w, m, v = arrays(64, seed=step)
        if step >= 300:
            w[5] = np.nan
        run.commit(step, w, m, v, manifest={})
    dest = tmp_path / "dest"
    mirror(run.path, f"file://{dest}", retention=Policy(keep_last=1))
    mirror(run.path, f"file://{dest}", retention=Policy(keep_last=1))       # the second pass prunes with what is there
    assert sorted(p.name for p in dest.glob("step_*.json")) == ["step_000200.json", "step_000400.json"]


def test_the_mirror_destination_holds_what_local_gc_keeps_with_the_same_flags(runner, run_dir, tmp_path):
    """``mirror --keep-best`` and ``gc --keep-best`` are one plan: the URL ends with exactly the
    steps local gc leaves (the two best finite val_loss and the two newest)."""
    flags = ["--keep-last", 2, "--keep-best", 2, "--metric", "val_loss", "--mode", "min"]
    code, out, _ = invoke(runner, "mirror", run_dir, f"file://{tmp_path}/m", *flags, "--json")
    assert code == 0, out
    there = json.loads(out)["at_destination"]
    code, out, _ = invoke(runner, "gc", run_dir, *flags)
    assert code == 0, out
    assert there == steps(run_dir) == [20, 50, 60]


def test_the_manager_applies_its_policy_and_records_it_for_ls(tmp_path, runner):
    """A manager with ``retention=Policy(...)`` keeps what the policy keeps after each commit, and
    records it in ``.policy.json``, so ``ls`` without flags says which rule keeps each generation."""
    model = tiny_linear()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = tmp_path / "run"
    policy = Policy(keep_last=1, keep_best=2, metric="val_loss")
    with CheckpointManager(path, model, opt, every=10, retention=policy, handle_signals=False) as mgr:
        for step in range(1, 61):
            mgr.step(step, loss=1.0, **({"val_loss": VAL_LOSS[step]} if step in VAL_LOSS else {}))
    assert steps(path) == [20, 50, 60]
    assert json.loads((path / ".policy.json").read_text())["retention"] == {
        "keep_last": 1, "keep_best": 2, "metric": "val_loss", "mode": "min", "keep_missing": True}
    code, out, _ = invoke(runner, "ls", path, "--json")
    doc = json.loads(out)
    assert doc["policy"]["from"] == ".policy.json"
    assert {g["step"]: g["kept_by"] for g in doc["generations"]} == {
        20: ["best val_loss"], 50: ["best val_loss"], 60: ["last", "newest valid"]}
    code, out, _ = invoke(runner, "ls", path)
    assert "retention (recorded in .policy.json): keep_last=1, keep_best=2, metric=val_loss" in out
    code, out, _ = invoke(runner, "ls", path, "--keep-last", 3, "--json")     # the flags win
    assert json.loads(out)["policy"] == {"from": "given", "retention": {"keep_last": 3}}


def test_a_damaged_policy_record_is_named_and_ls_goes_on(runner, run_dir):
    (run_dir / ".policy.json").write_text("{not json")
    code, out, _ = invoke(runner, "ls", run_dir, "--json")
    assert code == 0 and ".policy.json" in json.loads(out)["policy"]["problem"]


def test_inspect_prints_the_metrics_a_generation_recorded(runner, run_dir):
    code, out, _ = invoke(runner, "inspect", run_dir / "step_000040.bin")
    assert code == 0, out
    line = next(x for x in out.splitlines() if x.startswith("  metrics: "))
    assert "val_loss=4" in line and "loss=" in line
    code, out, _ = invoke(runner, "inspect", run_dir / "step_000030.bin")
    assert "val_loss=nan" in out


def test_keep_flags_on_a_restore_from_a_url_are_a_usage_error(runner, tmp_path):
    code, _, err = invoke(runner, "mirror", f"file://{tmp_path}/m", tmp_path / "dest", "--mode", "max")
    assert code == 2 and "apply to mirror RUN URL" in err and not (tmp_path / "dest").exists()
    code, _, err = invoke(runner, "mirror", f"file://{tmp_path}/m", tmp_path / "dest", "--keep-best", 2)
    assert code == 2 and "apply to mirror RUN URL" in err
