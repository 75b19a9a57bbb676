"""SIGKILL of a two-rank torchrun job (2 gloo ranks, DDP, CheckpointManager) writing sharded
generations to object storage (moto's S3 server on 127.0.0.1), at each phase of a sharded save:
a rank's shard mid-way through its multipart upload, a part's upload completed, rank 0's
manifest, retention's removal; one rank killed (torchrun then stops the other), or the whole
job at once. The kill point is ``killpoints.arm`` (the one-process kills' own: the N-th store
call of a phase, in the rank named). Each restart, under torchrun too, must resume from the
newest generation committed, find no uncommitted generation listed and no multipart upload
unfinished once it restored, and the run end bit-identical to one never killed. The last two
launches run as two simulated nodes: a torchrun agent each, each rank in a working directory
and TMPDIR of its own, nothing shared but the store.

RELIABILITY_SCALE=long adds kills at random store calls of a random rank (or the whole job),
run after run, RELIABILITY_RANK_KILLS of them (1,000 unless set)."""
from __future__ import annotations

import itertools
import json
import os
import random
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("s3fs")

from faults import LONG, scale  # noqa: E402
from s3server import fixtures  # noqa: E402
from torchrun import FAST_RDZV, TORCHRUN, Job, free_port, standalone  # noqa: E402

pytestmark = [pytest.mark.xdist_group("torchrun"), pytest.mark.timeout(300)]
s3, bucket = fixtures("rankkills")
TESTS = str(Path(__file__).resolve().parents[1])
STOP, WIDTH = 10, 70_000      # 910,002 parameters: a shard of 5.5 MB, in parts of 5 MiB (S3's smallest)

# Each rank: DDP over a model with BatchNorm (its buffers: rank 0's companion), a generation every
# 2 steps, keep_last 2, on URL to step STOP; the rank VICTIM killed at its AT-th store call of
# PHASE (killpoints.arm; HOW "job": its kill takes the whole torchrun job down). Rank 0 prints the
# step restore() returned, what its sweep said, and the uncommitted generations and unfinished
# multipart uploads the store holds once the restore returned (no rank writes before rank 0's
# first step: DDP's all-reduce waits for it).
LOOP = r'''
import sys
sys.path.insert(0, sys.argv[1])
import boto3, numpy as np, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import killpoints
from ckptfmt.run.storerun import open_run
from ckptfmt.store import multipart
from ckptfmt.torch import CheckpointManager
from ckptfmt.torch.distributed import exit_worker
url, stop, width = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
victim, phase, at, how = int(sys.argv[5]), sys.argv[6], int(sys.argv[7]), sys.argv[8]
multipart.BLOCK = 5 << 20        # S3's smallest part: a shard of 5.5 MB goes up as a multipart upload
dist.init_process_group("gloo")
rank = dist.get_rank()
calls = killpoints.arm(phase, at if rank == victim else 0, killpoints.whole_job if how == "job" else killpoints.this_process)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.BatchNorm1d(width), torch.nn.Tanh(), torch.nn.Linear(width, 2))
net = DistributedDataParallel(model)
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
noise = np.random.default_rng(10 + rank)
said = []
mgr = CheckpointManager(url, model, opt, generators={"noise": noise}, every=2, keep_last=2, log=said.append)
start = mgr.restore()
if rank == 0:
    bucket, prefix = url[5:].split("/", 1)
    unfinished = boto3.client("s3").list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
    left = [g.step for g in open_run(url).generations() if not g.committed]
    print(f"RESTORED {start} LEFT {left} UNFINISHED {len(unfinished)} SAID {'|'.join(said)}", flush=True)
for step in range(start + 1, stop + 1):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g) * float(1 + noise.random())
    loss = net(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    mgr.step(step, loss=loss.item())
mgr.close(stop)
print(f"CALLS {rank} {calls.get('any', 0)}", flush=True)
dist.destroy_process_group()
exit_worker(0)
'''


class Launch:
    """LOOP under torchrun, in ``root``: one agent with both ranks, or (``nodes``) two simulated
    nodes as the peer-tier tests run them, an agent each (c10d rendezvous on 127.0.0.1), each
    rank in a working directory and TMPDIR of its own: nothing shared but the store."""

    def __init__(self, root: Path, script: Path, url: str, kill: tuple = (0, "none", 0, "rank"), *, nodes: bool = False):
        root.mkdir(parents=True)
        argv = [str(script), TESTS, url, str(STOP), str(WIDTH), *map(str, kill)]
        env = {"OMP_NUM_THREADS": "1"}            # and the s3 fixture's endpoint, in os.environ
        if not nodes:
            self.jobs = [Job([*standalone(2), *argv], root / "job.log", env=env)]
            return
        port, self.jobs = free_port(), []
        for node in (0, 1):
            home = root / f"node{node}"
            (home / "tmp").mkdir(parents=True)
            rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"127.0.0.1:{port}", "--rdzv-id", "store-kills", "--rdzv-conf", f"{FAST_RDZV},is_host={int(node == 0)}"]
            self.jobs.append(Job([*TORCHRUN, *rdzv, *argv], root / f"node{node}.log", cwd=home,
                                 env={**env, "TMPDIR": str(home / "tmp"), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}))

    def finish(self) -> list[int]:
        try:
            return [job.finish(240) for job in self.jobs]
        finally:
            for job in self.jobs:
                job.kill()

    def output(self) -> str:
        return "".join(job.output() for job in self.jobs)

    def restored(self) -> tuple[int, list[int], int, str]:
        """What rank 0 printed once restore() returned: (its step, the uncommitted generations
        and the unfinished uploads then on the store, what the restore logged)."""
        found = re.search(r"RESTORED (\d+) LEFT \[([\d, ]*)\] UNFINISHED (\d+) SAID (.*)", self.output())
        assert found, self.output()[-3000:]
        return int(found[1]), [int(s) for s in found[2].split(",") if s.strip()], int(found[3]), found[4]


def on_store(s3, url: str) -> tuple[list[int], list[int], int]:
    """(committed steps, each verified deep; uncommitted steps; unfinished multipart uploads)."""
    from ckptfmt.run.storerun import open_run
    gens = open_run(url).generations()
    for gen in gens:
        if gen.committed:         # never a committed generation that fails verification
            assert gen.check(deep=True) is None, (gen.step, gen.check(deep=True))
    bucket_, prefix = url[5:].split("/", 1)
    unfinished = s3.client().list_multipart_uploads(Bucket=bucket_, Prefix=prefix + "/").get("Uploads", [])
    return [g.step for g in gens if g.committed], [g.step for g in gens if not g.committed], len(unfinished)


def final(url: str) -> tuple[str, str]:
    """The blake3 of the step-STOP generation's shards and of its companion (its manifest's)."""
    from ckptfmt.run.storerun import open_run
    doc = json.loads(open_run(url).store.read_bytes(f"step_{STOP:06d}.json"))
    return doc["blake3"], doc["companion"]["blake3"]


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    made = tmp_path_factory.mktemp("loop") / "loop.py"
    made.write_text(LOOP)
    return made


@pytest.fixture(scope="module")
def straight(s3, script, tmp_path_factory) -> tuple[tuple[str, str], dict[int, int]]:
    """The run never killed: its final generation's digests, and each rank's store calls."""
    s3.bucket("straight")
    launch = Launch(tmp_path_factory.mktemp("straight") / "run", script, "s3://straight/run")
    assert launch.finish() == [0], launch.output()[-3000:]
    calls = {int(r): int(n) for r, n in re.findall(r"CALLS (\d) (\d+)", launch.output())}
    return final("s3://straight/run"), calls


# The kills one run goes through, each launch restarting from what the previous kill left: (rank
# killed, phase, at its AT-th call of it, "rank" or "job", as two nodes; the committed steps and
# the uncommitted ones the kill leaves). Every 2 steps a generation, keep_last 2: each restart
# resumes 2 steps further. Retention's calls include the restart's sweep of the previous kill's
# leftovers (two removals: the shard folder, the companion).
CHAIN = [
    (1, "upload", 4, "rank", False, [2], [4]),           # rank 1's step-4 shard as its second part goes up
                                                         # (two 5 MiB-bounded parts a shard: steps 2 and 4)
                                                         # (rank 0's step-4 shard: up, or stopped mid-way)
    (0, "complete", 4, "rank", False, [2, 4], [6]),      # rank 0's step-6 companion, both shards confirmed
    (0, "manifest", 2, "job", False, [4, 6], [8]),       # the whole job, at the step-8 manifest
    (0, "retention", 4, "rank", True, [6, 8], [4]),      # step 4's shards, its manifest removed already
]


@pytest.mark.skipif(not LONG, reason="the long tier: the test command's budget (two-rank launches, ~50 s)")
def test_kills_of_a_rank_or_the_job_at_each_phase_of_a_sharded_save_resume_bit_exactly(s3, bucket, script, straight,
                                                                                      tmp_path):
    url, resumes = f"s3://{bucket}/run", [0]
    for i, (rank, phase, at, how, nodes, committed, uncommitted) in enumerate(CHAIN):
        launch = Launch(tmp_path / f"kill{i}", script, url, (rank, phase, at, how), nodes=nodes)
        codes = launch.finish()
        assert (codes == [-9]) if how == "job" else (0 not in codes), (phase, codes, launch.output()[-3000:])
        if how == "rank":
            assert re.search(rf"rank +: {rank} .*\n +exitcode +: -9 ", launch.output()), launch.output()[-3000:]
        step, left, unfinished, said = launch.restored()
        assert (step, left, unfinished) == (resumes[-1], [], 0), (phase, step, left, unfinished, said)
        got = on_store(s3, url)
        assert got[0] == committed and got[1] in (uncommitted, [] if phase == "upload" else uncommitted), (phase, got)
        assert got[2] in ((1, 2) if phase == "upload" else (0,)), (phase, got)     # rank 1's, and maybe rank 0's
        resumes.append(committed[-1])
    last = Launch(tmp_path / "last", script, url, nodes=True)
    assert last.finish() == [0, 0], last.output()[-3000:]
    step, left, unfinished, said = last.restored()
    assert (step, left, unfinished) == (resumes[-1], [], 0) and "leftovers of interrupted saves" in said, said
    assert final(url) == straight[0]
    assert on_store(s3, url) == ([STOP - 2, STOP], [], 0)


@pytest.mark.skipif(not LONG and "RELIABILITY_RANK_KILLS" not in os.environ, reason="the long tier")
@pytest.mark.timeout(0)
def test_kills_at_random_store_calls_of_a_rank_or_the_job_resume_bit_exactly(s3, bucket, script, straight, tmp_path):
    """Run after run killed at a store call drawn from a whole run's of a rank drawn (that rank,
    or in one kill of three the whole job: under two nodes, every fourth run, the rank's node)
    until a launch outlives its kill point and ends the run, which must match the straight one."""
    kills, (digests, calls) = int(os.environ.get("RELIABILITY_RANK_KILLS", scale(0, 1000))), straight
    rng, done, runs, started = random.Random(2027), 0, 0, time.monotonic()
    while done < kills:
        url, nodes, resumed = f"s3://{bucket}/r{runs}", runs % 4 == 3, 0
        for i in itertools.count():
            rank, how = rng.randrange(2), rng.choice(["rank", "rank", "job"])
            kill = (rank, "any", rng.randint(1, calls[rank]), how) if done < kills else (0, "none", 0, "rank")
            launch = Launch(tmp_path / f"r{runs}-{i}", script, url, kill, nodes=nodes)
            codes = launch.finish()
            if "RESTORED" in launch.output():           # not killed before its restore returned
                step, left, unfinished, said = launch.restored()
                assert (step, left, unfinished) == (resumed, [], 0), (kill, step, left, unfinished, said)
            if codes == [0] * len(codes):
                break
            done += 1
            assert -9 in codes or "Signal 9 (SIGKILL)" in launch.output(), (kill, codes, launch.output()[-3000:])
            committed, _, _ = on_store(s3, url)
            resumed = max(committed, default=0)
        assert final(url) == digests, (runs, i)
        committed, left, unfinished = on_store(s3, url)      # a kill between the last commit and its
        assert committed[-2:] == [STOP - 2, STOP] and (left, unfinished) == ([], 0)   # retention keeps one more
        runs += 1
    took = time.monotonic() - started
    print(f"FIGURE two-rank kills on a store: {done} kills in {runs} runs, each resumed from its newest "
          f"committed generation and every run bit-identical ({took:.0f} s, {took / max(done, 1):.1f} s a kill)")
