"""Sharded checkpoints under torch.distributed: 2-process gloo jobs on the CPU."""
import json
import os
import re
import shutil
import signal
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

# torchrun jobs run 2 ranks each: keep them on one xdist worker so two never oversubscribe 2 cores;
# a hang fails in a minute or two, not at the suite's 10 (the slowest test here takes 20-25 s)
pytestmark = [pytest.mark.xdist_group("torchrun"), pytest.mark.timeout(90)]

from ckptfmt.run import history as hist, roots  # noqa: E402
from ckptfmt import shards  # noqa: E402
from ckptfmt.tools.convert import convert  # noqa: E402
from ckptfmt.run import Run  # noqa: E402
from ckptfmt.tools.validate import validate_run  # noqa: E402

from conftest import last_step  # noqa: E402
from torchrun import PY, Job, standalone, succeeds  # noqa: E402

# Steps of the straight and interrupted runs (a SIGTERM after step 27): an FSDP2 step takes about
# 4 times a DDP one, so 40 leave it as much time to stop before the end as 60 leave DDP.
STEPS = {"ddp": 60, "fsdp": 40}


def train_argv(run, steps, nproc=2, every=20, parallel="ddp", sample_every=0):
    return [*standalone(nproc), "-m", "ckptfmt.cli", "train", "--run-dir", str(run), "--steps", str(steps),
            "--checkpoint-every", str(every), "--sample-every", str(sample_every), "--log-every", "100000",
            "--parallel", parallel, "--dist-timeout", "30"]


def one_process(run, steps, every):
    return [PY, "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", str(steps), "--checkpoint-every",
            str(every), "--sample-every", "0", "--log-every", "100000"]


# Each worker group of one job runs one scenario: TORCHELASTIC_RESTART_COUNT picks it, so a group
# that fails (a rank dies mid-save) is restarted by torchrun (--max-restarts) for the next one.
SAVE_SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
from ckptfmt.torch import distributed as cd
from ckptfmt import fsio
from ckptfmt.run import Run
import ckptfmt.torch as ct
die, backend = sys.argv[2].split(",")[int(os.environ["TORCHELASTIC_RESTART_COUNT"])].split("@")
dist.init_process_group(backend)
rank, world = cd.rank_world()
run = os.path.join(sys.argv[1], die)
os.makedirs(run, exist_ok=True)
with open(os.path.join(run, f"backend-rank{rank}.txt"), "w") as f:
    f.write(f"{dist.get_backend()} {cd.collective_device()} {cd.any_rank(rank == 1)} {cd.gather_json(rank)}")
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 33), torch.nn.Linear(33, 7))
opt = torch.optim.AdamW(m.parameters())
def meta():
    return {"layout": ct.layout_of(m), "optimizer": {"type": "AdamW", "step": int(opt.state[next(m.parameters())]["step"]),
            "hyperparams": ct.hyperparams(opt)}}
for step in (1, 2):
    m(torch.ones(3, 64)).sum().backward(); opt.step()
    if step == 2 and die == f"rank{rank}-write":
        fsio.hook = lambda op, path: os._exit(9) if op == "write" and "of-" in path else None
    if step == 2 and die == f"rank{rank}-commit":
        fsio.hook = lambda op, path: os._exit(9) if op == "rename" and path.endswith("step_000002.json") else None
    cd.save_sharded(run, step, m, opt, meta())
    torch.save({k: v.clone() for k, v in m.state_dict().items()}, os.path.join(run, f"ref{step}-rank{rank}.pt"))
dist.destroy_process_group()
cd.exit_worker(0)
'''
DIES = ["rank1-write", "rank0-write", "rank0-commit"]
SCENARIOS = [f"{die}@gloo" for die in DIES] + ["none@cpu:gloo"]     # the last one completes: the job exits 0


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """One job, a directory per scenario: a rank dying at three points of the save of step 2 (a
    plain gloo group), then ("none") steps 1 and 2 saved on a device-map group (``cpu:gloo``)."""
    base = tmp_path_factory.mktemp("saves")
    script = base / "save.py"
    script.write_text(SAVE_SCRIPT)
    # a restarted group makes a store of its own: on the agent's shared one, gloo's connect after a
    # restart was seen to fail and the next round to hang
    job = succeeds([*standalone(2, "--max-restarts", str(len(SCENARIOS) - 1)), script, base, ",".join(SCENARIOS)],
                   base / "job.log", timeout=180, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert sorted(p.name for p in base.iterdir() if p.is_dir()) == sorted(DIES + ["none"]), job.tail()
    # each failed group: the rank meant to die is the one that exited 9
    dying = [re.match(r"rank(\d)", die).group(1) for die in DIES]
    assert re.findall(r"exitcode: 9\) local_rank: (\d)", job.output()) == dying, job.tail()
    return base


def test_a_device_map_group_runs_the_library_collectives_on_the_cpu(saves):
    """A group made from a device map (``cpu:gloo,cuda:nccl`` on GPUs; its CPU part here):
    ``dist.get_backend()`` gives the map, and the agreement, gathers and sharded save run on
    CPU tensors through its gloo part."""
    from ckptfmt.torch.distributed import backend_for, collective_device_type
    assert backend_for("auto", True) == backend_for("cuda", True) == "cpu:gloo,cuda:nccl"
    assert backend_for("auto", False) == backend_for("cpu", True) == "gloo"
    assert [collective_device_type(b) for b in ("gloo", "nccl", "cpu:gloo,cuda:nccl", "cuda:nccl", "cpu:gloo")] \
        == ["cpu", "cuda", "cpu", "cuda", "cpu"]
    run = saves / "none"
    for rank in (0, 1):
        assert (run / f"backend-rank{rank}.txt").read_text() == "cpu:gloo cpu (True,) [0, 1]"
        assert (saves / DIES[0] / f"backend-rank{rank}.txt").read_text() == "gloo cpu (True,) [0, 1]"
    assert Run(run).latest(deep=True).step == 2 and validate_run(run).ok


def test_save_with_2_ranks_load_with_1_2_and_3(saves):
    run = saves / "none"
    gen = Run(run).latest(deep=True)
    assert gen.step == 2 and gen.bin is None and sorted(p.name for p in gen.shards.iterdir()) == [
        "00000-of-00002.bin", "00001-of-00002.bin"]
    for shard in gen.shards.iterdir():            # every shard is a seed-layout file of its own
        data = shard.read_bytes()
        step, n = np.frombuffer(data[:8], "<i4")
        assert step == 2 and len(data) == 8 + 12 * int(n)
    ref = torch.load(run / "ref2-rank0.pt", weights_only=True)
    from ckptfmt.torch.distributed import load_range, load_sharded
    m = torch.nn.Sequential(torch.nn.Linear(64, 33), torch.nn.Linear(33, 7))
    opt = torch.optim.AdamW(m.parameters(), lr=0.5)
    load_sharded(gen.manifest, m, opt)                              # world size 1
    assert all(torch.equal(m.state_dict()[k], v) for k, v in ref.items()) and opt.param_groups[0]["lr"] == 1e-3
    doc = json.loads(gen.manifest.read_text())
    n = doc["n_params"]
    assert all(row["facts"]["weights"]["finite"] for row in doc["shards"])    # each rank's value facts
    assert doc["facts"]["v"] == {"finite": True, "non_finite": 0, "non_negative": True, "negative": 0}
    flat = torch.cat([v.reshape(-1) for v in ref.values()]).numpy()
    for world in (1, 2, 3):                                         # each rank reads only its range
        parts = [load_range(gen.manifest, "weights", *shards.partition(n, world, r)) for r in range(world)]
        assert np.array_equal(np.concatenate(parts), flat)
    assert validate_run(run).ok


def test_split_and_consolidate_round_trips(saves, tmp_path):
    run = saves / "none"
    out = tmp_path / "one"
    out.mkdir()
    convert(str(run / "step_000002.json"), str(out / "step_000002.bin"))
    for world in (1, 2, 3, 5):
        target = tmp_path / f"w{world}"
        convert(str(out / "step_000002.bin"), str(target), to="shards", shards=world)
        back = tmp_path / f"b{world}"
        back.mkdir()
        convert(str(target / "step_000002.json"), str(back / "step_000002.bin"))
        assert (back / "step_000002.bin").read_bytes() == (out / "step_000002.bin").read_bytes()
    assert json.loads((tmp_path / "w2" / "step_000002.json").read_text())["blake3"] == \
        json.loads((run / "step_000002.json").read_text())["blake3"]         # same split, same shards


@pytest.mark.parametrize("die", DIES)
def test_a_rank_dying_mid_save_keeps_the_previous_generation(saves, die):
    run = saves / die              # its worker group failed: torchrun ran the next scenario (the fixture)
    gen = Run(run).latest(deep=True)
    assert gen.step == 1
    listing = {g.step: g for g in Run(run).generations()}
    assert not listing[2].committed
    assert not (run / "ref2-rank0.pt").exists() and not (run / "ref2-rank1.pt").exists()   # no rank got past it
    report = validate_run(run)
    assert report.ok and any(f.code == "uncommitted" for f in report.findings)


def test_dcp_round_trip_and_dcp_load(tmp_path):
    import torch.distributed.checkpoint as dcp
    from ckptfmt.trainer.config import CONFIGS
    from ckptfmt.trainer.model import GPT
    import ckptfmt.torch as ct
    torch.manual_seed(1)
    model = GPT(CONFIGS["tiny"])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long))[0].sum().backward()
    opt.step()
    src = tmp_path / "step_000001.bin"
    ct.save(str(src), model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep = convert(str(src), str(tmp_path / "dcp"), to="dcp")
    assert rep.verified == "round-trip"
    # a conversion is one process by design: DCP's "assuming the intent is ... a single process" says nothing
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    target = GPT(CONFIGS["tiny"])
    sd = {"model": target.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))               # DCP's own loader
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))
    back = tmp_path / "back"
    back.mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert(str(tmp_path / "dcp"), str(back / "step_000001.bin"))
    assert (back / "step_000001.bin").read_bytes() == src.read_bytes()
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]


def checkpoints(run) -> list[dict]:
    return [e for e in hist.read(run / ".loss.json").events() if e["event"] == "checkpoint"]


def checkpoint_for(run, reason: str) -> int | None:
    """The step of the run's first checkpoint for ``reason`` (None before there is one)."""
    if not (run / ".loss.json").exists():
        return None
    return next((e["step"] for e in checkpoints(run) if e["reason"] == reason), None)


def interrupt(root, parallel: str) -> SimpleNamespace:
    """A straight run of STEPS[parallel] steps and the same run stopped by a SIGTERM to rank 1 after step
    27; under DDP, a SIGUSR1 to rank 1 after step 5 first (a checkpoint, training goes on). FSDP2
    samples every 20 steps (every rank runs the sample's forward), so steps follow a sample."""
    sample = 20 if parallel == "fsdp" else 0
    straight, run = root / "straight", root / "run"
    steps = STEPS[parallel]
    succeeds(train_argv(straight, steps, parallel=parallel, sample_every=sample), root / "straight.log")
    usr1 = None
    with Job(train_argv(run, steps, parallel=parallel, sample_every=sample), root / "cut.log") as job:
        if parallel == "ddp":
            job.wait_for(lambda: last_step(run) >= 5, "step 5")
            os.kill(job.worker_of_rank(1), signal.SIGUSR1)
            job.wait_for(lambda: checkpoint_for(run, "SIGUSR1"), "the SIGUSR1 checkpoint")
            usr1 = checkpoint_for(run, "SIGUSR1")
        job.wait_for(lambda: last_step(run) >= max(27, (usr1 or 0) + 10), "step 27")
        os.kill(job.worker_of_rank(1), signal.SIGTERM)
        assert job.finish(120) == 0, job.tail()
    cut = root / "cut"                  # the run as the SIGTERM left it, for the tests that resume it otherwise
    shutil.copytree(run, cut)
    return SimpleNamespace(straight=straight, run=run, cut=cut, log=job.output(), usr1=usr1,
                           stopped=Run(run).latest(deep=True).step, sample=sample, steps=steps)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """``interrupted(parallel)``: that parallelism's straight and interrupted runs (made once)."""
    made = {}

    def get(parallel: str) -> SimpleNamespace:
        if parallel not in made:                # a failure is kept too: the next test fails at once
            try:
                made[parallel] = interrupt(tmp_path_factory.mktemp(parallel), parallel)
            except BaseException as exc:
                made[parallel] = exc
                raise
        if isinstance(made[parallel], BaseException):
            raise AssertionError(f"the {parallel} runs failed in an earlier test") from made[parallel]
        return made[parallel]
    return get


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_sigterm_to_rank_1_coordinates_and_resume_is_bit_exact(interrupted, parallel, tmp_path):
    got = interrupted(parallel)
    cut, straight, run, steps = got.stopped, got.straight, got.run, got.steps
    assert 27 <= cut < steps and cut % 20 != 0
    assert "rank 0] step %d: checkpoint (SIGTERM)" % cut in got.log, got.log[-3000:]
    assert "rank 1] step %d: checkpoint (SIGTERM)" % cut in got.log, got.log[-3000:]
    succeeds(train_argv(run, steps, parallel=parallel, sample_every=got.sample), tmp_path / "resume.log")
    a = json.loads((straight / f"step_{steps:06d}.json").read_text())
    assert a["run"]["parallel"] == parallel
    b = json.loads((run / f"step_{steps:06d}.json").read_text())
    assert a["blake3"] == b["blake3"] and [r["blake3"] for r in a["shards"]] == [r["blake3"] for r in b["shards"]]
    keep = ("step", "loss", "lr")
    assert [{k: r[k] for k in keep} for r in hist.read(run / ".loss.json").canonical()] == \
        [{k: r[k] for k in keep} for r in hist.read(straight / ".loss.json").canonical()]


def test_sigusr1_to_rank_1_checkpoints_on_all_ranks_and_training_continues(interrupted):
    got = interrupted("ddp")
    events = checkpoints(got.cut)
    assert ("SIGUSR1", got.usr1) in [(e["reason"], e["step"]) for e in events] and got.usr1 % 20 != 0
    assert got.usr1 in [g.step for g in Run(got.cut).generations() if g.committed]
    present = {g.step for g in Run(got.cut).generations() if g.committed}
    assert present and all(e["root"] == roots.of_step(got.cut, e["step"]) for e in events if e["step"] in present)
    assert (events[-1]["reason"], events[-1]["step"]) == ("SIGTERM", got.stopped)
    assert got.stopped >= got.usr1 + 10                  # still training after the checkpoint
    assert "rank 1] step %d: checkpoint (SIGUSR1)" % got.usr1 in got.log, got.log[-3000:]
    assert "rank 0] step %d: checkpoint (SIGUSR1)" % got.usr1 in got.log, got.log[-3000:]
    assert validate_run(got.cut).ok


def test_resume_with_a_different_world_size_continues(interrupted, tmp_path):
    got = interrupted("ddp")
    run = tmp_path / "run"
    shutil.copytree(got.cut, run)                          # 2 ranks stopped at got.stopped
    steps = got.steps
    one = succeeds(one_process(run, steps, 20), tmp_path / "one.log")
    assert "world size changed from 2 to 1" in one.output(), one.tail()
    change = [e for e in hist.read(run / ".loss.json").events() if e["event"] == "world_size_change"]
    assert change[-1]["saved"] == 2 and change[-1]["now"] == 1 and change[-1]["per_rank_state_dropped"] == [1]
    assert "optimizer" in change[-1]["identical"]
    gen = Run(run).latest(deep=True)
    assert gen.step == steps and gen.bin is not None                  # one process saves one file
    losses = [r["loss"] for r in hist.read(run / ".loss.json").canonical()]
    cut = got.stopped
    assert len(losses) == steps and abs(losses[cut] - losses[cut - 1]) < 1.0    # the loss curve is continuous
    two = succeeds(train_argv(run, steps + 20), tmp_path / "two.log")
    assert Run(run).latest(deep=True).step == steps + 20 and "world size changed from 1 to 2" in two.output()


def test_an_fsdp_generation_resumes_in_one_process_and_loads_by_range(interrupted, tmp_path):
    got = interrupted("fsdp")
    run = tmp_path / "run"
    shutil.copytree(got.cut, run)
    samples = json.loads((run / ".samples.json").read_text())   # FSDP2: every rank ran the sample's forward
    cut = got.stopped                                          # steps 21..cut trained after the sample at 20
    assert [s["step"] for s in samples] == list(range(20, cut + 1, 20)) and samples[0]["text"]
    one = tmp_path / "one"
    one.mkdir()
    for step in (20, cut):                  # saved right after the sample; steps after it
        convert(str(run / f"step_{step:06d}.json"), str(one / f"step_{step:06d}.bin"))
        steps = json.loads((one / f"step_{step:06d}.json").read_text())["optimizer"]["param_steps"]
        assert steps == [step] * len(steps)     # every parameter's moments, the root's too after a sample
    import ckptfmt.torch as ct
    from ckptfmt.trainer.config import CONFIGS
    from ckptfmt.trainer.model import GPT
    model = GPT(CONFIGS["tiny"])
    opt = torch.optim.AdamW(model.parameters())
    ct.load(str(one / f"step_{cut:06d}.bin"), model, opt)         # an FSDP2 run's state in a plain model
    assert int(opt.state[next(model.parameters())]["step"]) == cut
    resumed = succeeds(one_process(run, cut + 2, 10), tmp_path / "one.log")
    assert "world size changed from 2 to 1" in resumed.output(), resumed.tail()
