"""A store that stops answering mid-run: ``ckptfmt train --run s3://...`` against its own S3
server, which is then stopped (SIGSTOP: it accepts connections and never answers, as a hung or
suspended server does). Every store request gives up after ``CKPTFMT_STORE_TIMEOUT`` seconds,
so the save fails in one line naming what it could not reach, ``train`` closes in bounded time
and exits 75; once the server goes on, the previous generation is intact and a restart resumes
from it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("s3fs")

from conftest import cli  # noqa: E402
from s3server import S3Server  # noqa: E402

TIMEOUT_S = 1        # per store request: 3 attempts and their backoffs make a call ~5 s, at most 11 s
TRAIN = ["--config", "tiny", "--checkpoint-every", "20", "--sample-every", "1000000", "--log-every", "1000000"]


def committed(s3: S3Server, bucket: str, prefix: str) -> list[int]:
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(int(m.group(1)) for o in listed if (m := re.fullmatch(r".*/step_(\d+)\.json", o["Key"])))


@pytest.mark.timeout(120)        # 30-40 s; a store call without its timeout hangs here, not the suite
def test_train_on_a_stalled_store_fails_the_save_in_bounded_time_and_exits_75(tmp_path):
    with S3Server() as s3:       # its own server: this test stops it
        bucket = s3.bucket("stalled")
        url = f"s3://{bucket}/runs/s"
        env = {**os.environ, **s3.env, "CKPTFMT_STORE_TIMEOUT": str(TIMEOUT_S)}
        proc = subprocess.Popen([sys.executable, "-m", "ckptfmt.cli", "train", "--run", url, "--steps", "1000000",
                                 *TRAIN], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        try:
            deadline = time.monotonic() + 90
            while not committed(s3, bucket, "runs/s/"):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.05)
            s3.proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            code = proc.wait()
            took = time.monotonic() - stopped
            said = proc.stderr.read()
        finally:
            s3.proc.send_signal(signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stderr.close()
        failed = [line for line in said.splitlines() if "checkpoint failed" in line]
        assert code == 75 and len(failed) == 1, said
        # the save failed at the first store call it made, in one line naming its object (a part, the
        # history's segment) or the run it lists
        assert re.search(rf"checkpoint failed: {re.escape(url)}(/\S+)?: [^:]+: no answer in time",
                         failed[0]), said
        # the failed call, the history's last segment, the lease's release and a renewal in flight:
        # each within its deadline (3 attempts of a connection and an answer, the backoffs)
        assert took < 4 * (3 * 2 * TIMEOUT_S + 5), f"{took:.1f} s after the server stopped\n{said}"
        before = committed(s3, bucket, "runs/s/")
        checked = cli("validate", url, env=s3.env)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        again = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "train", "--run", url, "--steps",
                                str(before[-1] + 1), *TRAIN], env={**os.environ, **s3.env}, cwd=tmp_path, capture_output=True, text=True,
                               timeout=90)
        assert again.returncode == 0, again.stderr
        assert f"resumed from step_{before[-1]:06d}.bin" in again.stderr, again.stderr
        assert committed(s3, bucket, "runs/s/") == before + [before[-1] + 1]
