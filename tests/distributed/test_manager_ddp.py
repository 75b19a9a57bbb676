"""CheckpointManager under torchrun with DDP and FSDP2: sharded generations, one
decision per step when a signal reaches any one rank, and a bit-exact resume (2 gloo ranks on
the CPU).

The straight run a SIGTERMed run must end bit-identical to is verify-resume's continuous run of
the same loop (``verified``): STEPS steps from scratch, a generation every EVERY steps, in a fresh
torchrun job, as a straight run is; verify-resume's own verdict on the loop is checked there too."""
from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest

pytest.importorskip("torch")
from conftest import cli, last_step  # noqa: E402
from faults import scale  # noqa: E402
from torchrun import PY, Job, standalone, succeeds  # noqa: E402

# 2 ranks: never beside another torchrun job; a hang fails in minutes (a test takes 10-30 s)
pytestmark = [pytest.mark.xdist_group("torchrun"), pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]
DDP = [*standalone(2), str(ROOT / "examples" / "ddp_loop.py")]
STEPS, EVERY = 150, 50
# Where a SIGTERM to one rank lands, one point per phase of the run (a generation every EVERY
# steps): before the first commit (the SIGTERM's generation is the only one to resume from) and at
# a save step (the signal comes as generation 100 is written) under DDP, between two saves under
# FSDP2; the long tier adds random points under DDP.
DDP_POINTS = sorted({25, 2 * EVERY} | set(random.Random(16).sample(range(5, STEPS - 5), scale(0, 3))))
FSDP_POINT = 70


def ddp(run: Path, *extra: str) -> list[str]:
    return [*DDP, "--steps", str(STEPS), "--output", str(run), "--every", str(EVERY), *extra]


def final(run: Path) -> tuple[str, list[bytes]]:
    doc = json.loads((run / f"step_{STEPS:06d}.json").read_text())
    shards = sorted((run / f"step_{STEPS:06d}.shards").iterdir())
    return doc["blake3"], [p.read_bytes() for p in shards]


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """``verified(mode)``: verify-resume on the loop under torchrun ("" DDP, "--fsdp" FSDP2),
    STEPS steps cut at the middle: (its JSON verdict, its continuous run's directory)."""
    made = {}

    def get(mode: str) -> tuple[dict, Path]:
        if isinstance(made.get(mode), BaseException):     # a failure is kept: the next test fails at once
            raise AssertionError(f"verify-resume {mode or 'DDP'} failed in an earlier test") from made[mode]
        if mode not in made:
            try:
                made[mode] = verify(tmp_path_factory, mode)
            except BaseException as exc:
                made[mode] = exc
                raise
        return made[mode]
    return get


def verify(tmp_path_factory, mode: str) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("verify" + mode.replace("-", "_"))
    command = " ".join(DDP) + f" {mode} --every {EVERY} --updates {{steps}} --output {{output}} {{resume}} {{omit_rng}}"
    job = succeeds([PY, "-m", "ckptfmt.cli", "verify-resume", "--output", root / "proof", "--trainer", "command",
                    "--command", command, "--steps", str(STEPS), "--cut", str(STEPS // 2), "--json"],
                   root / "verify.log", split=True, timeout=200)
    doc = json.loads(job.stdout())
    assert doc["checkpoints"]["continuous"]["file"] == f"step_{STEPS:06d}.json", job.stdout()[-2000:]
    return doc, root / "proof" / "continuous"


@pytest.mark.parametrize("point", DDP_POINTS)
def test_sigterm_to_one_rank_stops_all_at_one_step_and_the_resume_is_bit_exact(verified, tmp_path, point):
    sigterm_one_rank_then_resume(tmp_path, point, verified("")[1])


def test_fsdp2_sigterm_and_resume_are_bit_exact(verified, tmp_path):
    """FSDP2 (fully_shard): each rank saves and restores its own rows; the sharded generation
    validates and the resumed run ends bit-identical to the straight FSDP2 run."""
    run = sigterm_one_rank_then_resume(tmp_path, FSDP_POINT, verified("--fsdp")[1], "--fsdp")
    doc = json.loads((run / f"step_{STEPS:06d}.json").read_text())
    assert doc["world_size"] == 2 and len(doc["ranks"]) == 2
    noise = [r["rng"]["generators"]["noise"]["state"] for r in doc["ranks"]]
    assert noise[0] != noise[1]                  # each rank's own generator, restored to each rank


def sigterm_one_rank_then_resume(tmp_path: Path, point: int, straight: Path, *extra: str) -> Path:
    run = tmp_path / "run"
    with Job(ddp(run, *extra), tmp_path / "cut.log") as job:
        rank1 = job.worker_of_rank(1)
        job.wait_for(lambda: last_step(run) >= point, f"step {point}")
        os.kill(rank1, signal.SIGTERM)
        assert job.finish(120) == 0, job.tail()
    committed = sorted(int(p.name[5:11]) for p in run.glob("step_*.json"))
    assert committed[-1] == last_step(run) < STEPS, job.tail()    # both ranks saved the same step
    checked = cli("validate", str(run))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    succeeds(ddp(run, *extra), tmp_path / "resume.log")
    assert final(run) == final(straight)
    return run


@pytest.mark.parametrize("mode", ["", "--fsdp"])
def test_verify_resume_passes_under_torchrun(verified, mode):
    doc, _ = verified(mode)
    assert doc["positive"] and doc["negative_divergence_detected"], json.dumps(doc["failed_checks"])
