"""The RAM tier (spec/RUN.md §13): generations in node-local memory between durable ones, and a
restore that takes the newest generation that verifies across both tiers. Fresh processes, real
SIGKILLs, the RAM tier in the test's tmp dir (CKPTFMT_MEMORY_DIR)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

import ckptfmt  # noqa: E402
from ckptfmt.run import history as hist  # noqa: E402
from ckptfmt.run import Run, tiers  # noqa: E402
from ckptfmt.tools.validate import validate_run  # noqa: E402

from conftest import cli, last_step, small_tmpfs  # noqa: E402
import warm  # noqa: E402

PY = sys.executable
N = 120


def env(memory) -> dict:
    return {**os.environ, tiers.MEMORY_ENV: str(memory)}


def cmd(run, *extra):
    return [PY, "-m", "ckptfmt.cli", "train", "--run", str(run), "--config", "tiny", "--steps", str(N),
            "--checkpoint-every", "50", "--sample-every", "0", "--log-every", "100000", *map(str, extra)]


def train(run, memory, *extra):
    return warm.run(cmd(run, *extra), env=env(memory), capture_output=True, text=True, timeout=300)


def killed_after(run, memory, step=73) -> int:
    """Train with --memory-every 5 and SIGKILL the trainer once step ``step`` is recorded; the
    last step recorded."""
    proc = warm.Popen(cmd(run, "--memory-every", 5), env=env(memory), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while last_step(run) < step:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    return last_step(run)


def final(run, step=N):
    return ckptfmt.open(Path(run) / f"step_{step:06d}.bin", verify=True).fingerprint()


def events(run, kind):
    return [e for e in hist.read(Path(run) / ".loss.json").events() if e["event"] == kind]


def canonical(run):
    keep = ("step", "loss", "loss_ema", "lr", "source", "tokens")
    return [{k: r[k] for k in keep} for r in hist.read(Path(run) / ".loss.json").canonical()]


def ram_dir(run, memory) -> Path:
    """The run's RAM tier: keyed by its ID, not its path."""
    return Path(memory) / tiers.run_id(run)


def ram_steps(run, memory) -> list:
    where = ram_dir(run, memory)
    return [g.step for g in Run(where).generations() if g.committed] if where.is_dir() else []


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The same run, uninterrupted and without a RAM tier."""
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = train(run, tmp_path_factory.mktemp("unused"))
    assert proc.returncode == 0, proc.stderr
    return run


# ---------------------------------------------------------------- the reference trainer
def test_a_killed_run_resumes_from_its_ram_generation_and_ends_bit_identical(tmp_path, straight):
    run, memory = tmp_path / "run", tmp_path / "shm"
    killed_at = killed_after(run, memory)
    held = ram_steps(run, memory)
    assert len(held) <= 2 and max(held) >= 70 and max(held) % 5 == 0       # retention keeps two there
    assert [g.step for g in Run(run).generations() if g.committed] == [50]
    listed = json.loads(cli("ls", str(run), "--json", env={tiers.MEMORY_ENV: str(memory)}).stdout)
    assert [g["step"] for g in listed["tiers"]["memory"]["generations"]] == held
    assert {g["tier"] for g in listed["tiers"]["memory"]["generations"]} == {"memory"}
    proc = train(run, memory, "--memory-every", 5)
    assert proc.returncode == 0, proc.stderr
    resume = events(run, "resume")[-1]
    assert resume["tier"] == "memory" and 70 <= resume["step"] == max(held) <= killed_at
    assert killed_at - resume["step"] < 5 + 1 and "(RAM tier)" in proc.stderr
    assert final(run) == final(straight)
    assert canonical(run) == canonical(straight)
    assert {e["step"] for e in events(run, "checkpoint") if e.get("tier") == "memory"} >= {5, 65, 70, 115}
    assert validate_run(run).ok


def test_with_the_ram_tier_wiped_the_run_resumes_from_disk_bit_identical(tmp_path, straight):
    run, memory = tmp_path / "run", tmp_path / "shm"
    killed_after(run, memory)
    shutil.rmtree(memory)                              # what a reboot does to /dev/shm
    proc = train(run, memory, "--memory-every", 5)
    assert proc.returncode == 0, proc.stderr
    resume = events(run, "resume")[-1]
    assert (resume["step"], resume["tier"]) == (50, "disk")
    assert final(run) == final(straight)
    assert canonical(run) == canonical(straight)


def test_a_corrupted_ram_generation_is_skipped_with_its_reason(tmp_path, straight):
    run, memory = tmp_path / "run", tmp_path / "shm"
    killed_after(run, memory)
    newest, before = max(ram_steps(run, memory)), min(ram_steps(run, memory))
    damaged = ram_dir(run, memory) / f"step_{newest:06d}.bin"
    with open(damaged, "r+b") as f:                    # one flipped bit in the weights
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    proc = train(run, memory, "--memory-every", 5)
    assert proc.returncode == 0, proc.stderr
    assert f"skipping RAM generation {newest}: " in proc.stderr and "blake3" in proc.stderr
    resume = events(run, "resume")[-1]
    assert (resume["step"], resume["tier"]) == (before, "memory")
    assert final(run) == final(straight)


def test_a_full_ram_tier_is_a_warning_and_the_run_goes_on(tmp_path, straight):
    run = tmp_path / "run"
    with small_tmpfs(tmp_path / "full") as full:      # 64 KiB: no generation fits
        proc = train(run, full, "--memory-every", 5)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("skipped the save of step 5:") == 1 and "No space left" in proc.stderr
    assert "skipped the save of step 10" not in proc.stderr      # said once, not at every step
    assert [g.step for g in Run(run).generations()] == [50, 100, 120]
    assert final(run) == final(straight)
    assert not [e for e in events(run, "checkpoint") if e.get("tier") == "memory"]


def test_a_recreated_run_directory_does_not_pick_up_the_old_runs_ram_generations(tmp_path, straight):
    run, memory = tmp_path / "run", tmp_path / "shm"
    killed_after(run, memory)
    old_dir, old_steps = ram_dir(run, memory), ram_steps(run, memory)
    shutil.rmtree(run)
    proc = train(run, memory, "--memory-every", 5)
    assert proc.returncode == 0, proc.stderr
    assert not events(run, "resume") and events(run, "start")          # a fresh start
    assert ram_dir(run, memory) != old_dir and not ram_dir(run, memory).exists()   # its own, emptied at close
    assert any(e.get("tier") == "memory" for e in events(run, "checkpoint"))      # which it saved to
    assert "removed RAM generations" in proc.stdout + proc.stderr
    assert [g.step for g in Run(old_dir).generations() if g.committed] == old_steps     # not touched
    assert final(run) == final(straight)          # RAM saves do not change the trajectory


# ---------------------------------------------------------------- the manager in a plain loop
# the manager in a plain loop: ram_loop.py beside this file
LOOP = Path(__file__).with_name("ram_loop.py")


def loop(tmp_path, run, memory, kill_at=0, nan_at=0, memory_every=5, mode="sync"):
    return warm.run([PY, str(LOOP), str(run), str(kill_at), str(nan_at), str(memory_every), mode, "120"],
                    env=env(memory), capture_output=True, text=True, timeout=120)


def test_the_manager_resumes_a_plain_loop_from_ram_bit_exactly(tmp_path):
    plain = loop(tmp_path, tmp_path / "plain", tmp_path / "shm", memory_every=0)
    assert plain.returncode == 0, plain.stderr
    run = tmp_path / "run"
    killed = loop(tmp_path, run, tmp_path / "shm", kill_at=73)
    assert killed.returncode == -signal.SIGKILL
    again = loop(tmp_path, run, tmp_path / "shm")
    assert again.returncode == 0, again.stderr
    assert "START 70 memory" in again.stdout
    assert (run / "step_000120.bin").read_bytes() == (tmp_path / "plain" / "step_000120.bin").read_bytes()
    assert (events(run, "resume")[-1]["step"], events(run, "resume")[-1]["tier"]) == (70, "memory")


def test_async_ram_saves_resume_the_newest_committed_one_bit_exactly(tmp_path):
    plain = loop(tmp_path, tmp_path / "plain", tmp_path / "shm", memory_every=0)
    assert plain.returncode == 0, plain.stderr
    run = tmp_path / "run"
    killed = loop(tmp_path, run, tmp_path / "shm", kill_at=73, mode="async")   # 70's save may be in flight
    assert killed.returncode == -signal.SIGKILL
    saved = {e["step"] for e in events(run, "checkpoint") if e.get("tier") == "memory"}
    assert {5, 10, 60} <= saved <= set(range(5, 71, 5)) - {50}      # each event once its save committed
    again = loop(tmp_path, run, tmp_path / "shm", mode="async")
    assert again.returncode == 0, again.stderr
    start = events(run, "resume")[-1]
    assert start["tier"] == "memory" and start["step"] in (65, 70)
    assert (run / "step_000120.bin").read_bytes() == (tmp_path / "plain" / "step_000120.bin").read_bytes()
    assert {e["step"] for e in events(run, "checkpoint") if e.get("tier") == "memory"} >= {75, 115}


def test_an_incomplete_ram_generation_is_skipped_and_its_timeline_removed(tmp_path):
    run, memory = tmp_path / "run", tmp_path / "shm"
    assert loop(tmp_path, run, memory, kill_at=73).returncode == -signal.SIGKILL
    (ram_dir(run, memory) / "step_000070.json").unlink()          # killed before its manifest
    again = loop(tmp_path, run, memory, kill_at=66)
    assert f"{ram_dir(run, memory)}: skipping RAM generation 70: not committed: no manifest" in again.stdout
    assert "START 65 memory" in again.stdout
    assert not (ram_dir(run, memory) / "step_000070.bin").exists()      # the lost timeline's


def test_a_diverged_ram_generation_is_passed_over_as_a_diverged_disk_one(tmp_path):
    run = tmp_path / "run"
    killed = loop(tmp_path, run, tmp_path / "shm", kill_at=73, nan_at=68)
    assert killed.returncode == -signal.SIGKILL
    again = loop(tmp_path, run, tmp_path / "shm", kill_at=66)
    assert "START 65 memory" in again.stdout
    assert "generation(s) 70 (RAM) (weights: " in again.stdout and "diverged" in again.stdout
    resume = events(run, "resume")[-1]
    assert resume["tier"] == "memory" and "70 (RAM)" in resume["skipped_diverged"]


def test_a_file_in_place_of_the_ram_tier_is_a_warning_and_the_loop_goes_on(tmp_path):
    blocker = tmp_path / "shm"
    blocker.write_text("not a directory")
    proc = loop(tmp_path, tmp_path / "run", blocker)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("skipped the save of step 5:") == 1
    assert [g.step for g in Run(tmp_path / "run").generations() if g.committed] == [50, 100, 120]
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_ram_tier_removed_while_the_run_trains_is_made_again_at_the_next_ram_save(tmp_path, monkeypatch, asynchronous):
    """systemd's RemoveIPC or a per-job tmpfs removes the tier's directory mid-run: the next RAM
    save makes it again and says so once, and RAM saves go on (before, every later one failed,
    and a SIGKILL lost up to a durable interval of steps)."""
    from ckptfmt.torch import CheckpointManager
    from models import tiny_adamw, train_steps
    monkeypatch.setenv(tiers.MEMORY_ENV, str(tmp_path / "shm"))
    model, opt = tiny_adamw()
    said = []
    with CheckpointManager(tmp_path / "run", model, opt, every=100, keep_last=None, memory_every=2,
                           async_save=asynchronous, handle_signals=False, log=said.append) as mgr:
        for step in range(1, 11):
            train_steps(model, opt, 1)
            mgr.step(step, loss=1.0)
            if step == 4:
                mgr._memory.settle()
                shutil.rmtree(tiers.memory_dir(tmp_path / "run"))
        mgr._memory.settle()
    ram = tiers.memory_dir(tmp_path / "run")
    assert [g.step for g in Run(ram).generations() if g.committed] == [8, 10]
    assert [m for m in said if "its directory was removed while the run trained" in m and "step 6" in m] and \
        not [m for m in said if "skipped the save" in m], said
