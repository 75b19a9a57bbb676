"""What credentials allow on a run on object storage (spec/RUN.md §2.0.2), against an S3 server
that checks them as AWS does (moto's IAM enforcement, ``fixtures(..., auth=True)``): credentials
that can read but not write (a read-only bucket for them), keys the store does not know, and
none at all. A writer (``train --run URL``, ``CheckpointManager(URL)``, ``gc URL``, ``pin``)
stops at its first write (the lease; ``pin``'s pins object) in one line (exit 2), before any
training step and with nothing written; the readers (``validate``, ``ls``, ``import``) work with
read-only credentials; a delete the store refuses is an error, never a silent success."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("s3fs")

from ckptfmt.errors import RemoteError  # noqa: E402
from ckptfmt.store.objects import ObjectStore  # noqa: E402
from ckptfmt.torch import CheckpointManager  # noqa: E402
from conftest import cli, cli_in_process  # noqa: E402
from s3server import fixtures  # noqa: E402
import warm  # noqa: E402

s3, bucket = fixtures("access", auth=True)

# AWS's read-only policy (AmazonS3ReadOnlyAccess) allows s3:Get* and s3:List*; moto's server
# names the action of a HEAD request s3:HeadObject / s3:HeadBucket, where AWS asks for
# s3:GetObject / s3:ListBucket, so the same access there needs s3:Head* too.
READ_ONLY = ["s3:Get*", "s3:List*", "s3:Head*"]
TRAIN = ["--config", "tiny", "--checkpoint-every", "20", "--sample-every", "25", "--log-every", "100000"]


@pytest.fixture(scope="module")
def reader(s3):
    return s3.user("reader", READ_ONLY)


def build():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def written(url: str) -> None:
    """A run at ``url`` with generations 2 and 4, written with the administrator's keys."""
    model, opt = build()
    with CheckpointManager(url, model, opt, every=2, keep_last=None, handle_signals=False) as mgr:
        for step in range(1, 5):
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            mgr.step(step, loss=float(step))


def held(s3, bucket: str) -> dict[str, bytes]:
    """Every object in the bucket, by key, with its bytes."""
    client = s3.client()
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def trained(env: dict, url: str, cwd) -> subprocess.CompletedProcess:
    """``ckptfmt train --run URL`` in a process of its own (forked warm), in ``env`` only."""
    return warm.run([sys.executable, "-m", "ckptfmt.cli", "train", "--run", url, "--steps", "8", *TRAIN],
                    env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_train_with_read_only_credentials_stops_at_its_lease_in_one_line_and_writes_nothing(s3, bucket, reader,
                                                                                            tmp_path):
    url = f"s3://{bucket}/runs/x"
    written(url)
    before = held(s3, bucket)
    done = trained({**os.environ, **reader}, url, tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    said = done.stderr.strip()
    assert len(said.splitlines()) == 1 and "Traceback" not in said, said
    assert said.startswith(f"ckptfmt: {url}/.writer.") and \
        said.endswith(": cannot create: access denied: these credentials may not write there"), said
    assert reader["AWS_SECRET_ACCESS_KEY"] not in said
    assert held(s3, bucket) == before                  # no lease, no history segment, nothing half-written
    assert list(tmp_path.iterdir()) == []


def test_a_manager_with_read_only_credentials_raises_before_a_step(s3, bucket, reader, monkeypatch):
    url = f"s3://{bucket}/runs/x"
    written(url)
    before = held(s3, bucket)
    for key, value in reader.items():
        monkeypatch.setenv(key, value)
    model, opt = build()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    with pytest.raises(RemoteError, match=rf"^{url}/\.writer\.\d+: cannot create: access denied: "
                                          r"these credentials may not write there$") as caught:
        CheckpointManager(url, model, opt, every=2)
    assert "\n" not in str(caught.value)
    assert not [t for t in threading.enumerate() if t.name == "ckptfmt-lease"]
    # the signal handlers it installed are given back with the error: Ctrl-C in a notebook that
    # keeps the error (and so the half-built manager) raises KeyboardInterrupt again
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert held(s3, bucket) == before


def test_keys_the_store_does_not_know_are_one_line_exit_2(s3, bucket, tmp_path, monkeypatch):
    """An access key the store has no record of (``train``), and a known key with the wrong
    secret (the manager): refused credentials, said as such, the secret never printed."""
    url = f"s3://{bucket}/runs/x"
    unknown = {**s3.env, "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEUNKNOWN00"}
    done = trained({**os.environ, **unknown}, url, tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr == f"ckptfmt: {url}: cannot list: credentials refused: the access key is not known " \
                          "there (InvalidAccessKeyId)\n"
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    model, opt = build()
    with pytest.raises(RemoteError, match=rf"^{url}: cannot list: credentials refused: the secret key is not the "
                                          r"access key's \(SignatureDoesNotMatch\)$"):
        CheckpointManager(url, model, opt, every=2, handle_signals=False)
    assert held(s3, bucket) == {}


def test_train_without_credentials_is_one_line_exit_2(s3, bucket, tmp_path):
    """No keys in the environment and no AWS config files (nor an instance's metadata service:
    a CI machine on EC2 would find its own credentials there)."""
    url = f"s3://{bucket}/runs/x"
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=s3.endpoint, AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_EC2_METADATA_DISABLED="true")
    work = tmp_path / "work"
    work.mkdir()
    done = trained(env, url, work)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr == f"ckptfmt: {url}: cannot list: no credentials (AWS_ACCESS_KEY_ID and " \
                          "AWS_SECRET_ACCESS_KEY, or a profile in ~/.aws)\n"
    assert list(work.iterdir()) == [] and held(s3, bucket) == {}


def test_read_only_credentials_validate_list_and_import_a_run_but_gc_and_pin_stop_in_one_line(s3, bucket, reader,
                                                                                             tmp_path):
    url = f"s3://{bucket}/runs/x"
    written(url)
    before = held(s3, bucket)
    checked = cli("validate", url, env=reader)
    assert checked.returncode == 0 and checked.stdout.startswith(f"{url}: OK"), checked.stdout + checked.stderr
    listed = cli("ls", url, env=reader)
    assert listed.returncode == 0 and [line.split()[0] for line in listed.stdout.splitlines()[2:]] == ["2", "4"]
    brought = cli_in_process(["import", url, tmp_path / "here"], env=reader)
    assert brought.returncode == 0 and brought.stdout.startswith("restored step 4"), brought.stdout + brought.stderr
    assert brought.stderr.startswith(f"ckptfmt: warning: {url}: no read lease: ") and \
        len(brought.stderr.splitlines()) == 1, brought.stderr          # read without one, and said
    for args, first in ((("gc", url, "--keep-last", "1"), ".writer."), (("pin", url, "2"), ".pins.json")):
        refused = cli(*args, env=reader)         # gc's first write is its lease, pin's the pins object
        assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
        assert len(refused.stderr.splitlines()) == 1 and refused.stderr.startswith(f"ckptfmt: {url}/{first}") and \
            refused.stderr.endswith(": access denied: these credentials may not write there\n"), refused.stderr
    assert held(s3, bucket) == before                  # step 2, which --keep-last 1 would delete, is there


def test_a_delete_the_store_refuses_is_an_error_not_a_silent_success(s3, bucket, reader, monkeypatch):
    """S3's DeleteObjects answers 200 with the refused keys listed apart (s3fs's ``rm`` drops
    them): the store's ``remove``, of one object or of a shards folder, raises them."""
    client = s3.client()
    for key in ("runs/x/step_000002.json", "runs/x/step_000002.shards/0-of-2.bin", "runs/x/step_000002.shards/1-of-2.bin"):
        client.put_object(Bucket=bucket, Key=key, Body=b"kept")
    before = held(s3, bucket)
    for key, value in reader.items():
        monkeypatch.setenv(key, value)
    store = ObjectStore(f"s3://{bucket}/runs/x")
    for name, recursive in (("step_000002.json", False), ("step_000002.shards", True)):
        with pytest.raises(RemoteError, match=rf"^s3://{bucket}/runs/x/{name}: cannot delete: access denied: "
                                              r"these credentials may not delete there$"):
            store.remove(name, recursive=recursive)
    assert held(s3, bucket) == before
