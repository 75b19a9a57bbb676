"""CheckpointManager under torchrun (2 gloo ranks, DDP) on a run in object storage (moto's S3
server on 127.0.0.1): every rank streams its own shard to the store and confirms it there, rank 0
commits the manifest (and the companion of the buffers) once every rank has, and a run stopped
(one rank sent SIGTERM mid-run: every rank saves that step and stops) and started again resumes
from the store bit-exactly, as one never stopped."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("s3fs")
from conftest import cli  # noqa: E402
from s3server import fixtures  # noqa: E402
from torchrun import standalone, succeeds  # noqa: E402

pytestmark = [pytest.mark.xdist_group("torchrun"), pytest.mark.timeout(240)]
s3, bucket = fixtures("ranks")

LOOP = r'''
import os, signal, sys
import numpy as np, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from ckptfmt.torch import CheckpointManager
from ckptfmt.torch.distributed import exit_worker
url, stop = sys.argv[1], int(sys.argv[2])
term_at = int(sys.argv[3]) if len(sys.argv) > 3 else None          # the step rank 1 is sent SIGTERM at
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
net = DistributedDataParallel(model)
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
noise = np.random.default_rng(10 + rank)
mgr = CheckpointManager(url, model, opt, generators={"noise": noise}, every=5, keep_last=2)
start = mgr.restore()
for step in range(start + 1, stop + 1):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g) * float(1 + noise.random())
    loss = net(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if rank == 1 and step == term_at:
        os.kill(os.getpid(), signal.SIGTERM)     # one rank told to stop mid-run, as a scheduler does
    if mgr.step(step, loss=loss.item()):
        break
mgr.close(step)
dist.destroy_process_group()
exit_worker(0)           # past finalization, where a gloo rank sometimes aborts (exit_worker's docstring)
'''


def test_two_ranks_write_their_shards_to_the_store_and_resume_from_it_bit_exactly(s3, bucket, tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    train = lambda url, stop, log, *term: succeeds([*standalone(2), str(script), url, str(stop), *term],  # noqa: E731
                                                   tmp_path / log, env=s3.env)
    straight, stopped = f"s3://{bucket}/runs/straight", f"s3://{bucket}/runs/stopped"
    train(straight, 20, "straight.log")
    train(stopped, 20, "first.log", "12")        # rank 1 SIGTERMed at step 12: both ranks save it and stop
    train(stopped, 20, "again.log")
    client = s3.client()

    def manifest(run: str, step: int) -> dict:
        key = f"{run.split('/', 3)[3]}/step_{step:06d}.json"
        return json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())

    mine, theirs = manifest(straight, 20), manifest(stopped, 20)
    assert mine["world_size"] == 2 and [r["file"] for r in mine["shards"]] == ["00000-of-00002.bin", "00001-of-00002.bin"]
    assert theirs["blake3"] == mine["blake3"] and theirs["companion"]["blake3"] == mine["companion"]["blake3"]
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="runs/stopped/")["Contents"]}
    assert {"runs/stopped/step_000020.shards/00000-of-00002.bin", "runs/stopped/step_000020.shards/00001-of-00002.bin",
            "runs/stopped/step_000020.extra.safetensors"} <= keys
    assert not [k for k in keys if "step_000005" in k or "step_000010" in k]        # retention on the store
    done = cli("validate", stopped, env=s3.env)
    assert done.returncode == 0, done.stdout + done.stderr
    from ckptfmt.run import history as hist
    from ckptfmt.run.storerun import open_run
    records = list(hist.read(open_run(stopped).history).events())
    events = [(r["event"], r["step"]) for r in records]
    assert ("resume", 12) in events and ("checkpoint", 20) in events
    assert [r["step"] for r in records if r["event"] == "checkpoint" and r.get("reason") == "SIGTERM"] == [12]


def test_train_under_torchrun_on_a_url_resumes_from_the_store_bit_exactly(s3, bucket, tmp_path):
    """``ckptfmt train --run-dir s3://...`` with 2 ranks, stopped at step 20 and started again to
    40, commits the step-40 generation a local 2-rank run trained straight to 40 commits."""
    def train(run: str, steps: int, log: str) -> None:
        succeeds([*standalone(2), "-m", "ckptfmt.cli", "train", "--run-dir", run, "--steps", str(steps),
                  "--checkpoint-every", "20", "--sample-every", "0", "--log-every", "100000", "--config", "tiny",
                  "--dist-timeout", "60"], tmp_path / log, env=s3.env)
    local = tmp_path / "straight"
    train(str(local), 40, "local.log")
    url = f"s3://{bucket}/runs/t"
    train(url, 20, "first.log")
    train(url, 40, "again.log")
    theirs = json.loads(s3.client().get_object(Bucket=bucket, Key="runs/t/step_000040.json")["Body"].read())
    mine = json.loads((local / "step_000040.json").read_text())
    assert theirs["world_size"] == 2 and theirs["blake3"] == mine["blake3"]
    assert "resumed from" in (tmp_path / "again.log").read_text()
