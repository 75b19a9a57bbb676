"""CheckpointManager under torchrun with DDP and FSDP2 (issue 16): sharded generations, one
decision per step when a signal reaches any one rank, and a bit-exact resume (2 gloo ranks on
the CPU)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
from conftest import cli, last_step  # noqa: E402

pytestmark = pytest.mark.xdist_group("torchrun")
ROOT = Path(__file__).resolve().parent.parent
DDP = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
       str(ROOT / "examples" / "ddp_loop.py")]
STEPS = 300


def ddp(run: Path, *extra: str) -> list[str]:
    return [*DDP, "--steps", str(STEPS), "--output", str(run), "--every", "100", *extra]


def final(run: Path) -> tuple[str, list[bytes]]:
    doc = json.loads((run / f"step_{STEPS:06d}.json").read_text())
    shards = sorted((run / f"step_{STEPS:06d}.shards").iterdir())
    return doc["blake3"], [p.read_bytes() for p in shards]


def worker_of_rank(launcher: int, rank: int, timeout: float = 60) -> int:
    """PID of the torchrun worker of ``rank`` under the launcher process ``launcher``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = open(f"/proc/{entry}/stat").read()
                environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == launcher and f"RANK={rank}".encode() in environ:
                return int(entry)
        time.sleep(0.05)
    raise AssertionError(f"no worker of rank {rank} under {launcher}")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ddp") / "straight"
    proc = subprocess.run(ddp(run), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def straight_fsdp(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("fsdp") / "straight"
    proc = subprocess.run(ddp(run, "--fsdp"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.parametrize("point", random.Random(16).sample(range(5, STEPS - 5), 3))
def test_sigterm_to_one_rank_stops_all_at_one_step_and_the_resume_is_bit_exact(straight, tmp_path, point):
    sigterm_one_rank_then_resume(tmp_path / "run", point, straight)


def test_fsdp2_sigterm_and_resume_are_bit_exact(straight_fsdp, tmp_path):
    """FSDP2 (fully_shard): each rank saves and restores its own rows; the sharded generation
    validates and the resumed run ends bit-identical to the straight FSDP2 run."""
    run = sigterm_one_rank_then_resume(tmp_path / "run", 140, straight_fsdp, "--fsdp")
    doc = json.loads((run / f"step_{STEPS:06d}.json").read_text())
    assert doc["world_size"] == 2 and len(doc["ranks"]) == 2
    noise = [r["rng"]["generators"]["noise"]["state"] for r in doc["ranks"]]
    assert noise[0] != noise[1]                  # each rank's own generator, restored to each rank


def sigterm_one_rank_then_resume(run: Path, point: int, straight: Path, *extra: str) -> Path:
    proc = subprocess.Popen(ddp(run, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rank1 = worker_of_rank(proc.pid, 1)
    while last_step(run) < point and proc.poll() is None:
        time.sleep(0.005)
    os.kill(rank1, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    committed = sorted(int(p.name[5:11]) for p in run.glob("step_*.json"))
    assert committed[-1] == last_step(run) < STEPS               # both ranks saved the same step
    assert cli("validate", str(run)).returncode == 0
    proc = subprocess.run(ddp(run, *extra), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final(run) == final(straight)
    return run


@pytest.mark.parametrize("mode", ["", "--fsdp"])
def test_verify_resume_passes_under_torchrun(tmp_path, mode):
    command = " ".join(DDP) + f" {mode} --updates {{steps}} --output {{output}} {{resume}} {{omit_rng}}"
    proc = cli("verify-resume", "--output", str(tmp_path / "proof"), "--trainer", "command",
               "--command", command, "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["positive"] and doc["negative_divergence_detected"]
