"""Resource exhaustion is named and leaves no residue: the run lock's holder record, the loss
history and the sidecars on a full disk (a real one: a small tmpfs, as the CLI contract's), a
failed lock acquisition that gives back what it took, and history events only for what happened."""
from __future__ import annotations

import errno
import json
import os

import pytest

from ckptfmt import fsio
from ckptfmt.errors import HistoryWriteError, RunLockedError, SaveError, SidecarWriteError, StorageError
from ckptfmt.run import SAMPLES, Run, RunLock
from ckptfmt.run.history import History
from conftest import small_tmpfs


@pytest.fixture
def full(tmp_path):
    """A 64 KiB tmpfs filled up but for its inodes: files can be created, not written."""
    with small_tmpfs(tmp_path / "full") as mnt:
        (mnt / "run").mkdir()
        filler = mnt / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        yield mnt / "run", filler


def test_a_full_disk_at_the_lock_is_named_and_a_retry_after_freeing_space_succeeds(full):
    run, filler = full
    with pytest.raises(StorageError) as info:
        RunLock(run, purpose="trainer").acquire()
    assert str(info.value) == f"{run}/.lock: run lock: writing the holder record failed: No space left on device"
    assert info.value.errno == errno.ENOSPC and info.value.could_not_run
    assert os.listdir(run) == []              # the .lock it created is gone, its flock given back
    filler.unlink()
    lock = RunLock(run, purpose="trainer").acquire()     # the same process: not "locked by ? on ?"
    assert json.loads((run / ".lock").read_text())["purpose"] == "trainer"
    lock.release()


def test_a_failed_acquisition_keeps_no_descriptor_nor_flock(tmp_path, monkeypatch):
    import ckptfmt.run.lock as lockmod

    def refuse(fd, data, offset):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    monkeypatch.setattr(lockmod.os, "pwrite", refuse)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(StorageError, match="writing the holder record failed"):
        RunLock(tmp_path).acquire()
    assert len(os.listdir("/proc/self/fd")) == fds and not (tmp_path / ".lock").exists()
    monkeypatch.undo()
    with RunLock(tmp_path):
        with pytest.raises(RunLockedError):
            RunLock(tmp_path).acquire()


def test_a_full_disk_at_the_history_append_is_named_and_leaves_no_torn_line(full):
    run, filler = full
    history = History(run / ".loss.json")
    with pytest.raises(HistoryWriteError) as info:
        history.append({"step": 1, "loss": 0.5, "pad": "x" * 8192})
    assert str(info.value).startswith(f"{run}/.loss.json: appending the record of step 1 failed: No space left")
    assert (run / ".loss.json").read_bytes() == b""
    assert info.value.could_not_run and not isinstance(info.value, SaveError)
    history.close()


def test_a_sidecar_the_disk_refuses_is_named_and_the_previous_one_stays(tmp_path, monkeypatch):
    run = Run(tmp_path, create=True)
    run.write_sidecar(SAMPLES, [{"step": 1}])

    def hook(op, path):
        if op == "write":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(fsio, "hook", hook)
    with pytest.raises(SidecarWriteError) as info:
        run.write_sidecar(SAMPLES, [{"step": 2}])
    monkeypatch.setattr(fsio, "hook", None)
    assert str(info.value) == f"{tmp_path}/.samples.json: replacing the sidecar failed: Input/output error"
    assert run.read_sidecar(SAMPLES) == [{"step": 1}] and sorted(os.listdir(tmp_path)) == [".samples.json"]


torch = pytest.importorskip("torch")

from models import tiny_linear  # noqa: E402


def _manager(path, **kw):
    from ckptfmt.torch import CheckpointManager
    model = tiny_linear()
    opt = torch.optim.Adam(model.parameters())
    return CheckpointManager(path, model, opt, handle_signals=False, **kw)


def test_a_step_the_format_cannot_hold_writes_nothing(tmp_path):
    mgr = _manager(tmp_path / "run", every=None)
    for step in (2**31, -1):
        with pytest.raises(SaveError, match=r"step must be an integer in 0\.\.2147483647"):
            mgr.step(step, loss=1.0)
    mgr.close()
    assert not (tmp_path / "run" / ".loss.json").exists() or (tmp_path / "run" / ".loss.json").read_text() == ""


def test_an_async_save_that_fails_to_commit_records_no_checkpoint_event(tmp_path, monkeypatch):
    mgr = _manager(tmp_path / "run", every=1, async_save=True, keep_last=None)
    mgr.step(1, loss=1.0)
    mgr.wait()

    def hook(op, path):
        if op == "write" and "step_000002" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(fsio, "hook", hook)
    mgr.step(2, loss=0.5)
    with pytest.raises(SaveError, match="No space left"):
        mgr.wait()
    monkeypatch.setattr(fsio, "hook", None)
    mgr.close()
    events = [json.loads(line) for line in (tmp_path / "run" / ".loss.json").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "checkpoint"] == [1]


@pytest.mark.parametrize("when", ["before the lock", "during the build"])
def test_a_stop_during_train_start_up_leaves_no_run_directory_it_created(tmp_path, monkeypatch, when):
    from ckptfmt.trainer import entry, loop
    from ckptfmt.run.signals import Flags
    flags = Flags(stop=when == "before the lock")
    build = loop.Trainer.build

    def interrupted(self):
        build(self)
        flags.stop = True                   # SIGINT while the trainer starts
    monkeypatch.setattr(loop.Trainer, "build", interrupted)
    assert entry.train(str(tmp_path / "new" / "run"), "tiny", 2, flags=flags, device="cpu") == 0
    assert os.listdir(tmp_path) == []
    existing = tmp_path / "kept"
    existing.mkdir()
    flags.stop = when == "before the lock"
    assert entry.train(str(existing), "tiny", 2, flags=flags, device="cpu") == 0
    assert existing.is_dir()                # not ours to remove
