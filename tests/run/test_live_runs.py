"""Reading a run while its trainer commits every 3 steps and keeps the last 2 (spec/RUN.md §5.3).

Each reader is held, mid-read, until the trainer has committed three more generations, so the
retention of an unleased reader would have deleted what it reads (the race users hit:
``export`` failing half-way with "No such file or directory"). Every read must succeed, and
what it wrote must validate.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.xdist_group("live-trainer")     # one worker, one trainer for the module

from ckptfmt import fsio  # noqa: E402
from ckptfmt.run import fork, list_dir, ls_run  # noqa: E402
from ckptfmt.tools.export import INCOMPLETE, export  # noqa: E402
from ckptfmt.tools.validate import validate_path, validate_run  # noqa: E402
from conftest import cli  # noqa: E402
import warm  # noqa: E402

EVERY, KEEP = 3, 2


def committed(run):
    return [g.step for g in list_dir(run).generations if g.committed]


def wait_for_commits(run, after: int, n: int = 3, timeout: float = 60) -> list[int]:
    """Block until the trainer has committed ``n`` generations newer than ``after``: by then its
    retention (keep the last 2) has run at least twice over ``after``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = committed(run)
        if sum(s > after for s in steps) >= n:
            return steps
        time.sleep(0.01)
    raise AssertionError(f"trainer committed no {n} generations after step {after} in {timeout}s")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A trainer committing every 3 steps with --keep-last 2, for the whole module."""
    run = tmp_path_factory.mktemp("live") / "run"
    log = open(run.parent / "train.log", "w")
    proc = warm.Popen([sys.executable, "-m", "ckptfmt.cli", "train", "--run", str(run), "--config", "tiny",
                             "--steps", "1000000", "--checkpoint-every", str(EVERY), "--keep-last", str(KEEP),
                             "--sample-every", "0", "--log-every", "1000000", "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (run.exists() and len(committed(run)) >= KEEP):   # retention's steady state: the
            # first test to run may be any (xdist); validate counts KEEP generations from its start
            assert proc.poll() is None and time.monotonic() < deadline, (run.parent / "train.log").read_text()
            time.sleep(0.05)
        yield run
    finally:
        proc.send_signal(signal.SIGTERM)          # the trainer checkpoints and exits 0
        assert proc.wait(60) == 0, (run.parent / "train.log").read_text()
        log.close()


def test_export_races_retention_twenty_of_twenty(live, tmp_path):
    exported = []
    for i in range(20):
        held = {}

        def hold(dest, i=i):                       # after the copy, before the verification
            step = json.loads(next(dest.glob("step_*.json")).read_text())["step"]
            held["steps"] = wait_for_commits(live, step)
            held["step"] = step
        dest = tmp_path / f"export{i}"
        doc = export(str(live), str(dest), tamper=hold)
        step = held["step"]
        assert doc["steps"] == [step] and doc["verified"]["validated"]["status"] == "verified"
        assert step in held["steps"]               # retention kept it: it was leased
        assert not (dest / INCOMPLETE).exists()
        report = validate_path(dest)
        assert report.ok and report.status == "verified", report.findings
        exported.append(step)
    assert len(exported) == 20
    wait_for_commits(live, max(committed(live)))   # leases ended: retention catches up
    assert not set(exported) & set(committed(live))


def test_the_export_command_on_a_live_run(live, tmp_path):
    out = cli("export", str(live), str(tmp_path / "dest"), "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert "loaded into a fresh tiny model" in doc["verified"]["loaded"]
    history = (tmp_path / "dest" / ".loss.json").read_bytes()
    assert history.endswith(b"\n") and doc["final_loss"]["history_steps"] >= doc["steps"][0]
    assert cli("validate", str(tmp_path / "dest")).returncode == 0


def test_fork_of_a_live_run(live, tmp_path):
    for i in range(3):
        step = committed(live)[-1]
        dest = tmp_path / f"fork{i}"
        held = {}

        def hold(op, path, dest=dest, step=step):    # first write of the fork (staged beside DEST)
            if not held and f"fork.{dest.name}." in path:
                held["steps"] = wait_for_commits(live, step)
        fsio.hook = hold
        try:
            out = fork(live, step, dest)
        finally:
            fsio.hook = None
        assert out["step"] == step and step in held["steps"]
        report = validate_run(dest)
        assert report.ok and report.status == "verified", report.findings
        manifest = json.loads((dest / f"step_{step:06d}.json").read_text())
        assert manifest["provenance"]["parent_step"] == step


def test_validate_of_a_live_run(live):
    for _ in range(3):
        held = {}

        def hold(n_bytes):                          # while the oldest listed generation is hashed
            if not held:
                held["steps"] = wait_for_commits(live, max(committed(live)))
        report = validate_run(live, progress=hold)
        assert report.ok, report.findings
        assert held and len(report.details["generations"]) >= KEEP
        assert {g["status"] for g in report.details["generations"]} <= {"verified", "save in progress"}
        assert not [f for f in report.findings if f.code in ("leftover_temp", "uncommitted")]
    out = cli("validate", str(live), "--json", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "interrupted save" not in out.stdout


def test_ls_deep_of_a_live_run(live):
    for _ in range(25):
        d = ls_run(live, deep=True)
        assert d["lock"] and d["lock"]["pid"] != os.getpid() and d["leftovers"] == []
        assert d["generations"] and {g["status"] for g in d["generations"]} <= {"verified", "save in progress"}
    out = cli("ls", "--deep", "--json", str(live), timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["leftovers"] == []


def test_the_checkpoint_managers_retention_honours_a_lease(tmp_path):
    """The manager prunes through Run.gc, so it keeps a reader's generation without knowing it."""
    import torch

    from ckptfmt.run import ReadLease
    from ckptfmt.torch import CheckpointManager
    from models import tiny_linear
    model = tiny_linear()
    opt = torch.optim.Adam(model.parameters())
    mgr = CheckpointManager(tmp_path, model, opt, every=1, keep_last=1, handle_signals=False)
    mgr.save(1)
    with ReadLease(tmp_path, purpose="reader") as lease:
        assert lease.steps == [1]
        for step in (2, 3):
            mgr.save(step)
        assert committed(tmp_path) == [1, 3]           # 1 leased, 2 pruned, 3 the newest
    mgr.save(4)
    mgr.close()
    assert committed(tmp_path) == [4]
