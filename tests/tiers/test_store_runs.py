"""A run written straight to object storage: ``CheckpointManager("s3://bucket/runs/x", ...)``
against an S3-protocol server (moto's, on 127.0.0.1). Each generation is streamed to the store
and committed by its manifest after its parts read back; the history is appended as segments;
one writer holds the run's lease; a restart resumes bit-exactly from what is on the store,
passing over partial and torn uploads; retention removes on the store; nothing is written on
the local disk."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("s3fs")

from ckptfmt import fingerprint  # noqa: E402
from ckptfmt import format as fmt  # noqa: E402
from ckptfmt.errors import RunLockedError, UnsupportedSetupError  # noqa: E402
from ckptfmt.run import history as hist  # noqa: E402
from ckptfmt.run.storerun import StoreRun, open_run  # noqa: E402
from ckptfmt.store.objects import ObjectStore  # noqa: E402
from ckptfmt.torch import CheckpointManager  # noqa: E402
from conftest import cli  # noqa: E402
from s3server import fixtures  # noqa: E402
from storeloop import build, train  # noqa: E402

s3, bucket = fixtures("runs")


def keys(s3, bucket: str, prefix: str = "runs/x/") -> list[str]:
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"][len(prefix):] for o in listed)


def straight_and_resumed(url: str, stop: int, cut: int, **how):
    """(state of a run trained straight to ``stop``; the same run stopped at ``cut``, closed,
    and resumed from the store by a new manager)."""
    model, opt = build()
    noise = np.random.default_rng(1)
    with CheckpointManager(url + "-straight", model, opt, generators={"noise": noise}, every=4, **how) as mgr:
        train(mgr, model, opt, 0, stop, noise)
    straight = (model.state_dict(), opt.state_dict(), noise.bit_generator.state)

    model, opt = build()
    noise = np.random.default_rng(1)
    mgr = CheckpointManager(url, model, opt, generators={"noise": noise}, every=4, **how)
    assert mgr.restore() == 0
    train(mgr, model, opt, 0, cut, noise)
    mgr.close(cut)

    model, opt = build(seed=99)                    # other weights: all must come from the store
    noise = np.random.default_rng(7)
    mgr = CheckpointManager(url, model, opt, generators={"noise": noise}, every=4, **how)
    assert mgr.restore() == cut and mgr.restored_from == f"{url}/{fmt.checkpoint_name(cut)}"
    train(mgr, model, opt, cut, stop, noise)
    mgr.close(stop)
    return straight, (model.state_dict(), opt.state_dict(), noise.bit_generator.state)


def same_state(a, b) -> None:
    (ma, oa, na), (mb, ob, nb) = a, b
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert na == nb
    for pid, state in oa["state"].items():
        assert all(torch.equal(v, ob["state"][pid][k]) for k, v in state.items())


@pytest.mark.parametrize("async_save", [False, True])
def test_a_run_on_a_url_resumes_from_the_store_bit_exactly(s3, bucket, async_save):
    url = f"s3://{bucket}/runs/x"
    straight, resumed = straight_and_resumed(url, stop=14, cut=9, keep_last=2, async_save=async_save)
    same_state(straight, resumed)
    # retention ran on the store: the newest two durable generations, each whole, no lease left
    names = keys(s3, bucket)
    steps = sorted({fmt.parse_name(n)[0] for n in names if fmt.parse_name(n)})
    assert steps == [12, 14]
    for step in steps:
        assert {fmt.checkpoint_name(step), fmt.manifest_name(step), f"step_{step:06d}.extra.safetensors"} <= set(names)
    assert not [n for n in names if n.startswith((".writer.", ".lease."))]
    # the bytes on the store are the ones the manifest commits
    body = s3.client().get_object(Bucket=bucket, Key="runs/x/step_000014.bin")["Body"].read()
    doc = json.loads(s3.client().get_object(Bucket=bucket, Key="runs/x/step_000014.json")["Body"].read())
    assert fingerprint.of_bytes(body) == doc["blake3"] and len(body) == doc["size"]


def test_the_history_on_the_store_is_segments_read_as_one_canonical_history(s3, bucket):
    url = f"s3://{bucket}/runs/x"
    straight_and_resumed(url, stop=10, cut=6, keep_last=2)
    segments = [n for n in keys(s3, bucket) if n.startswith(".loss.d/")]
    assert segments == [f".loss.d/{i:010d}.jsonl" for i in range(1, len(segments) + 1)] and len(segments) >= 3
    read = hist.read(open_run(url).history)
    assert [r["step"] for r in read.canonical()] == list(range(1, 11))
    kinds = [(r["event"], r["step"]) for r in read.events()]
    assert ("resume", 6) in kinds and ("checkpoint", 10) in kinds and ("committing", 8) in kinds
    assert not read.problems and not read.warnings
    # the roots the history records are the committed generations' (what latest-valid judges by)
    run = open_run(url)
    assert run.judge()(run.latest()) is None and run.latest().step == 10


def test_latest_valid_on_the_store_passes_over_partial_and_torn_uploads(s3, bucket):
    url = f"s3://{bucket}/runs/x"
    model, opt = build()
    noise = np.random.default_rng(1)
    with CheckpointManager(url, model, opt, generators={"noise": noise}, every=4, keep_last=None) as mgr:
        train(mgr, model, opt, 0, 8, noise)
    client = s3.client()
    whole = client.get_object(Bucket=bucket, Key="runs/x/step_000008.bin")["Body"].read()
    # step 12: a .bin whose upload never got its manifest (a kill before the commit)
    client.put_object(Bucket=bucket, Key="runs/x/step_000012.bin", Body=whole[:100])
    # step 8: its .bin replaced by a shorter one after the commit (torn)
    client.put_object(Bucket=bucket, Key="runs/x/step_000008.bin", Body=whole[:-64])
    model, opt = build(seed=5)
    mgr = CheckpointManager(url, model, opt, generators={"noise": np.random.default_rng(0)}, every=4, keep_last=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert mgr.restore() == 4
    said = " ".join(str(w.message) for w in seen)
    assert "skipping generation 8" in said
    assert "step_000012.bin" not in keys(s3, bucket)       # the leftover: removed by the next writer
    # the run goes on and commits those steps again over what was there
    train(mgr, model, opt, 4, 12, np.random.default_rng(0))
    mgr.close(12)
    run = open_run(url)
    assert [g.step for g in run.generations() if g.check(deep=True) is None] == [4, 8, 12]


def test_one_writer_per_run_on_the_store(s3, bucket):
    url = f"s3://{bucket}/runs/x"
    model, opt = build()
    first = CheckpointManager(url, model, opt, every=4)
    try:
        with pytest.raises(RunLockedError, match="held by checkpoint manager pid"):
            CheckpointManager(url, *build(), every=4)
        assert [n for n in keys(s3, bucket) if n.startswith(".writer.")] == [".writer.0000000001"]
    finally:
        first.close()
    assert not [n for n in keys(s3, bucket) if n.startswith(".writer.")]
    CheckpointManager(url, *build(), every=4).close()          # released: the next writer takes it


def test_a_mirror_of_a_run_on_the_store_is_refused_before_anything_is_written(s3, bucket, tmp_path):
    url = f"s3://{bucket}/runs/x"
    with pytest.raises(UnsupportedSetupError, match="not mirrored: it is in object storage already"):
        CheckpointManager(url, *build(), mirror=f"s3://{bucket}/elsewhere")
    assert keys(s3, bucket) == []
    assert isinstance(open_run(url, create=True), StoreRun) and open_run(tmp_path).path == tmp_path


NO_LOCAL_WRITE = """
import numpy as np, torch
from ckptfmt.torch import CheckpointManager
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.Linear(12, 3))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
mgr = CheckpointManager({url!r}, model, opt, every=3, keep_last=2, async_save={async_save})
start = mgr.restore()
for step in range(start + 1, start + 8):
    loss = model(torch.randn(5, 6)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    mgr.step(step, loss=loss.item())
mgr.close(start + 7)
print(start + 7)
"""


def test_a_run_on_the_store_writes_nothing_on_the_local_disk(s3, bucket, tmp_path):
    """The working directory, TMPDIR and HOME of the training process stay empty through two
    starts (a fresh one and a resume), synchronous and asynchronous saves alike."""
    url = f"s3://{bucket}/runs/x"
    for name in ("cwd", "tmp", "home"):
        (tmp_path / name).mkdir()
    env = {**os.environ, **s3.env, "TMPDIR": str(tmp_path / "tmp"), "HOME": str(tmp_path / "home"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("CKPTFMT_MEMORY_DIR", None)
    for async_save, expected in ((False, "7"), (True, "14")):
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(NO_LOCAL_WRITE.format(url=url, async_save=async_save))],
                             cwd=tmp_path / "cwd", env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-1] == expected
    left = {name: sorted(str(p.relative_to(tmp_path / name)) for p in (tmp_path / name).rglob("*"))
            for name in ("cwd", "tmp", "home")}
    assert left == {"cwd": [], "tmp": [], "home": []}
    assert {fmt.parse_name(n)[0] for n in keys(s3, bucket) if fmt.parse_name(n)} == {12, 14}


def test_validate_of_the_run_url_checks_what_the_manager_wrote(s3, bucket):
    url = f"s3://{bucket}/runs/x"
    model, opt = build()
    with CheckpointManager(url, model, opt, every=4, keep_last=2) as mgr:
        train(mgr, model, opt, 0, 8, np.random.default_rng(0))
    done = cli("validate", url, env=s3.env)
    assert done.returncode == 0, done.stdout + done.stderr
    s3.client().put_object(Bucket=bucket, Key="runs/x/step_000008.extra.safetensors", Body=b"x" * 8)
    done = cli("validate", url, env=s3.env)
    assert done.returncode == 1 and "step_000008.extra.safetensors" in done.stdout + done.stderr


def test_a_store_run_is_a_run_over_the_store_it_names(s3, bucket):
    run = open_run(f"s3://{bucket}/runs/y/", create=True)
    assert run.where == f"s3://{bucket}/runs/y" and run.path is None and run.generations() == []
    assert isinstance(run.store, ObjectStore)
    from ckptfmt.errors import RemoteError
    with pytest.raises(RemoteError, match="no run at this URL"):
        open_run(f"s3://{bucket}/runs/y")                     # gc, pin: an empty prefix is no run
    done = cli("gc", f"s3://{bucket}/runs/typo", "--keep-last", "1", env=s3.env)
    assert done.returncode == 2 and "no run at this URL" in done.stderr, done.stderr
    s3.client().put_object(Bucket=bucket, Key="runs/m/.mirror-index.json", Body=b"{}")
    for create in (True, False):
        with pytest.raises(UnsupportedSetupError, match="a mirror's destination"):
            open_run(f"s3://{bucket}/runs/m", create=create)


def committed_4_and_8_then_8_flipped(s3, bucket: str, url: str) -> None:
    """Generations 4 and 8 committed at ``url`` (runs/x), then one byte of step 8's ``.bin``
    flipped on the store: same size, same header, only its blake3 tells."""
    model, opt = build()
    with CheckpointManager(url, model, opt, every=4, keep_last=None) as mgr:
        train(mgr, model, opt, 0, 8, np.random.default_rng(0))
    key = "runs/x/step_000008.bin"
    flipped = bytearray(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    flipped[-1] ^= 1
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(flipped))


def test_a_generation_on_the_store_that_does_not_hash_to_its_manifest_is_never_restored(s3, bucket):
    url = f"s3://{bucket}/runs/x"
    committed_4_and_8_then_8_flipped(s3, bucket, url)
    from ckptfmt.errors import FingerprintMismatchError
    with pytest.raises(FingerprintMismatchError, match=f"^{url}/step_000008.bin: "):
        open_run(url).generation_at(f"{url}/step_000008.bin").open()
    model, opt = build(seed=3)
    mgr = CheckpointManager(url, model, opt, every=4, keep_last=None)
    with pytest.warns(UserWarning, match="skipping generation 8"):
        assert mgr.restore() == 4
    mgr.close()


TRAIN = ["--config", "tiny", "--checkpoint-every", "20", "--sample-every", "25", "--log-every", "100000"]


def trained(run: str, steps: int, env: dict, kill_after: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ckptfmt.cli", "train", "--run", run, "--steps", str(steps), *TRAIN]
    return subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


def signalled_after(s3, bucket: str, run: str, committed: int, sig: int) -> tuple[int, str]:
    """``train --run s3://bucket/runs/RUN --steps 60`` sent ``sig`` as soon as it says its
    step-``committed`` generation is committed on the store (its log line, read as it comes:
    listing the store to see the manifest took long enough under load for the run to reach
    step 60 first); its exit status and stderr."""
    url = f"s3://{bucket}/runs/{run}"
    proc = subprocess.Popen([sys.executable, "-m", "ckptfmt.cli", "train", "--run", url, "--steps", "60", *TRAIN],
                            env={**os.environ, **s3.env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said = []
    for line in proc.stderr:
        said.append(line)
        if line.startswith(f"[train] step {committed}: checkpoint"):
            proc.send_signal(sig)
            break
    else:
        proc.wait(timeout=240)
        raise AssertionError(f"the run never said step {committed} was committed: {''.join(said)}")
    _, rest = proc.communicate(timeout=240)
    return proc.returncode, "".join(said) + (rest or "")


def test_train_on_a_url_stopped_or_killed_resumes_from_the_store_bit_exactly(s3, bucket, tmp_path):
    """``ckptfmt train --run s3://...`` SIGTERMed after its step-20 commit (it checkpoints the
    step it is at on the store, says so, and exits 0) and started again to 60, and one SIGKILLed
    after its step-40 commit and started again (the history's segment with step 40's committing
    record was on the store before its manifest), both end with the generation a local run
    trained straight to 60 commits, byte for byte."""
    import re
    import signal
    local = tmp_path / "straight"
    assert trained(str(local), 60, s3.env).returncode == 0
    mine = json.loads((local / "step_000060.json").read_text())
    url = f"s3://{bucket}/runs/t"
    code, said = signalled_after(s3, bucket, "t", 20, signal.SIGTERM)
    stopped = re.search(r"step (\d+): checkpoint \(SIGTERM\)", said)
    assert code == 0 and stopped and 20 <= int(stopped.group(1)) < 60, said
    at = int(stopped.group(1))
    events = [(r["event"], r["step"], r.get("reason")) for r in hist.read(open_run(url).history).events()]
    assert ("checkpoint", at, "SIGTERM") in events and fmt.manifest_name(at) in keys(s3, bucket, "runs/t/")
    again = trained(url, 60, s3.env)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr and fmt.checkpoint_name(at) in again.stderr
    theirs = json.loads(s3.client().get_object(Bucket=bucket, Key="runs/t/step_000060.json")["Body"].read())
    assert theirs["blake3"] == mine["blake3"] and theirs["size"] == mine["size"]
    assert cli("validate", url, env=s3.env).returncode == 0

    url = f"s3://{bucket}/runs/k"
    assert signalled_after(s3, bucket, "k", 40, signal.SIGKILL)[0] == -signal.SIGKILL
    assert "step_000060.json" not in keys(s3, bucket, "runs/k/")
    records = hist.read(open_run(url).history)
    assert ("committing", 40) in [(r["event"], r["step"]) for r in records.events()]
    again = trained(url, 60, s3.env)
    assert again.returncode == 0, again.stderr
    theirs = json.loads(s3.client().get_object(Bucket=bucket, Key="runs/k/step_000060.json")["Body"].read())
    assert theirs["blake3"] == mine["blake3"]


def test_train_on_a_missing_bucket_stops_in_one_line_before_training(s3, tmp_path):
    done = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "train", "--run", "s3://no-such-bucket/runs/t",
                           "--steps", "5", *TRAIN], env={**os.environ, **s3.env}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    said = done.stderr.strip()
    assert done.returncode == 2 and len(said.splitlines()) == 1 and "no such bucket" in said, said
    assert "s3://no-such-bucket/runs/t" in said
    assert list(tmp_path.iterdir()) == []


def test_a_writer_whose_lease_was_taken_over_commits_nothing_more(s3, bucket):
    url = f"s3://{bucket}/runs/x"
    model, opt = build()
    mgr = CheckpointManager(url, model, opt, every=4, keep_last=None)
    train(mgr, model, opt, 0, 4, np.random.default_rng(0))
    # another writer took the lease over (as after this one stalled past its expiry)
    s3.client().put_object(Bucket=bucket, Key="runs/x/.writer.0000000002",
                           Body=json.dumps({"purpose": "trainer", "pid": 1, "host": "elsewhere",
                                            "expires": 4e9}).encode())
    with pytest.raises(RunLockedError, match="taken over by trainer pid 1 on elsewhere"):
        train(mgr, model, opt, 4, 8, np.random.default_rng(0))
    assert {fmt.parse_name(n)[0] for n in keys(s3, bucket) if fmt.parse_name(n)} == {4}
    with pytest.raises(RunLockedError, match="taken over"):
        mgr.close()                        # its last records are no timeline's: not written, and said
    assert mgr.closed and ".writer.0000000002" in keys(s3, bucket)
    import threading
    assert not [t for t in threading.enumerate() if t.name == "ckptfmt-lease"]     # its heartbeat stopped
    assert [n for n in keys(s3, bucket) if n.startswith(".loss.d/")] == [".loss.d/0000000001.jsonl"]


def test_gc_pin_and_import_take_the_url_of_a_run_on_the_store(s3, bucket, tmp_path):
    url = f"s3://{bucket}/runs/x"
    model, opt = build()
    noise = np.random.default_rng(1)
    with CheckpointManager(url, model, opt, generators={"noise": noise}, every=4, keep_last=None) as mgr:
        train(mgr, model, opt, 0, 16, noise)
    steps = lambda: sorted({fmt.parse_name(n)[0] for n in keys(s3, bucket) if fmt.parse_name(n)})  # noqa: E731
    assert steps() == [4, 8, 12, 16]
    assert cli("pin", url, "8", env=s3.env).returncode == 0
    done = cli("gc", url, "--keep-last", "1", "--json", env=s3.env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["deleted"] == [4, 12] and steps() == [8, 16]
    assert not [n for n in keys(s3, bucket) if n.startswith(".writer.")]      # gc's lease given back
    # import brings the newest generation, the history (its segments as one file) and the sidecars
    dest = tmp_path / "here"
    done = cli("import", url, str(dest), env=s3.env)
    assert done.returncode == 0, done.stderr
    assert json.loads((dest / ".pins.json").read_text()) == [8]
    assert [r["step"] for r in hist.read(dest / ".loss.json").canonical()] == list(range(1, 17))
    assert cli("validate", str(dest)).returncode == 0
    model2, opt2 = build(seed=4)
    noise2 = np.random.default_rng(9)
    with CheckpointManager(dest, model2, opt2, generators={"noise": noise2}, every=4) as mgr:
        assert mgr.restore() == 16
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert noise2.bit_generator.state == noise.bit_generator.state


def test_validate_url_judges_a_store_run_by_the_roots_its_segments_record(s3, bucket):
    """A generation replaced whole by another valid one (a different commit of its step) is
    named by validate URL: the history's segments record the root it committed."""
    url = f"s3://{bucket}/runs/x"
    for name, seed in (("x", 0), ("other", 1)):
        model, opt = build(seed)
        with CheckpointManager(f"s3://{bucket}/runs/{name}", model, opt, every=4, keep_last=None) as mgr:
            train(mgr, model, opt, 0, 8, np.random.default_rng(seed))
    client = s3.client()
    for suffix in (".bin", ".json", ".extra.safetensors"):
        body = client.get_object(Bucket=bucket, Key=f"runs/other/step_000008{suffix}")["Body"].read()
        client.put_object(Bucket=bucket, Key=f"runs/x/step_000008{suffix}", Body=body)
    assert open_run(f"s3://{bucket}/runs/other").latest().check(deep=True) is None
    done = cli("validate", url, env=s3.env)
    assert done.returncode == 1 and "step 8" in done.stdout + done.stderr, done.stdout + done.stderr


def test_a_save_while_the_store_is_unreachable_fails_naming_the_object_and_the_next_succeeds(s3, bucket, monkeypatch):
    """The connections to the server dropped mid-save (a TCP proxy between, cutting them and
    refusing new ones until healed): the save fails in one line naming the generation's object,
    the previous generation stays intact, and once the store is back the next save commits."""
    from ckptfmt.errors import RemoteError
    from s3server import CuttingProxy
    proxy = CuttingProxy(s3.port, cut_after=float("inf"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    url = f"s3://{bucket}/runs/x"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 300), torch.nn.BatchNorm1d(300), torch.nn.Linear(300, 300),
                                torch.nn.Linear(300, 3))      # a 1.1 MB .bin: the cut lands inside its upload
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    noise = np.random.default_rng(0)
    mgr = CheckpointManager(url, model, opt, every=4, keep_last=None)
    try:
        train(mgr, model, opt, 0, 4, noise)
        with proxy.lock:
            proxy.cut_after = proxy.sent + 200_000       # the lease's look and well into the upload
        with pytest.raises(RemoteError, match=rf"^{url}/step_000008\.bin: upload failed") as failed:
            train(mgr, model, opt, 4, 8, noise)
        assert len(str(failed.value).splitlines()) == 1
        proxy.heal()
        run = open_run(url)
        assert [g.step for g in run.generations() if g.committed] == [4] and run.latest(deep=True).step == 4
        mgr.save(8, "after the store came back")
        assert [g.step for g in open_run(url).generations() if g.check(deep=True) is None] == [4, 8]
    finally:
        proxy.heal()
        mgr.close()
        proxy.close()


def test_retention_on_the_store_never_takes_a_damaged_generation_for_the_newest_valid(s3, bucket):
    """A generation damaged on the store (same size, one byte flipped) was committed by an
    earlier writer: retention reads it back before trusting it, so the generation just committed
    is kept and the damaged one never stands in for it."""
    url = f"s3://{bucket}/runs/x"
    committed_4_and_8_then_8_flipped(s3, bucket, url)
    model, opt = build(seed=2)
    with pytest.warns(UserWarning, match="skipping generation 8"):
        with CheckpointManager(url, model, opt, every=2, keep_last=1) as mgr:
            assert mgr.restore() == 4
            train(mgr, model, opt, 4, 6, np.random.default_rng(0))
    assert {fmt.parse_name(n)[0] for n in keys(s3, bucket) if fmt.parse_name(n)} == {6, 8}
    with pytest.warns(UserWarning, match="skipping generation 8"):
        assert open_run(url).latest(deep=True).step == 6


def test_resuming_a_store_run_from_its_own_older_generation_is_refused(s3, bucket):
    url = f"s3://{bucket}/runs/x"
    model, opt = build()
    with CheckpointManager(url, model, opt, every=4, keep_last=None) as mgr:
        train(mgr, model, opt, 0, 8, np.random.default_rng(0))
    with CheckpointManager(url, *build(), every=4) as mgr:
        with pytest.raises(UnsupportedSetupError, match="newer ones .steps .8.*fork it"):
            mgr.restore(source=f"{url}/step_000004.bin")


def test_a_restore_from_the_store_reads_its_generation_once(s3, bucket):
    """The newest generation is judged by reading it whole, every part hashed against its
    manifest, and that read is what the restore loads: no part is downloaded twice."""
    url = f"s3://{bucket}/runs/once"
    model, opt = build()
    noise = np.random.default_rng(1)
    with CheckpointManager(url, model, opt, generators={"noise": noise}, every=4) as mgr:
        train(mgr, model, opt, 0, 8, noise)
    model, opt = build(seed=5)
    mgr = CheckpointManager(url, model, opt, generators={"noise": np.random.default_rng(2)}, every=4)
    sent = []
    mgr.run.store.fs.s3.meta.events.register("before-send.s3", lambda request, **_: sent.append(
        (request.method, request.url.split("?")[0].rsplit("/", 1)[-1], request.headers.get("Range"))))
    assert mgr.restore() == 8
    mgr.close()
    payload = [(name, rng) for method, name, rng in sent
               if method == "GET" and name in ("step_000008.bin", "step_000008.extra.safetensors")]
    whole = sorted(name for name, rng in payload if rng is None)
    assert whole == ["step_000008.bin", "step_000008.extra.safetensors"], payload
    assert [rng for _, rng in payload if rng is not None] == [b"bytes=0-7"], payload     # the header's 8 bytes


RAM_LOOP = """
import os, signal, sys
import numpy as np, torch
from ckptfmt.torch import CheckpointManager
url, stop, kill_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.Linear(12, 3))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
noise = np.random.default_rng(3)
mgr = CheckpointManager(url, model, opt, generators={"noise": noise}, every=4, keep_last=2, memory_every=1)
start = mgr.restore()
print("RESTORED", start, mgr.restored_tier, flush=True)
for step in range(start + 1, stop + 1):
    loss = model(torch.randn(5, 6) * float(1 + noise.random())).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    mgr.step(step, loss=loss.item())
    if step == kill_after:
        mgr.wait()
        os.kill(os.getpid(), signal.SIGKILL)
mgr.close(stop)
"""


def test_a_run_on_the_store_with_a_ram_tier_resumes_from_ram_and_writes_nothing_else_locally(s3, bucket, tmp_path):
    """``memory_every=1`` on a run in object storage: RAM generations in the tier (the only
    local writes), durable ones on the store. Killed at step 6 (step 4 on the store), its RAM
    step 6 then damaged, the restart passes over it, resumes from RAM step 5 and ends with the
    same step-8 generation as a run never killed; the close removes the RAM generations the
    store's step 8 covers."""
    for name in ("cwd", "tmp", "home", "ram"):
        (tmp_path / name).mkdir()
    env = {**os.environ, **s3.env, "TMPDIR": str(tmp_path / "tmp"), "HOME": str(tmp_path / "home"),
           "PYTHONDONTWRITEBYTECODE": "1", "CKPTFMT_MEMORY_DIR": str(tmp_path / "ram")}

    def loop(url: str, kill_after: int = 0) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", RAM_LOOP, url, "8", str(kill_after)], cwd=tmp_path / "cwd",
                              env=env, capture_output=True, text=True, timeout=300)
    straight = loop(f"s3://{bucket}/runs/straight")
    assert straight.returncode == 0, straight.stderr
    url = f"s3://{bucket}/runs/ram"
    killed = loop(url, kill_after=6)
    assert killed.returncode == -9, killed.stderr
    assert {fmt.parse_name(n)[0] for n in keys(s3, bucket, "runs/ram/") if fmt.parse_name(n)} == {4}
    tier = [p for p in (tmp_path / "ram").iterdir()]
    assert len(tier) == 1 and fmt.checkpoint_name(6) in [p.name for p in tier[0].iterdir()]
    tools = {**s3.env, "CKPTFMT_MEMORY_DIR": str(tmp_path / "ram")}     # the commands run elsewhere
    listed = cli("ls", url, "--json", env=tools)                        # ls and gc of the URL see the tier
    assert listed.returncode == 0, listed.stderr
    assert [g["step"] for g in json.loads(listed.stdout)["tiers"]["memory"]["generations"]] == [5, 6]
    collected = cli("gc", url, "--keep-last", "2", "--json", env=tools)
    assert collected.returncode == 0, collected.stderr
    assert json.loads(collected.stdout)["tiers"]["memory"]["kept"] == [5, 6]     # newer than the store's step 4
    ram6 = tier[0] / fmt.checkpoint_name(6)                             # damaged in RAM: passed over
    data = bytearray(ram6.read_bytes())
    data[-3] ^= 0x10
    ram6.write_bytes(bytes(data))
    again = loop(url)
    assert again.returncode == 0, again.stderr
    assert "RESTORED 5 memory" in again.stdout and "skipping RAM generation 6: blake3 mismatch" in again.stderr
    doc = lambda prefix: json.loads(s3.client().get_object(Bucket=bucket, Key=f"{prefix}/step_000008.json")["Body"].read())
    assert doc("runs/ram")["blake3"] == doc("runs/straight")["blake3"]
    left = {name: sorted(str(p.relative_to(tmp_path / name)) for p in (tmp_path / name).rglob("*")
                         if not p.relative_to(tmp_path / name).parts[0].startswith("torchinductor_"))   # torch's cache
            for name in ("cwd", "tmp", "home", "ram")}
    assert left == {"cwd": [], "tmp": [], "home": [], "ram": []}          # the close emptied the tier


def test_latest_valid_on_the_store_passes_over_a_diverged_generation_as_locally(s3, bucket, tmp_path):
    """The value facts a manifest on the store records are read from the store: a newest
    generation holding NaN is diverged there as it is in a local directory, and latest-valid
    takes the finite one before it (not a manifest of the same name in the working directory)."""
    from ckptfmt.run import Run
    from ckptfmt.store.local import LocalStore
    from ckptfmt.store.writing import save
    nan = np.ones(4, "<f4")
    nan[0] = np.nan
    url = f"s3://{bucket}/runs/x"
    for store in (ObjectStore(url), LocalStore(tmp_path)):
        save(store, 1, np.ones(4, "<f4"), np.zeros(4, "<f4"), np.zeros(4, "<f4"))
        save(store, 2, nan, np.zeros(4, "<f4"), np.zeros(4, "<f4"))
    for run in (open_run(url), Run(tmp_path)):
        choice = run.choose()
        assert choice.gen.step == 1 and choice.non_finite == {2: {"weights": 1}}
