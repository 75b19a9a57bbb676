"""What ``Accelerator.prepare`` returns (a prepared model, ``AcceleratedOptimizer``,
``AcceleratedScheduler``) in the manager and in ``ct.save`` / ``ct.load``: the wrapped optimizer
is what is mapped; an accelerate loop resumes bit-exactly after SIGTERM, in one process and in
two gloo processes (MULTI_CPU, a DDP-wrapped model with ``module.`` names), and passes
verify-resume with a diverging negative control."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")
from conftest import cli, last_step  # noqa: E402
from torchrun import PY, Job, standalone, succeeds  # noqa: E402

import ckptfmt.torch as ct  # noqa: E402
from ckptfmt.errors import UnsupportedOptimizerError  # noqa: E402
from ckptfmt.torch import CheckpointManager  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LOOP = ROOT / "examples" / "accelerate_loop.py"
STEPS = 60


@pytest.fixture
def accelerator():
    from accelerate.state import AcceleratorState
    yield accelerate.Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)     # the next test's Trainer starts clean


def prepared(acc):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return acc.prepare(model, opt, sched)


def train(acc, model, opt, sched, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(5, 4)).pow(2).mean()
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        sched.step()


def test_the_manager_takes_prepared_objects_and_maps_the_adamw_inside(accelerator, tmp_path):
    model, opt, sched = prepared(accelerator)
    assert type(opt).__name__ == "AcceleratedOptimizer" and type(sched).__name__ == "AcceleratedScheduler"
    train(accelerator, model, opt, sched, 3)
    with CheckpointManager(tmp_path / "run", model, opt, sched, handle_signals=False) as mgr:
        mgr.save(3)
    doc = json.loads((tmp_path / "run" / "step_000003.json").read_text())
    assert doc["optimizer"]["type"] == "AdamW" and doc["optimizer"]["step"] == 3
    assert doc["scheduler_type"] == "StepLR" and doc["scheduler"]["last_epoch"] == 3
    # restored into a plain loop (no accelerate): the same classes inside, so it resumes
    torch.manual_seed(1)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    popt = torch.optim.AdamW(plain.parameters(), lr=1.0)
    psched = torch.optim.lr_scheduler.StepLR(popt, step_size=2)
    with CheckpointManager(tmp_path / "run", plain, popt, psched, handle_signals=False) as mgr:
        assert mgr.restore() == 3
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
    inner = opt.optimizer.state_dict()
    assert torch.equal(popt.state_dict()["state"][0]["exp_avg_sq"], inner["state"][0]["exp_avg_sq"])
    assert psched.state_dict() == sched.scheduler.state_dict()


def test_ct_save_of_prepared_objects_is_byte_identical_to_the_unwrapped_ones(accelerator, tmp_path):
    model, opt, sched = prepared(accelerator)
    train(accelerator, model, opt, sched, 2)
    ct.save(str(tmp_path / "a.bin"), model, opt)
    ct.save(str(tmp_path / "b.bin"), model, opt.optimizer)
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    other, oopt, osched = prepared(accelerator)
    ct.load(str(tmp_path / "a.bin"), other, oopt)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))
    assert torch.equal(oopt.state[next(other.parameters())]["exp_avg"], opt.state[next(model.parameters())]["exp_avg"])


def test_a_wrapper_with_state_of_its_own_is_still_refused(tmp_path):
    class Lookahead(torch.optim.Optimizer):        # wraps an AdamW but keeps slow weights itself
        def __init__(self, inner):
            self.optimizer, self.state, self.param_groups = inner, {}, inner.param_groups
            self.defaults = inner.defaults

    model = torch.nn.Linear(2, 1)
    with pytest.raises(UnsupportedOptimizerError, match="Lookahead keeps state the seed layout cannot hold"):
        CheckpointManager(tmp_path / "run", model, Lookahead(torch.optim.AdamW(model.parameters())),
                          handle_signals=False)


def prepared_loop(run: Path, stop: int, stateful: bool = True, given: str = "StatefulDataLoader") -> list:
    """One process's life with a prepared shuffling loader in ``state=``: built from scratch,
    restored, trained to ``stop``, left without a save (what a SIGKILL leaves)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torchdata.stateful_dataloader import StatefulDataLoader
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    set_seed(0)
    x = torch.randn(40, 4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kind = StatefulDataLoader if given == "StatefulDataLoader" else torch.utils.data.DataLoader
    loader = kind(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=6, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    with CheckpointManager(run, model, opt, state={"data": loader}, every=5, handle_signals=False) as mgr:
        step = mgr.restore()
        while step < stop:
            for xb, yb in loader:
                step += 1
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                acc.backward(loss)
                opt.step()
                mgr.step(step, loss=loss.item())
                if step == stop:
                    break
    AcceleratorState._reset_state(reset_partial_state=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(60)                    # ~3 s: three short legs in this process
def test_a_prepared_stateful_loader_resumes_mid_epoch_bit_exactly_and_a_plain_one_is_refused(tmp_path):
    pytest.importorskip("torchdata")
    straight = prepared_loop(tmp_path / "straight", 23)
    prepared_loop(tmp_path / "cut", 17)      # 7 batches an epoch: generation 15 is mid-epoch 3
    assert all(torch.equal(a, b) for a, b in zip(straight, prepared_loop(tmp_path / "cut", 23)))
    with pytest.raises(TypeError, match=r"state\['data'\]: a DataLoader cannot save its position.*"
                                        r"use_stateful_dataloader=True"):
        prepared_loop(tmp_path / "plain", 5, stateful=False)      # accelerate's wrapper of a plain DataLoader
    with pytest.raises(TypeError, match=r"its BatchSampler around a shuffling RandomSampler cannot save the epoch"):
        prepared_loop(tmp_path / "torch-sampler", 5, given="DataLoader")    # torch's sampler inside a stateful one
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)


def loop(run: Path, *extra: str, world: int = 1) -> list[str]:
    launcher = standalone(2) if world > 1 else [PY]
    return [*launcher, str(LOOP), "--steps", str(STEPS), "--output", str(run), "--every", "20", *extra]


def finished(run: Path, world: int) -> list[bytes]:
    if world == 1:
        return [(run / f"step_{STEPS:06d}.bin").read_bytes()]
    return [p.read_bytes() for p in sorted((run / f"step_{STEPS:06d}.shards").iterdir())]


@pytest.mark.timeout(90)                    # 8-15 s in one process, 12-23 s in two
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.xdist_group("torchrun"))],
                         ids=["one-process", "two-gloo-processes"])      # 2 ranks: never beside another torchrun job
def test_an_accelerate_loop_sigtermed_and_resumed_ends_bit_identical_to_a_straight_run(tmp_path, world):
    straight = tmp_path / "straight"
    succeeds(loop(straight, world=world), tmp_path / "straight.log")
    run = tmp_path / "cut"
    with Job(loop(run, world=world), tmp_path / "cut.log") as job:
        target = job.worker_of_rank(1) if world > 1 else job.pid      # a signal reaching one rank
        job.wait_for(lambda: last_step(run) >= 27, "step 27")
        os.kill(target, signal.SIGTERM)
        assert job.finish(120) == 0, job.tail()
    stopped = last_step(run)
    assert 27 <= stopped < STEPS and stopped % 20 != 0, job.tail()     # committed where it stopped
    marker = "json" if world > 1 else "bin"
    assert (run / f"step_{stopped:06d}.{marker}").exists()
    checked = cli("validate", str(run))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    if world > 1:
        names = [e["name"] for e in json.loads((run / f"step_{stopped:06d}.json").read_text())["layout"]]
        assert names[0] == "module.0.weight"                            # DDP-wrapped under MULTI_CPU
    succeeds(loop(run, world=world), tmp_path / "resume.log")
    assert finished(run, world) == finished(straight, world)


@pytest.mark.timeout(60)                    # 12-18 s: four runs in one process each
def test_verify_resume_passes_on_the_accelerate_loop_and_its_negative_control_diverges(tmp_path):
    command = f"{PY} {LOOP} --updates {{steps}} --output {{output}} {{resume}} {{omit_rng}}"
    proc = cli("verify-resume", "--output", str(tmp_path / "proof"), "--trainer", "command",
               "--command", command, "--steps", "40", "--cut", "20", "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["positive"] and doc["negative_divergence_detected"]
    assert all(c["max_deviation"] == 0 for c in doc["checks"]["resume"].values())
