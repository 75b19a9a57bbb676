"""Every write of a generation into a directory honours the run's writer lock (spec/RUN.md §4):
convert, fork and import are refused while a writer holds the run, naming the holder, and
leave no ``.lock`` behind where there was none; a convert whose destination name disagrees with
the checkpoint's step is a usage problem (exit 2)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckptfmt.errors import RunLockedError
from ckptfmt.run import RunLock
from ckptfmt.run.ops import fork
from conftest import cli, make

HOLD = ("import sys, time\nfrom ckptfmt.run import RunLock\n"
        "lock = RunLock(sys.argv[1], purpose='trainer').acquire()\nprint('HELD', flush=True)\ntime.sleep(60)\n")


def _dir(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def held(tmp_path):
    """A run whose writer lock another live process holds (as a running `ckptfmt train`)."""
    run = tmp_path / "run"
    run.mkdir()
    make(run, 1)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "HELD"
    yield run, proc.pid
    proc.kill()
    proc.wait()


def test_convert_into_a_locked_run_is_refused_naming_the_holder(held, tmp_path):
    run, pid = held
    src = make(_dir(tmp_path / "other"), 3)
    before = sorted(os.listdir(run))
    result = cli("convert", str(src), str(run / "step_000003.bin"))
    assert result.returncode == 2, result.stderr
    line, = result.stderr.splitlines()
    assert line.startswith(f"ckptfmt: {run}: locked by trainer pid {pid}"), line
    assert sorted(os.listdir(run)) == before


def test_fork_into_a_locked_run_is_refused_naming_the_holder(held, tmp_path):
    run, pid = held
    dest = tmp_path / "dest"
    dest.mkdir()
    with RunLock(dest, purpose="trainer"):
        with pytest.raises(RunLockedError, match="locked by trainer pid"):
            fork(run, 1, dest)
        assert os.listdir(dest) == [".lock"]


def test_a_fork_holds_the_lock_of_its_destination_and_leaves_no_lock_file(tmp_path, monkeypatch):
    import ckptfmt.run.ops as ops
    src = tmp_path / "src"
    src.mkdir()
    make(src, 1)
    seen = []
    copy = ops._fork_into

    def spying(run, gen, staging):
        with pytest.raises(RunLockedError, match="locked by fork"):
            RunLock(staging).acquire()            # a writer starting meanwhile is refused
        seen.append(True)
        return copy(run, gen, staging)
    monkeypatch.setattr(ops, "_fork_into", spying)
    fork(src, 1, tmp_path / "forked")
    assert seen and ".lock" not in os.listdir(tmp_path / "forked")
    RunLock(tmp_path / "forked").acquire().release()      # taken at once afterwards


def test_convert_into_a_plain_directory_leaves_no_lock_file(tmp_path):
    src = make(_dir(tmp_path / "src"), 1)
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("other.safetensors", "step_000001.bin"):
        result = cli("convert", str(src), str(plain / name))
        assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(plain)) == ["other.safetensors", "step_000001.bin", "step_000001.json"]


def test_convert_into_a_step_name_of_another_step_is_a_usage_error(tmp_path):
    src = make(_dir(tmp_path / "src"), 3)
    run = tmp_path / "run"
    run.mkdir()
    result = cli("convert", str(src), str(run / "step_000300.bin"))
    assert result.returncode == 2, result.stderr
    assert "name says step 300, the header would say 3: expected step_000003.bin" in result.stderr
    assert os.listdir(run) == []


def test_a_write_of_a_generation_takes_a_lock_left_unwritten_and_keeps_it_so(tmp_path):
    """A run whose first writer refused it (its .lock says never written) stays so after a
    convert writes into it: the next trainer is still its first writer (RUN.md §2.2)."""
    from ckptfmt.run.lock import UNWRITTEN, first_writer, writing_into
    run = tmp_path / "run"
    run.mkdir()
    lock = RunLock(run, writes_generations=False).acquire()
    lock.release()
    with writing_into(run, "convert"):
        pass
    assert (run / ".lock").read_text() == __import__("json").dumps(UNWRITTEN)
    with RunLock(run):
        assert first_writer(run)


@pytest.mark.parametrize("weights_only", [False, True])
def test_an_export_holds_the_lock_of_its_destination_and_leaves_no_lock_file(tmp_path, weights_only):
    from ckptfmt.tools.export import export
    src = _dir(tmp_path / "src")
    make(src, 1)
    seen = []

    def trainer_starting(dest):
        with pytest.raises(RunLockedError, match="locked by export pid"):
            RunLock(dest).acquire()                # a writer starting on DEST meanwhile is refused
        seen.append(sorted(os.listdir(dest)))
    export(str(src), str(tmp_path / "out"), tamper=trainer_starting, weights_only=weights_only)
    assert seen and ".lock" in seen[0]
    assert ".lock" not in os.listdir(tmp_path / "out")
    RunLock(tmp_path / "out").acquire().release()


def test_an_export_into_a_locked_destination_is_refused_and_leaves_it(tmp_path):
    from ckptfmt.tools.export import export
    src, dest = _dir(tmp_path / "src"), tmp_path / "out"
    make(src, 1)
    with RunLock(_dir(dest), purpose="trainer"):
        with pytest.raises(RunLockedError, match=f"locked by trainer pid {os.getpid()}"):
            export(str(src), str(dest))
        assert os.listdir(dest) == [".lock"]


def test_a_sharded_split_into_a_locked_run_is_refused_naming_the_holder(held, tmp_path):
    run, pid = held
    src = make(_dir(tmp_path / "other"), 3)
    before = sorted(os.listdir(run))
    result = cli("convert", str(src), str(run), "--to", "shards")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"ckptfmt: {run}: locked by trainer pid {pid}"), result.stderr
    assert sorted(os.listdir(run)) == before
