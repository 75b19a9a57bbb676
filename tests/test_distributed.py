"""Sharded checkpoints under torch.distributed (issue 9): 2-process gloo jobs on the CPU."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

# torchrun jobs run 2 ranks each: keep them on one xdist worker so two never oversubscribe 2 cores
pytestmark = pytest.mark.xdist_group("torchrun")

from ckptfmt.run import history as hist  # noqa: E402
from ckptfmt import shards  # noqa: E402
from ckptfmt.tools.convert import convert  # noqa: E402
from ckptfmt.run import Run  # noqa: E402
from ckptfmt.tools.validate import validate_run  # noqa: E402

from conftest import last_step  # noqa: E402

PY = sys.executable
def torchrun(*args, nproc=2):
    """--standalone: torchrun picks a free port itself, so parallel test workers never collide."""
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]


def train_argv(run, steps, nproc=2, every=20, parallel="ddp", sample_every=0):
    return torchrun("-m", "ckptfmt.cli", "train", "--run-dir", str(run), "--steps", str(steps), "--checkpoint-every",
                    str(every), "--sample-every", str(sample_every), "--log-every", "100000", "--parallel", parallel,
                    nproc=nproc)


def rank_pid(tag: str, rank: int, timeout: float = 60) -> int:
    """PID of the torchrun worker of ``rank`` in the job tagged ``tag`` (waits until it exists)."""
    deadline = time.monotonic() + timeout
    while True:
        pid = _find_rank(tag, rank)
        if pid is not None or time.monotonic() > deadline:
            assert pid is not None, f"no worker of rank {rank}"
            return pid
        time.sleep(0.05)


def _find_rank(tag: str, rank: int) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"TEST_JOB_TAG={tag}".encode() in env and f"RANK={rank}".encode() in env:
            return int(entry)
    return None


SAVE_SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
from ckptfmt.torch import distributed as cd
from ckptfmt import fsio
from ckptfmt.run import Run
import ckptfmt.torch as ct
dist.init_process_group(os.environ.get("TEST_BACKEND", "gloo"))
rank, world = cd.rank_world()
run, die = sys.argv[1], sys.argv[2]
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


def run_save(tmp_path, die="none", backend="gloo"):
    run = tmp_path / "run"
    run.mkdir()
    script = tmp_path / "save.py"
    script.write_text(SAVE_SCRIPT)
    proc = subprocess.run(torchrun(str(script), str(run), die), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TEST_BACKEND": backend})
    return run, proc


def test_a_device_map_group_runs_the_library_collectives_on_the_cpu(tmp_path):
    """A group made from a device map (``cpu:gloo,cuda:nccl`` on GPUs; its CPU part here):
    ``dist.get_backend()`` gives the map, and the agreement, gathers and sharded save run on
    CPU tensors through its gloo part."""
    from ckptfmt.torch.distributed import backend_for, collective_device_type
    assert backend_for("auto", True) == backend_for("cuda", True) == "cpu:gloo,cuda:nccl"
    assert backend_for("auto", False) == backend_for("cpu", True) == "gloo"
    assert [collective_device_type(b) for b in ("gloo", "nccl", "cpu:gloo,cuda:nccl", "cuda:nccl", "cpu:gloo")] \
        == ["cpu", "cuda", "cpu", "cuda", "cpu"]
    run, proc = run_save(tmp_path, backend="cpu:gloo")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rank in (0, 1):
        assert (run / f"backend-rank{rank}.txt").read_text() == "cpu:gloo cpu (True,) [0, 1]"
    assert Run(run).latest(deep=True).step == 2 and validate_run(run).ok


def test_save_with_2_ranks_load_with_1_2_and_3(tmp_path):
    run, proc = run_save(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
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


def test_split_and_consolidate_round_trips(tmp_path):
    run, proc = run_save(tmp_path)
    assert proc.returncode == 0
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


@pytest.mark.parametrize("die", ["rank1-write", "rank0-write", "rank0-commit"])
def test_a_rank_dying_mid_save_keeps_the_previous_generation(tmp_path, die):
    run, proc = run_save(tmp_path, die)
    assert proc.returncode != 0
    gen = Run(run).latest(deep=True)
    assert gen.step == 1
    listing = {g.step: g for g in Run(run).generations()}
    assert not listing[2].committed
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


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_sigterm_to_rank_1_coordinates_and_resume_is_bit_exact(tmp_path, parallel):
    straight = tmp_path / "straight"
    proc = subprocess.run(train_argv(straight, 60, parallel=parallel), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "run"
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(train_argv(run, 60, parallel=parallel), env={**os.environ, "TEST_JOB_TAG": tag},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while last_step(run) < 27:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(rank_pid(tag, 1), signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    cut = Run(run).latest(deep=True).step
    assert 27 <= cut < 60 and cut % 20 != 0
    assert "rank 0] step %d: checkpoint (SIGTERM)" % cut in err and "rank 1] step %d: checkpoint (SIGTERM)" % cut in err
    proc = subprocess.run(train_argv(run, 60, parallel=parallel), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a = json.loads((straight / "step_000060.json").read_text())
    assert a["run"]["parallel"] == parallel
    b = json.loads((run / "step_000060.json").read_text())
    assert a["blake3"] == b["blake3"] and [r["blake3"] for r in a["shards"]] == [r["blake3"] for r in b["shards"]]
    keep = ("step", "loss", "lr")
    assert [{k: r[k] for k in keep} for r in hist.read(run / ".loss.json").canonical()] == \
        [{k: r[k] for k in keep} for r in hist.read(straight / ".loss.json").canonical()]


def test_resume_with_a_different_world_size_continues(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(train_argv(run, 40), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([PY, "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", "60",
                           "--checkpoint-every", "20", "--sample-every", "0", "--log-every", "100000"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "world size changed from 2 to 1" in proc.stderr
    change = [e for e in hist.read(run / ".loss.json").events() if e["event"] == "world_size_change"]
    assert change[-1]["saved"] == 2 and change[-1]["now"] == 1 and change[-1]["per_rank_state_dropped"] == [1]
    assert "optimizer" in change[-1]["identical"]
    gen = Run(run).latest(deep=True)
    assert gen.step == 60 and gen.bin is not None                    # one process saves one file
    losses = [r["loss"] for r in hist.read(run / ".loss.json").canonical()]
    assert len(losses) == 60 and abs(losses[40] - losses[39]) < 1.0    # the loss curve is continuous
    proc = subprocess.run(train_argv(run, 80), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Run(run).latest(deep=True).step == 80 and "world size changed from 1 to 2" in proc.stderr


def test_an_fsdp_generation_resumes_in_one_process_and_loads_by_range(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(train_argv(run, 20, parallel="fsdp", sample_every=10), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    samples = json.loads((run / ".samples.json").read_text())   # FSDP2: every rank ran the sample's forward
    assert [s["step"] for s in samples] == [10, 20] and samples[0]["text"]
    one = tmp_path / "one"
    one.mkdir()
    convert(str(run / "step_000020.json"), str(one / "step_000020.bin"))
    steps = json.loads((one / "step_000020.json").read_text())["optimizer"]["param_steps"]
    assert steps == [20] * len(steps)       # every parameter's moments, the root's too after a sample
    import ckptfmt.torch as ct
    from ckptfmt.trainer.config import CONFIGS
    from ckptfmt.trainer.model import GPT
    model = GPT(CONFIGS["tiny"])
    opt = torch.optim.AdamW(model.parameters())
    ct.load(str(one / "step_000020.bin"), model, opt)             # an FSDP2 run's state in a plain model
    assert int(opt.state[next(model.parameters())]["step"]) == 20
    proc = subprocess.run([PY, "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", "30",
                           "--checkpoint-every", "10", "--sample-every", "0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "world size changed from 2 to 1" in proc.stderr, proc.stderr


def test_sigusr1_to_rank_1_checkpoints_on_all_ranks_and_training_continues(tmp_path):
    run = tmp_path / "run"
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(train_argv(run, 10**6, every=10**6), env={**os.environ, "TEST_JOB_TAG": tag},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while last_step(run) < 15:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(rank_pid(tag, 1), signal.SIGUSR1)
        while not [g for g in Run(run).generations() if g.committed]:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        at = last_step(run)
        while last_step(run) < at + 10:                 # still training after the checkpoint
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        os.kill(rank_pid(tag, 0), signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    events = [e for e in hist.read(run / ".loss.json").events() if e["event"] == "checkpoint"]
    assert [e["reason"] for e in events][:1] == ["SIGUSR1"] and events[-1]["reason"] == "SIGTERM"
    assert "rank 1] step %d: checkpoint (SIGUSR1)" % events[0]["step"] in err
    assert "rank 0] step %d: checkpoint (SIGUSR1)" % events[0]["step"] in err
    assert validate_run(run).ok
