"""Power cuts on a loop-mounted ext4 with the shutdown ioctl xfstests uses (RELIABILITY.md
items 4 and 25). Needs root and loop devices; skips with the reason elsewhere (CI runs as root).

Each cycle: mount, save generations (acknowledged = ``save`` returned), cut the power at a
random filesystem operation of a later save (EXT4_IOC_SHUTDOWN, no log flush), remount, check.
Two negative controls remove the fsync of the file or of the directory: they MUST lose an
acknowledged save, or the harness cannot see what it claims to test.
"""
import fcntl
import os
import random
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest

import ckptfmt
from ckptfmt import fsio
from ckptfmt.errors import CheckpointError, NoValidGenerationError, SaveError
from ckptfmt.run import Run
from faults import arrays, expected_digest, scale

EXT4_IOC_SHUTDOWN = 0x8004587D
NOLOGFLUSH = 2
N = 50_000          # 600 KB generations


def intact(path, step: int) -> bool:
    """Committed, hash-verified and equal to what was saved; the map is closed at once."""
    try:
        with ckptfmt.open(path, manifest="require", verify=True) as ck:
            return ck.fingerprint() == expected_digest(step, N)
    except (CheckpointError, OSError, TypeError):
        return False


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root for loop mounts"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if not shutil.which(tool):
            return f"{tool} is not installed"
    if not os.path.exists("/dev/loop-control"):
        return "no loop devices"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


class Disk:
    def __init__(self, size_mb: int):
        self.dir = Path(tempfile.mkdtemp(prefix="ckptfmt-pc-"))
        self.image = self.dir / "disk.img"
        self.mnt = self.dir / "mnt"
        self.mnt.mkdir()
        subprocess.run(["truncate", "-s", f"{size_mb}M", str(self.image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(self.image)], check=True)

    def mount(self) -> Path:
        subprocess.run(["mount", "-o", "loop", str(self.image), str(self.mnt)], check=True)
        return self.mnt

    def umount(self) -> None:
        import gc
        gc.collect()                      # drop any map still pinning the filesystem
        subprocess.run(["umount", str(self.mnt)], check=True)

    def cut_power(self) -> None:
        fd = os.open(self.mnt, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", NOLOGFLUSH))
        finally:
            os.close(fd)

    def destroy(self) -> None:
        subprocess.run(["umount", str(self.mnt)], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def disk():
    d = Disk(96)
    yield d
    d.destroy()


def cycles(disk: Disk, count: int, seed: int, until_lost: bool = False) -> tuple[int, int, int]:
    """(acknowledged saves, acknowledged saves found intact, torn/empty files accepted);
    ``until_lost``: stop after the first cycle that lost an acknowledged save."""
    rng = random.Random(seed)
    acked_total = present = torn_accepted = 0
    for cycle in range(count):
        mnt = disk.mount()
        run = Run(mnt / "run", create=True)
        start = max((g.step for g in run.generations()), default=0) + 1
        acked = []
        cut_at = rng.randint(1, 40)
        calls = [0]

        def hook(op, path):
            calls[0] += 1
            if calls[0] == cut_at:
                disk.cut_power()
        fsio.hook = hook
        try:
            for step in range(start, start + 4):
                run.commit(step, *arrays(N, step), manifest={})
                acked.append(step)
        except (SaveError, OSError):
            pass
        finally:
            fsio.hook = None
        if calls[0] < cut_at:
            disk.cut_power()
        disk.umount()
        mnt = disk.mount()
        if not (mnt / "run").is_dir():      # the run directory itself was lost
            acked_total += len(acked)
            disk.umount()
            continue
        run = Run(mnt / "run")
        for step in acked:
            gen = next((g for g in run.generations() if g.step == step), None)
            present += gen is not None and gen.bin is not None and intact(gen.bin, step)
        acked_total += len(acked)
        try:                                # whatever the loader accepts must be intact
            latest = run.latest(deep=True)
        except NoValidGenerationError:
            latest = None
        if latest is not None and not intact(latest.bin, latest.step):
            torn_accepted += 1
        for g in run.generations():          # keep the disk small: leave the newest valid only
            if latest is None or g.step != latest.step:
                for p in (g.bin, g.manifest):
                    if p is not None and p.exists():
                        p.unlink()
        run.sweep_temps()
        disk.umount()
        if until_lost and present < acked_total:
            break
    return acked_total, present, torn_accepted


def test_power_cuts_lose_nothing_acknowledged(disk):
    count = scale(30, 2000)
    acked, present, torn = cycles(disk, count, seed=1)
    print(f"FIGURE power cuts: {count} cycles, {acked} acknowledged saves, {present} present and intact, "
          f"{torn} torn files accepted")
    assert acked > count // 2
    assert present == acked and torn == 0


def test_negative_control_without_file_fsync_loses_data(disk, monkeypatch):
    monkeypatch.setattr(fsio, "fsync", lambda fd, path="": None)   # the directory fsync stays
    acked, present, torn = cycles(disk, 20, seed=2, until_lost=True)
    print(f"FIGURE negative control, no file fsync: {acked} acknowledged, {present} survived")
    assert present < acked, "the harness cannot see a missing fsync"


def test_negative_control_without_directory_fsync_loses_data(disk, monkeypatch):
    monkeypatch.setattr(fsio, "fsync_dir", lambda directory: None)
    acked, present, torn = cycles(disk, 20, seed=3, until_lost=True)
    print(f"FIGURE negative control, no directory fsync: {acked} acknowledged, {present} survived")
    assert present < acked, "the harness cannot see a missing directory fsync"


def test_disk_full_is_a_typed_error_and_loses_nothing():
    d = Disk(16)
    try:
        mnt = d.mount()
        run = Run(mnt / "run", create=True)
        n = 200_000                     # 2.4 MB generations in a 16 MB filesystem
        saved = []
        with pytest.raises(SaveError) as info:
            for step in range(1, 100):
                run.commit(step, *arrays(n, step), manifest={})
                saved.append(step)
        assert "No space left" in str(info.value) or "ENOSPC" in str(info.value) or info.value.__cause__.errno == 28
        assert len(saved) >= 2
        assert not list((mnt / "run").glob(".ckptfmt-tmp*"))
        assert [g.step for g in run.generations() if g.committed] == saved    # nothing older deleted
        latest = run.latest(deep=True)
        assert latest.step == saved[-1]
        with ckptfmt.open(latest.bin, verify=True) as ck:
            assert ck.fingerprint() == expected_digest(saved[-1], n)
    finally:
        d.destroy()
