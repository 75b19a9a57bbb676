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
from pathlib import Path

import pytest

pytest.importorskip("torch")

from ckptfmt.run import Run, tiers  # noqa: E402
from ckptfmt.run import ramdirs  # noqa: E402

from conftest import cli  # noqa: E402
import warm  # noqa: E402

PY = sys.executable

# A plain loop on the manager: durable every 50 steps, RAM every 5; SIGKILL at KILL_AT (0: never);
# with NAN_AT the weights hold a NaN from that step on; it ends with close(END).
LOOP = """
import os, signal, sys, torch
from ckptfmt.torch import CheckpointManager
run, kill_at, nan_at, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = torch.nn.Linear(16, 8)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(1)
mgr = CheckpointManager(run, model, opt, generators={"data": data}, every=50, memory_every=5,
                        log=lambda m: print("LOG", m, flush=True))
start = mgr.restore()
print("START", start, mgr.restored_tier, flush=True)
for step in range(start + 1, end + 1):
    loss = model(torch.randn(32, 16, generator=data)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == nan_at:
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
    mgr.step(step, loss=loss.item())
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
mgr.close(end)
"""


def loop(tmp_path, run, memory, *, kill_at=0, nan_at=0, end=120, env=None):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    environment = {**os.environ, tiers.MEMORY_ENV: str(memory)} if env is None else env
    proc = warm.run([PY, str(script), str(run), str(kill_at), str(nan_at), str(end)], env=environment,
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
    kept = json.loads(cli("gc", str(run), "--keep-last", "2", "--json", env=env).stdout)
    assert kept["tiers"]["memory"] == {"dir": str(tiers.memory_dir(run)), "covered_by": 50, "deleted": [],
                                       "kept": [65, 70]}           # newer than durable 50: a resume takes 70
    loop(tmp_path, run, memory, kill_at=103)                       # durable 100, RAM 95 and 85 (90: none)
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
    theirs_root = Path(f"/dev/shm/ckptfmt-{nobody}")
    shared = Path(tempfile.mkdtemp(prefix="ckptfmt-second-user-"))   # a directory both users reach
    os.chmod(shared, 0o777)
    made_mine = not tiers.memory_root().exists()
    assert short_run(tmp_path / "first") == []
    mine = tiers.memory_dir(tmp_path / "first")
    try:
        assert mine.parent == Path(f"/dev/shm/ckptfmt-{os.getuid()}") and ram_steps(mine) == [25, 30]
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
        shutil.rmtree(mine, ignore_errors=True)
        if made_mine:
            shutil.rmtree(mine.parent, ignore_errors=True)
        shutil.rmtree(theirs_root, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)
