"""The RAM tier over its life (spec/RUN.md §13.10): a run that closes leaves in shared memory
only what its durable generations do not cover; ``gc RUN`` and ``ls RUN`` see the tier; tiers
whose run is gone are listed and removed by ``ckptfmt ram``; the root is per user, and tiers an
earlier version left in the shared root are still resumed. Real processes killed with SIGKILL,
the tier in the test's tmp dir (CKPTFMT_MEMORY_DIR) except where the default root is the point."""
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from ckptfmt import format as fmt  # noqa: E402
from ckptfmt.run import Run, tiers  # noqa: E402
from ckptfmt.run import ramdirs  # noqa: E402

from conftest import cli  # noqa: E402
import warm  # noqa: E402

PY = sys.executable

# the manager in a plain loop, durable every 50 steps, RAM every 5 (ram_loop.py beside this file)
LOOP = Path(__file__).with_name("ram_loop.py")


def loop(tmp_path, run, memory, *, kill_at=0, nan_at=0, end=120):
    proc = warm.run([PY, str(LOOP), str(run), str(kill_at), str(nan_at), "5", "sync", str(end)],
                    env={**os.environ, tiers.MEMORY_ENV: str(memory)},
                    capture_output=True, text=True, timeout=120)
    assert proc.returncode == (-signal.SIGKILL if kill_at else 0), proc.stderr
    return proc


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """The RAM tiers of this test under its tmp dir (CKPTFMT_MEMORY_DIR), here and in its children."""
    monkeypatch.setenv(tiers.MEMORY_ENV, str(tmp_path / "shm"))


def ram_steps(where: Path) -> list:
    return [g.step for g in Run(where).generations()] if where.is_dir() else []


def ram(memory, *args):
    return cli("ram", *args, env={tiers.MEMORY_ENV: str(memory)})


def age(where: Path, seconds: float = ramdirs.GRACE_S + 60) -> None:
    """Everything in the tier ``where`` last changed ``seconds`` ago."""
    then = time.time() - seconds
    for path in [*where.rglob("*"), where]:
        os.utime(path, (then, then), follow_symlinks=False)


def test_a_run_that_closes_removes_the_ram_generations_its_durable_step_covers(tmp_path):
    run, memory = tmp_path / "run", tmp_path / "shm"
    loop(tmp_path, run, memory, kill_at=73)
    where = tiers.memory_dir(run)
    assert ram_steps(where) == [65, 70]
    done = loop(tmp_path, run, memory, end=98)            # resumes 70 from RAM, closes with 98 durable
    assert "START 70 memory" in done.stdout
    assert "removed RAM generations [90, 95]: the durable step 98 covers them" in done.stdout
    assert not where.exists() and not list(memory.iterdir())          # nothing left in shared memory
    assert [g.step for g in Run(run).generations()] == [50, 98]


def test_a_diverged_durable_step_does_not_cover_the_finite_ram_generations_before_it(tmp_path):
    run, memory = tmp_path / "run", tmp_path / "shm"
    done = loop(tmp_path, run, memory, nan_at=93, end=98)          # 98's weights hold a NaN
    assert "removed RAM generations" not in done.stdout
    assert ram_steps(tiers.memory_dir(run)) == [90, 95]           # 90 is what a restore takes now


def test_gc_and_ls_see_the_ram_tier_and_gc_removes_what_the_durable_tier_covers(tmp_path):
    run, memory = tmp_path / "run", tmp_path / "shm"
    loop(tmp_path, run, memory, kill_at=73)
    env = {tiers.MEMORY_ENV: str(memory)}
    temp = tiers.memory_dir(run) / (fmt.TEMP_PREFIX + "step_000075.bin")     # a RAM save killed midway
    temp.write_bytes(b"half")
    kept = json.loads(cli("gc", str(run), "--keep-last", "2", "--json", env=env).stdout)
    assert kept["tiers"]["memory"] == {"dir": str(tiers.memory_dir(run)), "covered_by": 50, "deleted": [],
                                       "kept": [65, 70], "swept_temps": [str(temp)]}   # a resume takes 70
    assert not temp.exists()
    loop(tmp_path, run, memory, kill_at=103)                       # durable 100, RAM 90 and 95
    where = tiers.memory_dir(run)
    assert ram_steps(where) == [90, 95]
    listed = json.loads(cli("ls", str(run), "--json", env=env).stdout)
    assert [g["step"] for g in listed["tiers"]["memory"]["generations"]] == ram_steps(where)
    dry = cli("gc", str(run), "--keep-last", "2", "--dry-run", env=env)
    assert dry.returncode == 0 and f"RAM tier {where}: would delete steps {ram_steps(where)}" in dry.stdout
    assert ram_steps(where)
    done = cli("gc", str(run), "--keep-last", "2", env=env)
    assert done.returncode == 0, done.stderr
    assert "the newest valid durable generation, 100, covers them" in done.stdout
    assert not where.exists()
    again = loop(tmp_path, run, memory, end=120)                   # the run goes on from durable 100
    assert "START 100 disk" in again.stdout


def test_ram_lists_orphaned_tiers_and_removes_only_them(tmp_path):
    memory = tmp_path / "shm"
    loop(tmp_path, tmp_path / "live", memory, kill_at=33)
    loop(tmp_path, tmp_path / "gone", memory, kill_at=33)
    loop(tmp_path, tmp_path / "again", memory, kill_at=33)
    live, gone, old = (tiers.memory_dir(tmp_path / n) for n in ("live", "gone", "again"))
    shutil.rmtree(tmp_path / "gone")                               # the run deleted: its tier orphaned
    shutil.rmtree(tmp_path / "again")
    loop(tmp_path, tmp_path / "again", memory, kill_at=33)         # made again: a new ID, a new tier
    listed = json.loads(ram(memory, "--json").stdout)
    status = {t["dir"]: (t["status"], t["steps"]) for t in listed["tiers"]}
    assert status == {str(live): ("in use", [25, 30]), str(gone): ("orphaned", [25, 30]),
                      str(old): ("orphaned", [25, 30]), str(tiers.memory_dir(tmp_path / "again")): ("in use", [25, 30])}
    reasons = {t["dir"]: t["why"] for t in listed["tiers"]}
    assert reasons[str(gone)] == f"its run {tmp_path / 'gone'} no longer exists"
    assert reasons[str(old)] == f"its run {tmp_path / 'again'} has another ID now (deleted and made again)"
    young = ram(memory, "--remove-orphans")                        # killed seconds ago: it may come back
    assert young.returncode == 0 and gone.exists() and old.exists()
    assert f"kept {gone}: changed within the last 60 minutes" in young.stdout
    for where in (live, gone, old):
        age(where)
    dry = ram(memory, "--remove-orphans", "--dry-run")
    assert dry.returncode == 0 and gone.exists() and old.exists()
    assert f"would remove {gone}" in dry.stdout and f"would remove {old}" in dry.stdout
    done = ram(memory, "--remove-orphans")
    assert done.returncode == 0, done.stderr
    assert not gone.exists() and not old.exists() and live.exists() and tiers.memory_dir(tmp_path / "again").exists()
    again = loop(tmp_path, tmp_path / "live", memory)             # the live one still resumes from RAM
    assert "START 30 memory" in again.stdout


def test_a_tier_of_unknown_run_is_removed_only_by_name_and_one_in_use_never(tmp_path):
    memory = tmp_path / "shm"
    loop(tmp_path, tmp_path / "run", memory, kill_at=33)
    live = tiers.memory_dir(tmp_path / "run")
    unknown = memory / ("ab" * 16)                                  # what an earlier version left
    shutil.copytree(live, unknown)
    (unknown / ramdirs.OWNER).unlink()
    assert ram(memory, "--remove-orphans").returncode == 0 and unknown.exists()
    listed = {t["run_id"]: t for t in json.loads(ram(memory, "--json").stdout)["tiers"]}
    assert listed["ab" * 16]["status"] == "unknown run" and listed["ab" * 16]["run"] is None
    refused = ram(memory, "--remove", "ab" * 16, "--remove", live.name)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert f"the RAM tier of {tmp_path / 'run'}: not removed" in refused.stderr
    assert unknown.exists() and live.exists()                       # refused whole: nothing removed
    missing = ram(memory, "--remove", "cd" * 16)
    assert missing.returncode == 2 and f"no RAM tier with ID {'cd' * 16!r}" in missing.stderr
    assert ram(memory, "--remove", "ab" * 16).returncode == 0
    assert not unknown.exists() and live.exists()


def test_a_tier_an_earlier_version_left_in_the_shared_root_is_resumed(tmp_path, monkeypatch):
    """Earlier versions kept every user's tiers in /dev/shm/ckptfmt: a run killed before an
    upgrade resumes its RAM generation after it, and closes the tier there."""
    shared = tmp_path / "devshm"
    monkeypatch.setattr(tiers, "SHARED_MEMORY", shared)
    monkeypatch.setattr(tiers, "LEGACY_MEMORY_ROOT", shared / "ckptfmt")
    monkeypatch.delenv(tiers.MEMORY_ENV, raising=False)
    run = tmp_path / "run"
    loop(tmp_path, run, shared / "ckptfmt", kill_at=73)            # written where the old default was
    (tiers.memory_dir(run) / ramdirs.OWNER).unlink()               # which kept no record of its run
    assert tiers.memory_root() == shared / f"ckptfmt-{os.getuid()}"
    assert tiers.memory_dir(run).parent == shared / "ckptfmt"
    assert ram_steps(tiers.memory_dir(run)) == [65, 70]
    from ckptfmt.torch import CheckpointManager
    import torch
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(run, model, opt, generators={"data": torch.Generator()}, every=50, memory_every=5,
                           handle_signals=False, log=lambda m: None) as mgr:
        assert (mgr.restore(), mgr.restored_tier) == (70, "memory")
        mgr.close(70)
    assert not (shared / "ckptfmt" / tiers.run_id(run)).exists()


def short_run(run, steps=33) -> list:
    """A manager trains ``steps`` steps in this process with a RAM save every 5 and closes
    without a durable step (the RAM generations stay); what its log said."""
    import torch
    from ckptfmt.torch import CheckpointManager
    said = []
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(run, model, opt, every=50, memory_every=5, handle_signals=False, log=said.append) as mgr:
        for step in range(1, steps + 1):
            mgr.step(step, loss=1.0)
    return said


@pytest.mark.skipif(os.getuid() != 0, reason="switching to a second user needs root")
def test_a_second_users_run_is_not_refused_by_the_first_users_ram_tier(tmp_path, monkeypatch):
    """Two users on one machine, the default root: each gets a root of its own, mode 0700, so
    the second user's RAM saves are not refused by the directory the first user made (one
    shared root, made by the first user, refused every other user's tier)."""
    import tempfile
    monkeypatch.delenv(tiers.MEMORY_ENV, raising=False)
    nobody = 65534
    shared = Path(tempfile.mkdtemp(prefix="ckptfmt-second-user-"))   # directories both users reach
    os.chmod(shared, 0o1777)                                          # as /dev/shm is
    monkeypatch.setattr(tiers, "SHARED_MEMORY", shared / "shm")
    (shared / "shm").mkdir(mode=0o1777)
    os.chmod(shared / "shm", 0o1777)
    theirs_root = shared / "shm" / f"ckptfmt-{nobody}"
    assert short_run(tmp_path / "first") == []
    mine = tiers.memory_dir(tmp_path / "first")
    try:
        assert mine.parent == shared / "shm" / f"ckptfmt-{os.getuid()}" and ram_steps(mine) == [25, 30]
        assert mine.parent.stat().st_mode & 0o777 == 0o700
        pid = os.fork()
        if pid == 0:                       # the second user: this process's modules, its own uid
            code = 1
            try:
                os.setgid(nobody)
                os.setuid(nobody)
                (shared / "said.json").write_text(json.dumps(short_run(shared / "run")))
                code = 0
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        assert json.loads((shared / "said.json").read_text()) == []      # no "skipped the save"
        theirs = theirs_root / tiers.run_id(shared / "run")
        assert ram_steps(theirs) == [25, 30] and theirs.stat().st_uid == nobody
        assert theirs_root.stat().st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_run_moved_after_a_kill_takes_its_tier_back_and_ram_never_removes_it(tmp_path):
    """A run directory moved between a kill and its restart: until the restart its tier's record
    names the old path (orphaned), but one killed within the hour is kept by --remove-orphans;
    the restart at the new path resumes from RAM and records the new path, so an hour later the
    tier is still the run's."""
    memory = tmp_path / "shm"
    loop(tmp_path, tmp_path / "a", memory, kill_at=73)            # RAM 65 and 70
    where = tiers.memory_dir(tmp_path / "a")
    (tmp_path / "a").rename(tmp_path / "b")
    listed = {t["dir"]: t for t in json.loads(ram(memory, "--json").stdout)["tiers"]}
    assert listed[str(where)]["status"] == "orphaned"
    assert ram(memory, "--remove-orphans").returncode == 0 and ram_steps(where) == [65, 70]
    back = loop(tmp_path, tmp_path / "b", memory, kill_at=72)      # killed again before its next RAM save
    assert "START 70 memory" in back.stdout
    age(where)
    listed = {t["dir"]: t for t in json.loads(ram(memory, "--json").stdout)["tiers"]}
    assert (listed[str(where)]["status"], listed[str(where)]["why"]) == ("in use", f"the RAM tier of {tmp_path / 'b'}")
    assert ram(memory, "--remove-orphans").returncode == 0 and ram_steps(where) == [65, 70]
    assert "START 70 memory" in loop(tmp_path, tmp_path / "b", memory).stdout


def test_a_tier_a_live_process_saves_to_is_never_removed(tmp_path):
    """The saving process holds its tier (a shared flock) while it lives: even with a record
    that names a run gone and nothing changed for hours, ``ram`` neither removes it as an orphan
    nor by name; once the manager closes, the orphan goes."""
    import torch
    from ckptfmt.torch import CheckpointManager
    memory = tmp_path / "shm"
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = CheckpointManager(tmp_path / "run", model, opt, every=50, memory_every=5, handle_signals=False,
                            log=lambda m: None)
    try:
        for step in range(1, 13):
            mgr.step(step, loss=1.0)
        where = tiers.memory_dir(tmp_path / "run")
        (where / ramdirs.OWNER).write_text(json.dumps({"run": str(tmp_path / "gone"), "id": where.name}))
        age(where)
        row = json.loads(ram(memory, "--json").stdout)["tiers"][0]
        assert (row["dir"], row["status"]) == (str(where), "in use")
        assert row["why"] == f"a live process saves RAM generations there (its run: {tmp_path / 'gone'})"
        assert ram(memory, "--remove-orphans").returncode == 0 and ram_steps(where) == [5, 10]
        refused = ram(memory, "--remove", where.name)
        assert refused.returncode == 2 and "a live process saves RAM generations there" in refused.stderr
        assert ram_steps(where) == [5, 10]
    finally:
        mgr.close()                                                # no durable step: the RAM ones stay
    again = CheckpointManager(tmp_path / "run", model, opt, every=50, memory_every=5, handle_signals=False,
                              log=lambda m: None)
    try:                                                           # a restore holds the tier it reads
        assert (again.restore(), again.restored_tier) == (10, "memory")
        age(where)
        assert "a live process saves RAM generations there" in ram(memory, "--remove", where.name).stderr
    finally:
        again.close()
    assert ram_steps(where) == [5, 10]
    (where / ramdirs.OWNER).write_text(json.dumps({"run": str(tmp_path / "gone"), "id": where.name}))
    age(where)                                                     # the restore claimed it: stale again
    done = ram(memory, "--remove-orphans")
    assert done.returncode == 0 and f"removed {where}" in done.stdout and not where.exists()


@pytest.mark.parametrize("kind", ["a symbolic link", "another user's", "writable by others"])
def test_a_default_root_that_is_not_this_users_own_is_not_used(tmp_path, monkeypatch, kind):
    """The default root (/dev/shm/ckptfmt-UID) already there as a symbolic link, made by another
    user, or writable by others: RAM saves are skipped with one line naming it (training goes
    on), nothing is written through it, and ``ckptfmt ram`` exits 2 naming it."""
    if kind == "another user's" and os.getuid() != 0:
        pytest.skip("making a directory another user's needs root")
    monkeypatch.delenv(tiers.MEMORY_ENV, raising=False)
    monkeypatch.setattr(tiers, "SHARED_MEMORY", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    root, elsewhere = tiers.memory_root(), tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if kind == "a symbolic link":
        root.symlink_to(elsewhere)
        why = "is a symbolic link or not a directory"
    else:
        root.mkdir(mode=0o700)
        if kind == "another user's":
            os.chown(root, 65534, 65534)
            why = f"belongs to user 65534, not to this one ({os.getuid()})"
        else:
            os.chmod(root, 0o777)
            why = "is writable by other users (mode 777; ckptfmt makes it 700)"
    said = short_run(tmp_path / "run")
    assert len(said) == 1 and f"{root}: the RAM tier's root {why}: not used" in said[0], said
    assert "skipped the save of step 5" in said[0]
    assert list(elsewhere.iterdir()) == [] and (kind == "a symbolic link" or list(root.iterdir()) == [])
    planted = root / tiers.run_id(tmp_path / "run")                # what another user put there
    planted.mkdir()
    (planted / "step_000099.bin").write_bytes(b"x")
    assert tiers.memory_dir(tmp_path / "run") is None and tiers.forget_after(tmp_path / "run", 0) == []
    assert ramdirs.collect(tmp_path / "run", 0) is None and (planted / "step_000099.bin").exists()
    refused = cli("ram")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert f"{root}: the RAM tier's root {why}" in refused.stderr


def test_an_unreadable_tier_hides_no_other_and_an_unlistable_root_is_exit_2(tmp_path):
    memory = tmp_path / "shm"
    loop(tmp_path, tmp_path / "run", memory, kill_at=33)
    bad = memory / ("ef" * 16)
    bad.mkdir()
    (bad / ramdirs.OWNER).mkdir()                                  # its record cannot be read
    listed = ram(memory, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {t["run_id"]: t for t in json.loads(listed.stdout)["tiers"]}
    assert rows["ef" * 16]["status"] == "unreadable" and rows["ef" * 16]["why"].startswith("cannot be read: ")
    assert rows[tiers.memory_dir(tmp_path / "run").name]["status"] == "in use"
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    refused = ram(not_a_dir)
    assert refused.returncode == 2 and f"{not_a_dir}: cannot list the RAM tiers" in refused.stderr
