"""Read leases and "save in progress" (spec/RUN.md §5.3, §4), without a trainer: retention keeps
what a reader leased, a dead reader's lease is swept, and a live writer's unfinished save is not
reported as a crash leftover."""
import json
import os
import subprocess
import sys
import threading
import time

from ckptfmt.run import LEASES, ReadLease, Run, RunLock, fork, ls_run
from ckptfmt.tools.export import export
from ckptfmt.tools.validate import validate_run
from conftest import cli, make, seed_write, arrays


def steps_on_disk(run):
    return [g.step for g in Run(run).generations() if g.committed]


def test_gc_keeps_leased_generations_until_the_lease_ends(tmp_path):
    for s in (1, 2, 3, 4):
        make(tmp_path, s, seed=s)
    lease = ReadLease(tmp_path, purpose="test").acquire()
    assert lease.held and lease.steps == [1, 2, 3, 4]
    assert [g.step for g in lease.listing.generations] == [1, 2, 3, 4]
    assert Run(tmp_path).gc(keep_last=1) == []               # every one of them is leased
    assert steps_on_disk(tmp_path) == [1, 2, 3, 4]
    lease.narrow([2, 99])                                     # a lease only shrinks
    assert lease.steps == [2]
    assert json.loads(lease.path.read_text())["steps"] == [2]
    assert Run(tmp_path).gc(keep_last=1) == [1, 3]
    lease.release()
    assert not lease.held and not (tmp_path / LEASES).exists()   # a reader leaves no trace
    assert Run(tmp_path).gc(keep_last=1) == [2]
    assert steps_on_disk(tmp_path) == [4]


def test_a_dry_run_reports_what_the_leases_allow(tmp_path):
    for s in (1, 2, 3):
        make(tmp_path, s, seed=s)
    with ReadLease(tmp_path) as lease:
        lease.narrow([1])
        assert Run(tmp_path).gc(keep_last=1, dry_run=True) == [2]
    assert steps_on_disk(tmp_path) == [1, 2, 3]


def test_a_dead_readers_lease_is_swept_and_not_honoured(tmp_path):
    for s in (1, 2, 3):
        make(tmp_path, s, seed=s)
    code = ("import os, sys; from ckptfmt.run import ReadLease; "
            "ReadLease(sys.argv[1], purpose='killed reader').acquire(); os._exit(9)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=60)
    assert proc.returncode == 9
    stale = list((tmp_path / LEASES).iterdir())
    assert len(stale) == 1 and json.loads(stale[0].read_text())["steps"] == [1, 2, 3]
    assert Run(tmp_path).gc(keep_last=1) == [1, 2]            # the kernel dropped its flock
    assert not (tmp_path / LEASES).exists()


def test_retention_and_a_new_lease_exclude_each_other(tmp_path):
    """A reader never lists a generation that gc has decided to delete but not yet deleted."""
    from ckptfmt.run.lease import honoured
    make(tmp_path, 1)
    got = {}

    def reader():
        with ReadLease(tmp_path) as lease:
            got["steps"] = lease.steps

    with honoured(tmp_path) as leased:
        assert leased == set()
        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and "steps" not in got            # waiting for retention to finish
    t.join(10)
    assert got["steps"] == [1]


def test_a_reader_that_cannot_lease_says_so_and_still_reads(tmp_path):
    for s in (1, 2):
        make(tmp_path, s, seed=s)
    (tmp_path / LEASES).write_text("not a directory")        # as a read-only run would refuse
    with ReadLease(tmp_path) as lease:
        assert not lease.held and "cannot write a read lease" in lease.problem
        assert [g.step for g in lease.listing.generations] == [1, 2]
    doc = export(str(tmp_path), str(tmp_path.parent / "dest"))
    assert doc["steps"] == [2]
    assert "lease_problem" in ls_run(tmp_path)
    assert "cannot write a read lease" in cli("ls", str(tmp_path)).stdout
    assert Run(tmp_path).gc(keep_last=1) == [1]


def test_ls_names_other_readers_leases(tmp_path):
    make(tmp_path, 1)
    with ReadLease(tmp_path, purpose="export") as lease:
        lease.narrow([1])
        d = ls_run(tmp_path)
        assert [(r["purpose"], r["pid"], r["steps"]) for r in d["leases"]] == [("export", os.getpid(), [1])]
        out = cli("ls", str(tmp_path))
        assert out.returncode == 0 and f"read lease: export pid {os.getpid()} holds steps [1]" in out.stdout
    assert ls_run(tmp_path)["leases"] == []


def test_fork_leases_the_generation_it_copies(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for s in (1, 2):
        make(run, s, seed=s)
    seen = {}
    from ckptfmt import fsio

    def during_copy(op, path):
        if "seen" not in seen and "fork.child." in path:      # the fork is staged beside DEST
            seen["seen"] = True
            seen["gc"] = Run(run).gc(keep_last=1)              # what a trainer's retention does now
    fsio.hook = during_copy
    try:
        out = fork(run, 1, tmp_path / "child")
    finally:
        fsio.hook = None
    assert seen["gc"] == [] and out["step"] == 1
    assert validate_run(tmp_path / "child").status == "verified"
    assert Run(run).gc(keep_last=1) == [1]


# ---------------------------------------------------------------- save in progress
def test_the_lock_holders_temp_file_is_a_save_in_progress(tmp_path):
    make(tmp_path, 1)
    mine = tmp_path / f".ckptfmt-tmp.step_000002.bin.{os.getpid()}.ab12"
    other = tmp_path / ".ckptfmt-tmp.step_000002.json.1.cd34"       # pid 1 never wrote here
    mine.write_bytes(b"x" * 10)
    other.write_bytes(b"{")
    with RunLock(tmp_path, purpose="trainer"):
        r = validate_run(tmp_path)
        notes = [f for f in r.findings if f.code == "save_in_progress"]
        assert r.ok and len(notes) == 1 and notes[0].level == "info" and str(mine) in notes[0].message
        assert [f.message.split(":")[0] for f in r.findings if f.code == "leftover_temp"] == [str(other)]
        d = ls_run(tmp_path)
        assert d["in_progress"] == [str(mine)] and d["leftovers"] == [str(other)]
        out = cli("validate", str(tmp_path))
        assert out.returncode == 0, out.stderr
        assert f"info: {mine}: save in progress" in out.stdout
        assert "save in progress: " + str(mine) in cli("ls", str(tmp_path)).stdout
    r = validate_run(tmp_path)                           # no writer: both are crash leftovers
    assert {f.code for f in r.findings} >= {"leftover_temp"} and not any(
        f.code == "save_in_progress" for f in r.findings)
    assert sorted(ls_run(tmp_path)["leftovers"]) == sorted([str(mine), str(other)])


def test_an_uncommitted_bin_written_under_the_live_lock_is_a_save_in_progress(tmp_path):
    make(tmp_path, 1)
    old = tmp_path / "step_000002.bin"
    seed_write(old, 2, *arrays(10))
    os.utime(old, (time.time() - 3600, time.time() - 3600))   # before the writer took the lock
    with RunLock(tmp_path, purpose="trainer"):
        seed_write(tmp_path / "step_000003.bin", 3, *arrays(10))   # the writer's .bin, no manifest yet
        r = validate_run(tmp_path)
        rows = {g["step"]: g["status"] for g in r.details["generations"]}
        assert r.ok and rows == {1: "verified", 2: "uncommitted", 3: "save in progress"}
        assert [f.code for f in r.findings if f.level != "info"] == ["uncommitted"]
        ls_rows = {g["step"]: g["status"] for g in ls_run(tmp_path, deep=True)["generations"]}
        assert ls_rows == {1: "verified", 2: "not committed: no manifest", 3: "save in progress"}
    rows = {g["step"]: g["status"] for g in validate_run(tmp_path).details["generations"]}
    assert rows == {1: "verified", 2: "uncommitted", 3: "uncommitted"}


def test_a_lock_whose_since_is_not_a_number_is_read_as_saying_nothing(tmp_path):
    """A hand-edited .lock ({"since": "yesterday"}) made ls and validate a TypeError traceback
    while the lock was held: an entry is then a save in progress, as when it has no "since"."""
    from ckptfmt.run.lock import save_in_progress
    entry = tmp_path / "step_000003.bin"
    entry.write_bytes(b"x")
    for since in ("yesterday", None, True, [1]):
        assert save_in_progress(entry, {"pid": 1, "since": since}) is True
    assert save_in_progress(entry, {"pid": 1, "since": time.time() + 3600}) is False


def test_a_first_save_in_progress_is_not_a_bare_run_nor_damage(tmp_path):
    with RunLock(tmp_path, purpose="trainer"):
        seed_write(tmp_path / "step_000003.bin", 3, *arrays(10))
        r = validate_run(tmp_path)
        assert r.ok and not any(f.code == "bare_run" for f in r.findings)
        assert r.details["generations"] == [{"step": 3, "status": "save in progress"}]


def test_a_history_line_being_appended_is_not_torn_while_the_writer_lives(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    make(run, 1)
    complete = b'{"step": 1, "loss": 2.5}\n'
    (run / ".loss.json").write_bytes(complete + b'{"step": 2, "lo')     # an append in progress
    with RunLock(run, purpose="trainer"):
        r = validate_run(run)
        assert r.ok and not any(f.code == "history_torn" for f in r.findings)
        assert r.details["history_records"] == 1
        export(str(run), str(tmp_path / "dest"))
        assert (tmp_path / "dest" / ".loss.json").read_bytes() == complete
    assert any(f.code == "history_torn" for f in validate_run(run).findings)   # no writer: torn
    export(str(run), str(tmp_path / "dest2"))                                 # copied as it is
    assert (tmp_path / "dest2" / ".loss.json").read_bytes() == (run / ".loss.json").read_bytes()


def test_retention_never_sweeps_what_is_not_its_own_lease_file(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "mine"
    run.mkdir()
    elsewhere.mkdir()
    make(run, 1)
    precious = [elsewhere / "notes.json", elsewhere / "123.abcdef01.json"]
    for p in precious:
        p.write_text("{}")
    (run / LEASES).symlink_to(elsewhere)
    with ReadLease(run) as lease:
        assert not lease.held and "not a directory of its own" in lease.problem
    assert Run(run).gc(keep_last=1) == []
    assert all(p.read_text() == "{}" for p in precious) and (run / LEASES).is_symlink()
    (run / LEASES).unlink()
    (run / LEASES).mkdir()
    (run / LEASES / "notes.json").write_text("{}")          # a name ReadLease never writes
    Run(run).gc(keep_last=1)
    assert (run / LEASES / "notes.json").read_text() == "{}"
