"""What ``Accelerator.prepare`` returns (a prepared model, ``AcceleratedOptimizer``,
``AcceleratedScheduler``) in the manager and in ``ct.save`` / ``ct.load``: the wrapped optimizer
is what is mapped; an accelerate loop resumes bit-exactly after SIGTERM, in one process and in
two gloo processes (MULTI_CPU, a DDP-wrapped model with ``module.`` names), and passes
verify-resume with a diverging negative control. A prepared shuffling loader in ``state=``
resumes mid-epoch bit-exactly: a ``StatefulDataLoader`` in one process, the seedable sampler's
recipe (the Hugging Face tutorial's loop, docs/tutorials/hugging-face.md) in one process and,
SIGKILLed, in two; the loaders whose order a resume could not replay are refused naming that
recipe.

This file is also the script the two-process loader test runs on each rank (``__main__``)."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")
from conftest import cli, last_step  # noqa: E402
from torchrun import PY, Job, standalone, succeeds  # noqa: E402
from torchrun import run as run_job  # noqa: E402

import ckptfmt.torch as ct  # noqa: E402
from ckptfmt.errors import StateRefusedError, UnsupportedOptimizerError  # noqa: E402
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


def prepared_loop(run: Path, stop: int, stateful: bool = True, given: str = "StatefulDataLoader", *,
                  seedable: bool = False, seed: int = 0, every: int = 5,
                  kill_at: int | None = None) -> tuple[list, list]:
    """One process's life with a prepared shuffling loader in ``state=`` (under torchrun, one
    rank's): built from scratch (``set_seed(seed)`` before ``prepare``: the seedable sampler's seed),
    restored, trained to ``stop``, left without a save (what a SIGKILL leaves; ``kill_at``: a
    SIGKILL of this process after that step). The parameters, and the sample ids it drew."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torchdata.stateful_dataloader import StatefulDataLoader
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=stateful, use_seedable_sampler=seedable))
    set_seed(seed)
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kind = StatefulDataLoader if given == "StatefulDataLoader" else torch.utils.data.DataLoader
    loader = kind(torch.utils.data.TensorDataset(torch.arange(40), x, x.sum(1, keepdim=True)),
                  batch_size=6 // acc.num_processes, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    drawn = []
    with CheckpointManager(run, model, opt, state={"data": loader}, every=every, handle_signals=False) as mgr:
        step = mgr.restore()
        while step < stop:
            for ids, xb, yb in loader:
                step += 1
                drawn.append(ids.tolist())
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                acc.backward(loss)
                opt.step()
                mgr.step(step, loss=loss.item())
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if step == stop:
                    break
    AcceleratorState._reset_state(reset_partial_state=True)
    return [p.detach().clone() for p in model.parameters()], drawn


def same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.timeout(60)                    # ~3 s: three short legs in this process
def test_a_prepared_stateful_loader_resumes_mid_epoch_bit_exactly_and_a_plain_one_is_refused(tmp_path):
    pytest.importorskip("torchdata")
    straight, _ = prepared_loop(tmp_path / "straight", 23)
    prepared_loop(tmp_path / "cut", 17)      # 7 batches an epoch: generation 15 is mid-epoch 3
    assert same(straight, prepared_loop(tmp_path / "cut", 23)[0])
    with pytest.raises(StateRefusedError, match=r"state\.data: load_state_dict raised ValueError: the saved loader "
                                                r"state has no seedable sampler's seed and epoch"):
        prepared_loop(tmp_path / "cut", 23, given="DataLoader", seedable=True)    # another order than the saved
    with pytest.raises(TypeError, match=r"state\['data'\]: a DataLoader cannot save its position.*"
                                        r"use_stateful_dataloader=True"):
        prepared_loop(tmp_path / "plain", 5, stateful=False)      # accelerate's wrapper of a plain DataLoader
    with pytest.raises(TypeError, match=r"its BatchSampler around a shuffling RandomSampler cannot save the epoch.*"
                                        r"use_seedable_sampler=True"):
        prepared_loop(tmp_path / "torch-sampler", 5, given="DataLoader")    # torch's sampler inside a stateful one
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.timeout(60)                    # ~4 s: five short legs in this process
def test_a_prepared_seedable_loader_resumes_mid_epoch_and_after_an_epochs_last_batch_with_its_seed(tmp_path):
    """``use_seedable_sampler=True``, a ``DataLoader(shuffle=True)`` given to ``prepare``: its order
    is a seed and an epoch, saved beside the loader's count of batches. The resumed process seeds
    otherwise before ``prepare`` (the saved seed comes back), and a generation at an epoch's last
    batch goes on with the next epoch's order, not that epoch's again."""
    pytest.importorskip("torchdata")
    straight, batches = prepared_loop(tmp_path / "straight", 23, given="DataLoader", seedable=True)
    prepared_loop(tmp_path / "cut", 17, given="DataLoader", seedable=True)
    saved = json.loads((tmp_path / "cut" / "step_000015.json").read_text())["state"]["data"]
    assert saved["seedable_sampler"] == {"seed": 0, "epoch": 2} and saved["_num_yielded"] == 1   # mid-epoch 3
    resumed, after = prepared_loop(tmp_path / "cut", 23, given="DataLoader", seedable=True, seed=7)
    assert after == batches[15:] and same(straight, resumed)
    prepared_loop(tmp_path / "edge", 16, given="DataLoader", seedable=True, every=7)   # generation 14: epoch 2 ends
    saved = json.loads((tmp_path / "edge" / "step_000014.json").read_text())["state"]["data"]
    assert saved["seedable_sampler"]["epoch"] == 2 and saved["_iterator_finished"]
    resumed, after = prepared_loop(tmp_path / "edge", 23, given="DataLoader", seedable=True, every=7)
    assert after == batches[14:] and same(straight, resumed)


def test_a_sharded_loader_without_a_seedable_sampler_is_refused_naming_the_recipe(tmp_path):
    """accelerate's ``BatchSamplerShard`` (rank 1 of 2, built here in one process) keeps no state,
    so the order it replays comes from the shuffling sampler inside: refused around torchdata's
    ``RandomSampler`` or torch's (their generator as the epoch began is in no saved state),
    taken around the seedable one."""
    pytest.importorskip("torchdata")
    from accelerate.data_loader import prepare_data_loader
    from torchdata.stateful_dataloader import StatefulDataLoader
    data = torch.utils.data.TensorDataset(torch.arange(12))
    model = torch.nn.Linear(2, 1)

    def manager(loader, seedable: bool) -> CheckpointManager:
        sharded = prepare_data_loader(loader, num_processes=2, process_index=1, use_stateful_dataloader=True,
                                      use_seedable_sampler=seedable)
        return CheckpointManager(tmp_path / "run", model, torch.optim.AdamW(model.parameters()),
                                 state={"data": sharded}, handle_signals=False)
    torchdata_shuffled = StatefulDataLoader(data, batch_size=2, shuffle=True)
    for loader, seedable in [(torchdata_shuffled, True), (torch.utils.data.DataLoader(data, 2, shuffle=True), False)]:
        with pytest.raises(TypeError, match=r"state\['data'\]: its BatchSamplerShard around a shuffling RandomSampler "
                                            r"cannot save the epoch's order.*give prepare a DataLoader\(shuffle=True\) "
                                            r"and DataLoaderConfiguration\(use_stateful_dataloader=True, "
                                            r"use_seedable_sampler=True\)"):
            manager(loader, seedable)
    manager(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True), True).close()      # the recipe


def tutorial_recipe(root: Path) -> None:
    """The Hugging Face tutorial's accelerate loop with a prepared loader, run as it is (the data, the model and
    how long to train are the user's) in ``root``: straight to step 20, then to step 9 (mid-epoch;
    the generation ``close`` commits) and on to 20 from there, each a new Accelerator."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed
    text = (ROOT / "docs" / "tutorials" / "hugging-face.md").read_text()
    block = next(c.split("```")[0] for c in text.split("```python\n")[1:] if "use_seedable_sampler" in c)
    here = os.getcwd()
    for name, total in (("straight", 20), ("cut", 9), ("cut", 20)):
        AcceleratorState._reset_state(reset_partial_state=True)
        (root / name).mkdir(parents=True, exist_ok=True)
        os.chdir(root / name)
        set_seed(0)
        x = torch.randn(224, 4, generator=torch.Generator().manual_seed(0))     # 7 batches of 32
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4)
        try:
            exec(compile(block, "hugging-face.md", "exec"), {"dataset": torch.utils.data.TensorDataset(
                x, x.sum(1, keepdim=True)), "model": model, "opt": opt, "sched": sched, "total": total})
        finally:
            os.chdir(here)
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.timeout(60)                    # ~2 s: three short legs in this process
def test_the_tutorial_recipe_with_a_prepared_loader_resumes_mid_epoch_bit_identically(tmp_path):
    pytest.importorskip("torchdata")
    tutorial_recipe(tmp_path)
    final = [(tmp_path / name / "runs" / "acc" / "step_000020.bin").read_bytes() for name in ("straight", "cut")]
    assert final[0] == final[1]
    saved = json.loads((tmp_path / "cut" / "runs" / "acc" / "step_000009.json").read_text())["state"]["data"]
    assert saved["seedable_sampler"]["epoch"] == 1 and saved["_num_yielded"] == 2      # mid-epoch 2


def ranks_loop(stop: int, *runs: Path) -> list[str]:
    """This file on two gloo ranks (``__main__``): ``prepared_loop`` with the seedable recipe, one
    leg to ``stop`` in each of ``runs`` in turn; ``KILL_AT`` in the environment SIGKILLs the last."""
    return [*standalone(2), __file__, str(stop), *map(str, runs)]


def drawn(run: Path, rank: int) -> list:
    return json.loads(Path(f"{run}.drawn{rank}.json").read_text())


@pytest.mark.xdist_group("torchrun")        # 2 ranks: never beside another torchrun job
@pytest.mark.timeout(90)                    # two torchrun jobs: 18 s at load 4, 41 s at load 12
def test_two_processes_sigkilled_mid_epoch_resume_a_prepared_sharded_loader_bit_identically(tmp_path):
    """Two gloo processes, accelerate's ``BatchSamplerShard`` around a seedable sampler (each
    rank takes every other batch of one order). A job runs the straight leg, then the cut one,
    whose ranks SIGKILL themselves in the third epoch, two steps after a generation; a new job
    resumes it. Each rank draws the rest of its batches as the straight leg drew them, and the
    final sharded generation is the straight leg's byte for byte."""
    pytest.importorskip("torchdata")
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "PYTHONWARNINGS": "ignore"}
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    killed = run_job(ranks_loop(25, straight, cut), tmp_path / "cut.log", env={**env, "KILL_AT": "17"}, timeout=80)
    assert "exitcode: -9" in killed.output() and last_step(straight) == 25 and last_step(cut) == 17, killed.tail()
    saved = json.loads((cut / "step_000015.json").read_text())["ranks"]      # 7 batches an epoch on each rank
    assert [r["state"]["data"]["seedable_sampler"] for r in saved] == [{"seed": 0, "epoch": 2}] * 2
    recipe = tmp_path / "recipe"            # the tutorial's loop on two ranks, in the same job
    succeeds(ranks_loop(25, cut), tmp_path / "resume.log", env={**env, "RECIPE_RUNS": str(recipe)}, timeout=80)
    for rank in (0, 1):
        assert drawn(cut, rank) == drawn(straight, rank)[15:], f"rank {rank}"
    shards = [sorted((run / "step_000025.shards").iterdir()) for run in (straight, cut)]
    assert [p.read_bytes() for p in shards[0]] == [p.read_bytes() for p in shards[1]]
    shards = [sorted((recipe / name / "runs" / "acc" / "step_000020.shards").iterdir()) for name in ("straight", "cut")]
    assert [p.read_bytes() for p in shards[0]] == [p.read_bytes() for p in shards[1]]


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


if __name__ == "__main__":                  # the ranks of the two-process test: STOP RUN [RUN ...]
    from ckptfmt.torch.distributed import exit_worker
    runs = sys.argv[2:]
    for i, run in enumerate(runs):
        kill = int(os.environ["KILL_AT"]) if "KILL_AT" in os.environ and i == len(runs) - 1 else None
        _, ids = prepared_loop(Path(run), int(sys.argv[1]), given="DataLoader", seedable=True, kill_at=kill)
        Path(f"{run}.drawn{os.environ['RANK']}.json").write_text(json.dumps(ids))
    if "RECIPE_RUNS" in os.environ:
        tutorial_recipe(Path(os.environ["RECIPE_RUNS"]))
    torch.distributed.destroy_process_group()
    exit_worker(0)
