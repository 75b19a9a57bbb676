"""Crash and error at every filesystem operation of a save + history append + prune
(RELIABILITY.md items 1, 3, 20, 24) and stratified SIGKILL of a writer (item 2)."""
import errno
import os
import random
import shutil
import signal
import subprocess

import pytest

import ckptfmt
from ckptfmt import fsio
from ckptfmt.run import history as hist
from ckptfmt.errors import HistoryWriteError, SaveError
from ckptfmt.run import Run
from faults import arrays, base_run, clone, expected_digest, scale, writer_argv

N = 2000


def assert_valid_old_or_new(run_dir, old, new):
    """The loader returns the previous or the new generation, bit-exact; never a torn file."""
    gen = Run(run_dir).latest(deep=True)
    assert gen is not None and gen.step in (old, new)
    assert ckptfmt.open(gen.bin, verify=True).fingerprint() == expected_digest(gen.step, N)
    for g in Run(run_dir).generations():
        if g.committed:
            assert ckptfmt.open(g.bin, verify=True).fingerprint() == expected_digest(g.step, N)
    loss = hist.read(run_dir / ".loss.json")
    assert not loss.problems


def count_ops(tmp_path):
    run = clone(base_run(tmp_path / "base", N), tmp_path / "count")
    out = subprocess.run(writer_argv(run, 2, 1, N, "count"), capture_output=True, text=True, check=True).stdout
    return int(out.split("CALLS")[1])


def test_crash_at_every_operation(tmp_path):
    base = base_run(tmp_path / "base", N)
    total = count_ops(tmp_path)
    assert total >= 15            # bin: open, writes, fsync, close, rename, dir; manifest; history; prune
    print(f"FIGURE crash at every operation: {total} operations, {total} crashes, all recovered")
    for k in range(1, total + 1):
        run = clone(base, tmp_path / f"k{k}")
        proc = subprocess.run(writer_argv(run, 2, 1, N, "crash", str(k)), capture_output=True, text=True)
        assert proc.returncode == 137, (k, proc.stderr)
        assert_valid_old_or_new(run, 1, 2)
        Run(run).sweep_temps()
        assert not list(run.glob(".ckptfmt-tmp*"))
        shutil.rmtree(run)


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC, errno.EROFS])
def test_error_at_every_operation(tmp_path, code, monkeypatch):
    base = base_run(tmp_path / "base", N)
    total = count_ops(tmp_path)
    for k in range(1, total + 1):
        run = clone(base, tmp_path / f"e{code}-{k}")
        before = {p.name: p.read_bytes() for p in run.iterdir() if p.name.startswith("step_")}
        calls = [0]

        def hook(op, path):
            calls[0] += 1
            if calls[0] == k:
                raise OSError(code, os.strerror(code))
        monkeypatch.setattr(fsio, "hook", hook)
        r = Run(run)
        committed = False
        try:
            r.commit(2, *arrays(N, 2), manifest={})
            committed = True
            r.history.append({"step": 2, "loss": 0.5})
            r.history.sync()
            r.gc(keep_last=2)
        except SaveError as exc:
            assert exc.__cause__ is not None or "fsync" in str(exc) or os.strerror(code) in str(exc)
        except HistoryWriteError as exc:      # history append/sync: named, with the OS error's errno
            assert committed and exc.errno == code
        finally:
            monkeypatch.setattr(fsio, "hook", None)
            r.history.close()
        if not committed:           # no success after a failed write/fsync/rename, no prune
            assert {p.name: p.read_bytes() for p in run.iterdir() if p.name.startswith("step_")
                    and p.name.startswith("step_000001")} == {k2: v for k2, v in before.items()}
        assert_valid_old_or_new(run, 1, 2)
        shutil.rmtree(run)


PHASES = ["write:.ckptfmt-tmp.step_", "rename:step_0", "fsync_dir:", "open:.ckptfmt-tmp.step_", "unlink:step_"]


def test_stratified_sigkill_of_a_writer(tmp_path):
    """Kills aimed at each phase of the save (before the .bin rename, between the two commits,
    after the manifest commit, during pruning): 0 torn files accepted, never 'no valid
    generation', and one sweep leaves 0 orphan temp files."""
    kills = int(os.environ.get("RELIABILITY_KILLS", scale(50, 1000)))
    n = scale(N, 12_500_000)       # long tier: 150 MB files
    run = base_run(tmp_path / "run", n)
    rng = random.Random(1)
    step, orphans = 2, 0
    for i in range(kills):
        phase = PHASES[i % len(PHASES)]
        proc = subprocess.Popen(writer_argv(run, step, 3, n, "phase", phase), stdout=subprocess.PIPE, text=True)
        hits = rng.randint(1, 3)
        for line in proc.stdout:
            if line.startswith("PHASE"):
                hits -= 1
                if hits == 0:
                    proc.send_signal(signal.SIGKILL)
                    break
        proc.wait()
        proc.stdout.close()
        gen = Run(run).latest(deep=True)
        assert gen is not None
        with ckptfmt.open(gen.bin, verify=True) as ck:
            assert ck.fingerprint() == expected_digest(gen.step, n)
        step = max(step, gen.step + 1, *(g.step + 1 for g in Run(run).generations()))
        orphans += len(list(run.glob(".ckptfmt-tmp*")))
        Run(run).sweep_temps()                 # keep the disk bounded at 150 MB files:
        for old in Run(run).generations():     # uncommitted leftovers older than the newest valid
            if not old.committed and old.step < gen.step and old.bin is not None:
                old.bin.unlink()
    print(f"FIGURE SIGKILL: {kills} kills over {len(PHASES)} phases of {n * 12 / 1e3:.0f} KB files, 0 torn accepted, "
          f"0 without a valid generation, {orphans} orphan temps, each swept after its kill")
    assert not list(run.glob(".ckptfmt-tmp*"))
    assert not hist.read(run / ".loss.json").problems


def test_strace_injected_errors_are_typed(tmp_path):
    if not shutil.which("strace"):
        pytest.skip("strace is not installed")
    import sys
    code = ("import sys, numpy as np, ckptfmt\n"
            "from ckptfmt.errors import SaveError\n"
            "try:\n"
            f"    ckptfmt.save({str(tmp_path)!r} + '/step_000001.bin', 1, *(np.ones(1000, '<f4'),) * 3)\n"
            "except SaveError as e:\n"
            "    print('TYPED', e); sys.exit(3)\n")
    for syscall, err in (("fsync", "EIO"), ("write", "ENOSPC"), ("rename", "EIO"), ("fsync", "ENOSPC")):
        argv = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={syscall}",
                "-e", f"inject={syscall}:error={err}:when=1", sys.executable, "-c", code]
        proc = subprocess.run(argv, capture_output=True, text=True)
        assert proc.returncode == 3 and "TYPED" in proc.stdout, (syscall, proc.stdout, proc.stderr)
        assert not list(tmp_path.glob(".ckptfmt-tmp*")) and not (tmp_path / "step_000001.json").exists()
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("calls", ["link,linkat", "rename,renameat,renameat2"])
def test_strace_injected_sigkill_at_rename_leaves_old_or_new(tmp_path, calls):
    """strace kills the writer at the .bin's publish (a link: a save that may not overwrite
    publishes by link, FORMAT §5.3) or at the manifest's (its first rename)."""
    if not shutil.which("strace"):
        pytest.skip("strace is not installed")
    run = base_run(tmp_path / "run", N)
    argv = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=rename,renameat,renameat2,link,linkat",
            "-e", f"inject={calls}:signal=SIGKILL:when=1"] + writer_argv(run, 2, 1, N)
    proc = subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode != 0
    assert_valid_old_or_new(run, 1, 2)
    gens = {g.step: g.committed for g in Run(run).generations()}
    assert gens[1] and not gens.get(2, False)       # killed before the manifest's rename: not committed
