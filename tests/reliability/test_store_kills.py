"""SIGKILL of a writer on object storage at each phase of a save (a part's upload, the
multipart completion, the commit's confirmation of the parts, the manifest, the history's segment, retention's removal),
against moto's S3 server on 127.0.0.1: the newest generation left committed always verifies,
the restart resumes from it and ends bit-identical to a run never killed, and what the killed
save left (parts without a manifest, an unfinished multipart upload) is removed by the restart.
RELIABILITY_SCALE=long adds 1,000 kills at random store calls."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("s3fs")

import warm  # noqa: E402
from faults import scale  # noqa: E402
from s3server import fixtures  # noqa: E402

s3, bucket = fixtures("kills")
TESTS = str(Path(__file__).resolve().parents[1])

# A loop on the manager over URL to step STOP (every 2, keep_last 2), killed by SIGKILL at the
# AT-th store call of kind PHASE (killpoints.arm: "any" for a store call of any kind); prints the
# step restore() returned and the unfinished uploads and leftovers the restart swept.
LOOP = r'''
import sys
sys.path.insert(0, sys.argv[6])
import numpy as np, torch
import killpoints
from ckptfmt.torch import CheckpointManager
url, stop, width, phase, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
calls = killpoints.arm(phase, at)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
noise = np.random.default_rng(5)
swept = []
mgr = CheckpointManager(url, model, opt, generators={"noise": noise}, every=2, keep_last=2,
                        log=lambda said: swept.append(said))
start = mgr.restore()
for step in range(start + 1, stop + 1):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 64, generator=g) * float(1 + noise.random())
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    mgr.step(step, loss=loss.item())
mgr.close(stop)
print("RESTORED", start, "|".join(swept))
print("CALLS", calls.get("any", 0))
'''


def run_loop(s3, url: str, stop: int, width: int, phase: str = "none", at: int = 0) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, "-c", textwrap.dedent(LOOP), url, str(stop), str(width), phase, str(at), TESTS],
                    env={**os.environ, **s3.env}, capture_output=True, text=True, timeout=300)


def final_digest(s3, bucket: str, prefix: str, step: int) -> str:
    doc = s3.client().get_object(Bucket=bucket, Key=f"{prefix}/step_{step:06d}.json")["Body"].read()
    return json.loads(doc)["blake3"]


def killed_and_resumed(s3, bucket: str, prefix: str, stop: int, width: int, phase: str, at: int) -> str:
    """Kill at the phase, check what is on the store, restart to ``stop``; the restart's output."""
    from ckptfmt.run.storerun import open_run
    url = f"s3://{bucket}/{prefix}"
    killed = run_loop(s3, url, stop, width, phase, at)
    assert killed.returncode == -9, (phase, at, killed.stderr[-2000:])
    run = open_run(url)
    committed = [g for g in run.generations() if g.committed]
    for gen in committed:            # never a committed generation that fails verification
        assert gen.check(deep=True) is None, (phase, at, gen.step, gen.check(deep=True))
    again = run_loop(s3, url, stop, width)
    assert again.returncode == 0, (phase, at, again.stderr[-2000:])
    restored = int(again.stdout.split("RESTORED ")[1].split()[0])
    assert restored == (max(g.step for g in committed) if committed else 0), (phase, at, restored)
    assert not s3.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads")
    left = [g.step for g in open_run(url).generations() if not g.committed]
    assert left == [], (phase, at, left)
    return again.stdout


@pytest.fixture(scope="module")
def straight(s3):
    """(final generation's digest, store calls of the whole run) of runs never killed, by width."""
    s3.bucket("straight")
    out = {}
    for width in (32, 9_000):
        done = run_loop(s3, f"s3://straight/w{width}", 8, width)
        assert done.returncode == 0, done.stderr
        out[width] = final_digest(s3, "straight", f"w{width}", 8), int(done.stdout.split("CALLS ")[1])
    return out


# (phase, which call of it, model width): 32 gives a .bin of 25 KB (one PUT at completion), 9_000
# one of 7.5 MB (a multipart upload of two 5 MiB parts, killpoints.arm: a kill at a part's upload
# leaves it unfinished)
PHASES = [("upload", 1, 9_000), ("complete", 2, 32), ("complete", 2, 9_000), ("confirm", 3, 32),
          ("manifest", 2, 32), ("segment", 3, 32), ("retention", 2, 32), ("retention", 3, 32)]


@pytest.mark.parametrize("phase,at,width", PHASES, ids=[f"{p}-{a}-{w}" for p, a, w in PHASES])
def test_a_kill_at_each_phase_of_a_save_on_the_store_resumes_bit_exactly(s3, bucket, straight, phase, at, width):
    said = killed_and_resumed(s3, bucket, "runs/k", 8, width, phase, at)
    assert final_digest(s3, bucket, "runs/k", 8) == straight[width][0]
    if phase == "upload":              # the unfinished multipart upload was aborted by the restart
        assert "leftovers of interrupted saves" in said


def test_kills_at_random_store_calls_always_resume_bit_exactly(s3, bucket, straight):
    """Twelve in CI, 1,000 in the long tier: each at a store call drawn from a whole run's."""
    digest, calls = straight[32]
    rng = random.Random(2026)
    for i in range(scale(12, 1000)):
        prefix = f"runs/r{i}"
        killed_and_resumed(s3, bucket, prefix, 8, 32, "any", rng.randint(1, calls))
        assert final_digest(s3, bucket, prefix, 8) == digest
