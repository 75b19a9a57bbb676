"""CheckpointManager: any PyTorch loop resumes bit-exactly after SIGTERM, SIGKILL or SIGUSR1,
every piece of its state is restored or refused by name, and the tools work on its runs."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ckptfmt.errors import (IncompleteResumeStateError, RunLockedError,  # noqa: E402
                            UnsupportedOptimizerError)
import warm  # noqa: E402
from ckptfmt.torch import CheckpointManager  # noqa: E402
from conftest import cli, last_step  # noqa: E402
from faults import scale  # noqa: E402
from verify_runs import verify_resume  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ROOT / "examples" / "plain_loop.py"
PY = sys.executable
STEPS = 60


# The loop's processes are forked from the warm parent (tests/warm.py): each a process of its own,
# with its own pid, signals, exit code and output, without a cold interpreter's seconds of imports.
def plain(run: Path, steps: int = STEPS, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = warm.run([PY, str(PLAIN), "--steps", str(steps), "--output", str(run), "--every", "10", *extra],
                    capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    plain(run)
    return run


def final_bytes(run: Path) -> tuple[bytes, bytes]:
    return ((run / f"step_{STEPS:06d}.bin").read_bytes(), (run / f"step_{STEPS:06d}.extra.safetensors").read_bytes())


def interrupt_at(run: Path, step: int, sig: int) -> int:
    """Start the loop, deliver ``sig`` once its history reaches ``step``; its exit code."""
    proc = warm.Popen([PY, str(PLAIN), "--steps", str(STEPS), "--output", str(run), "--every", "10"],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while last_step(run) < step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    return proc.returncode


# One interruption point per phase of the loop (a generation every 10 steps): before the first
# commit (nothing to resume from yet), between two saves, and at a save step (the signal comes as
# generation 30 is written). The long tier adds 10 random points.
PHASES = (5, 23, 30)


def interruption_points(sig: int) -> list[int]:
    return sorted(set(PHASES) | set(random.Random(sig).sample(range(3, STEPS - 3), scale(0, 10))))


@pytest.mark.timeout(scale(30, 300))
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_interrupted_and_resumed_runs_end_bit_identical(straight, tmp_path, sig):
    want = final_bytes(straight)
    for point in interruption_points(sig):
        run = tmp_path / f"p{point}"
        code = interrupt_at(run, point, sig)
        if sig == signal.SIGTERM:
            assert code in (0, -signal.SIGTERM), f"SIGTERM at step {point}: exit {code}"
        plain(run)
        assert final_bytes(run) == want, f"{signal.Signals(sig).name} at step {point}"


@pytest.mark.timeout(30)
def test_sigterm_commits_the_step_it_stopped_at_and_exits_0(tmp_path):
    run = tmp_path / "r"
    assert interrupt_at(run, 23, signal.SIGTERM) == 0
    steps = sorted(int(p.stem[5:]) for p in run.glob("step_*.bin"))
    assert steps[-1] == last_step(run) and steps[-1] % 10 != 0 or steps[-1] == last_step(run)
    assert cli("validate", str(run)).returncode == 0


@pytest.mark.timeout(30)
def test_sigusr1_commits_and_training_continues(tmp_path):
    run = tmp_path / "r"
    proc = warm.Popen([PY, str(PLAIN), "--steps", "400", "--output", str(run), "--every", "1000"],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while last_step(run) < 30 and proc.poll() is None:
        time.sleep(0.002)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=120) == 0
    steps = sorted(int(p.stem[5:]) for p in run.glob("step_*.bin"))
    assert len(steps) == 2 and 30 <= steps[0] < 400 and steps[-1] == 400
    assert cli("validate", str(run)).returncode == 0


@pytest.mark.timeout(30)
def test_tools_work_on_manager_runs(straight, tmp_path):
    other = tmp_path / "other"
    plain(other, 40)
    a, b = straight / "step_000040.bin", other / "step_000040.bin"
    assert cli("diff", str(a), str(b)).returncode == 0            # the same 40 steps: identical
    bis = cli("bisect", str(straight), str(other), "--json")
    assert bis.returncode in (0, 1) and json.loads(bis.stdout)["first_generation_difference"] is None
    assert cli("plot", str(straight), "--out", str(tmp_path / "loss.png")).returncode == 0
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert cli("inspect", str(a)).returncode == 0 and cli("ls", str(straight)).returncode == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("piece,check", [
    ("optimizer", "optimizer"), ("scheduler", "scheduler"), ("buffers", "buffers"),
    ("sampler-state", "sample_ids"), ("generator-noise", "losses"), ("generator-sampler", "next_draws"),
    ("rng-python", "next_draws"), ("rng-numpy", "next_draws"), ("rng-torch", "losses")])
def test_each_piece_left_out_fails_verify_resume_naming_it(tmp_path, piece, check):
    command = f"{PY} {ROOT / 'tests' / 'manager_faults.py'} {piece} --updates {{steps}} --output {{output}} {{resume}} {{omit_rng}}"
    proc = verify_resume("--output", tmp_path / "proof", "--trainer", "command", "--command", command,
                         "--steps", "40", "--cut", "20", "--json")   # epochs of 16 steps
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    result = json.loads(proc.stdout)
    assert not result["positive"] and f"resume.{check}" in result["failed_checks"], result["failed_checks"]


@pytest.mark.timeout(60)
def test_verify_resume_passes_on_the_plain_loop(tmp_path):
    """The console command as the example's docstring gives it, each run a cold interpreter;
    docs/how-to/prove-resume.md shows this command (its block is not run there: this is its twin)."""
    shown = "ckptfmt verify-resume --output proof --trainer command \\\n    --command 'python examples/plain_loop.py --updates {steps} --output {output} {resume} {omit_rng}'"
    assert shown in (ROOT / "docs" / "how-to" / "prove-resume.md").read_text()
    command = f"{PY} {PLAIN} --updates {{steps}} --output {{output}} {{resume}} {{omit_rng}}"
    proc = cli("verify-resume", "--output", str(tmp_path / "proof"), "--trainer", "command",
               "--command", command, "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["positive"] and doc["negative_divergence_detected"]
    assert all(c["max_deviation"] == 0 for c in doc["checks"]["resume"].values())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("length", [[], ["--steps", "5", "--updates", "5"]])
def test_the_plain_loop_asks_for_its_length_in_one_line(tmp_path, length):
    proc = warm.run([PY, str(PLAIN), "--output", str(tmp_path / "r"), *length], capture_output=True,
                    text=True, timeout=60)
    assert proc.returncode == 2 and "give one of --steps N or --updates N" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


# ---------------------------------------------------------------- the library, in process
def small(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)).to(dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, steps, dtype=torch.float32):
    for _ in range(steps):
        loss = model(torch.randn(16, 4, dtype=dtype)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_bf16_parameters_survive_bit_exactly(tmp_path):
    model, opt = small(torch.bfloat16)
    train(model, opt, 3, torch.bfloat16)
    with CheckpointManager(tmp_path / "r", model, opt, handle_signals=False) as mgr:
        mgr.save(3)
    doc = json.loads((tmp_path / "r" / "step_000003.json").read_text())
    assert {e.get("dtype") for e in doc["layout"]} == {"bfloat16"}
    model2, opt2 = small(torch.bfloat16)
    with CheckpointManager(tmp_path / "r", model2, opt2, handle_signals=False) as mgr:
        assert mgr.restore() == 3
    for a, b in zip(list(model.state_dict().values()), list(model2.state_dict().values())):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
        assert opt2.state[q]["exp_avg"].dtype == torch.bfloat16


def test_unsupported_optimizer_is_refused_at_construction(tmp_path):
    model, _ = small()
    with pytest.raises(UnsupportedOptimizerError, match="Adagrad.*supported: Adam, AdamW"):
        CheckpointManager(tmp_path / "r", model, torch.optim.Adagrad(model.parameters()), handle_signals=False)
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_sgd_momentum_and_scaler_round_trip(tmp_path):
    model, _ = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    train(model, opt, 2)
    with CheckpointManager(tmp_path / "r", model, opt, scaler=scaler, handle_signals=False) as mgr:
        mgr.save(2)
    model2, _ = small()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1.0)
    with CheckpointManager(tmp_path / "r", model2, opt2, scaler=scaler2, handle_signals=False) as mgr:
        assert mgr.restore() == 2
    assert scaler2.get_scale() == 1024.0
    assert json.loads((tmp_path / "r" / "step_000002.json").read_text())["optimizer"]["type"] == "SGD"
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], opt2.state[q]["momentum_buffer"])


def test_a_missing_piece_is_refused_by_name_or_listed_when_not_strict(tmp_path):
    model, opt = small()
    with CheckpointManager(tmp_path / "r", model, opt, handle_signals=False) as mgr:
        mgr.save(1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5)
    gen = np.random.default_rng(0)
    with CheckpointManager(tmp_path / "r", model, opt, sched, generators={"noise": gen}, handle_signals=False) as mgr:
        with pytest.raises(IncompleteResumeStateError, match="lacks scheduler"):
            mgr.restore()
    with CheckpointManager(tmp_path / "r", model, opt, sched, generators={"noise": gen}, handle_signals=False) as mgr:
        with pytest.warns(UserWarning):
            assert mgr.restore(strict=False) == 1
        assert mgr.fresh == ["scheduler", "rng.generators.noise"]


def test_one_manager_per_run_and_close_is_idempotent(tmp_path):
    model, opt = small()
    mgr = CheckpointManager(tmp_path / "r", model, opt, handle_signals=False)
    with pytest.raises(RunLockedError, match="checkpoint manager pid"):
        CheckpointManager(tmp_path / "r", model, opt, handle_signals=False)
    mgr.request_stop()
    assert mgr.step(7, loss=0.5) is True                 # SIGTERM path: step 7 committed
    mgr.close(7)                                         # same step: nothing more to commit
    mgr.close(7)
    assert sorted(p.name for p in (tmp_path / "r").glob("step_*.bin")) == ["step_000007.bin"]
    CheckpointManager(tmp_path / "r", model, opt, handle_signals=False).close()   # lock released


def test_under_torchrun_what_a_sharded_generation_cannot_hold_is_refused(tmp_path, monkeypatch):
    from ckptfmt.errors import UnsupportedSetupError
    from ckptfmt.torch import ranks
    monkeypatch.setattr(ranks, "rank_world", lambda: (0, 2))
    model, _ = small()
    with pytest.raises(UnsupportedSetupError, match="under torchrun the manager saves Adam/AdamW"):
        CheckpointManager(tmp_path / "r", model, torch.optim.SGD(model.parameters(), lr=0.1), handle_signals=False)
    bf16, _ = small(torch.bfloat16)
    with pytest.raises(UnsupportedSetupError, match="float32"):
        CheckpointManager(tmp_path / "r", bf16, torch.optim.AdamW(bf16.parameters()), handle_signals=False)


def test_collectives_use_the_cuda_device_on_an_nccl_only_group(monkeypatch):
    """The CPU twin of the NCCL path: which device the agreement's tensors go to."""
    from ckptfmt.torch import distributed as cd
    monkeypatch.setattr(cd.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(cd.torch.cuda, "current_device", lambda: 3)
    assert cd.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(cd.dist, "get_backend", lambda group=None: "cuda:nccl")    # a map without the CPU
    assert cd.collective_device() == torch.device("cuda", 3)
    for backend in ("gloo", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(cd.dist, "get_backend", lambda group=None, b=backend: b)
        assert cd.collective_device() == torch.device("cpu")
