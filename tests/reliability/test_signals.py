"""Signals against the real trainer (RELIABILITY.md items 21-23)."""
import random
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

import ckptfmt  # noqa: E402
from ckptfmt.run import history as hist  # noqa: E402
from ckptfmt.run import Run  # noqa: E402
from ckptfmt.tools.validate import validate_run  # noqa: E402
from faults import scale  # noqa: E402

from conftest import last_step  # noqa: E402
import warm  # noqa: E402

PY = sys.executable


def cmd(run, steps, every=10):
    return [PY, "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", str(steps), "--config", "tiny",
            "--checkpoint-every", str(every), "--sample-every", "0", "--log-every", "100000"]


def wait_step(run, step, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while last_step(run) < step:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)


def test_100_sigusr1_each_followed_by_a_committed_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = warm.Popen(cmd(run, 10**6, every=10**6), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rng = random.Random(3)
    sent = []
    try:
        wait_step(run, 3, proc)
        for _ in range(scale(100, 1000)):
            proc.send_signal(signal.SIGUSR1)
            sent.append(time.time())
            time.sleep(rng.uniform(0, 0.05))
        time.sleep(0.3)
        assert proc.poll() is None                   # training continued through all of them
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    events = [e for e in hist.read(run / ".loss.json").events() if e["event"] == "checkpoint"]
    times = sorted(e["time"] for e in events if e["reason"] in ("SIGUSR1", "SIGTERM"))
    for t in sent:
        assert any(ct >= t for ct in times)
    steps = [e["step"] for e in events]
    assert len(steps) == len(set(steps)) >= 10       # one writer: every checkpoint a distinct step
    assert validate_run(run).ok and not list(run.glob(".ckptfmt-tmp*"))


def test_sigterm_at_random_points_checkpoints_the_last_completed_step(tmp_path):
    rng = random.Random(4)
    for i in range(scale(3, 50)):
        run = tmp_path / f"r{i}"
        proc = warm.Popen(cmd(run, 10**6), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_step(run, rng.randint(1, 60), proc)
        time.sleep(rng.uniform(0, 0.05))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert Run(run).latest(deep=True).step == last_step(run)


def test_sigterm_then_sigkill_during_the_final_save_keeps_the_previous_generation(tmp_path):
    rng = random.Random(5)
    for i in range(scale(4, 100)):
        run = tmp_path / f"r{i}"
        proc = warm.Popen(cmd(run, 10**6, every=5), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_step(run, rng.randint(6, 40), proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(rng.uniform(0, 0.02))
        proc.kill()
        proc.wait()
        gen = Run(run).latest(deep=True)
        assert gen is not None and ckptfmt.open(gen.bin, verify=True)


def test_kill_and_resume_cycles_end_bit_identical(tmp_path):
    target = 200
    straight = tmp_path / "straight"
    warm.run(cmd(straight, target), check=True, capture_output=True)
    run = tmp_path / "run"
    rng = random.Random(6)
    for cycle in range(scale(6, 100)):
        proc = warm.Popen(cmd(run, target), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        start = last_step(run)
        try:
            wait_step(run, min(target - 1, start + rng.randint(3, 12)), proc)
        except AssertionError:
            break                                   # it finished before we could kill it
        proc.kill()
        proc.wait()
    warm.run(cmd(run, target), check=True, capture_output=True)
    a = ckptfmt.open(straight / "step_000200.bin").fingerprint()
    assert ckptfmt.open(run / "step_000200.bin", verify=True).fingerprint() == a
    keep = ("step", "loss", "lr", "source")
    canon = [{k: r[k] for k in keep} for r in hist.read(run / ".loss.json").canonical()]
    assert [r["step"] for r in canon] == list(range(1, target + 1))
    assert canon == [{k: r[k] for k in keep} for r in hist.read(straight / ".loss.json").canonical()]
