"""Read leases (spec/RUN.md §5.3): a reader's claim on the generations it reads.

Readers (export, fork, ls, validate, inspect) list a run and lease every committed generation
they listed; retention (``Run.gc``, which the trainer and the checkpoint manager call after each
commit) keeps a leased generation until the lease ends. So a reader sees the run as it was when
it started, however fast the trainer commits and prunes.

Two flocks make it race-free and crash-safe, the same way the writer lock does (lock.py):

* the run directory itself: a reader takes it shared while it lists and writes its lease,
  retention takes it exclusive while it reads the leases and deletes, so a generation is never
  deleted between a reader's listing and its lease;
* each lease file ``RUN/.leases/PID.TOKEN.json``, held exclusive by its reader for the lease's
  life: the kernel drops it when the reader dies, so a lease cannot outlive its process.
  Retention sweeps lease files nobody holds.

A reader that cannot write ``.leases/`` (a read-only run directory) reads without a lease and
says so (``ReadLease.problem``); a filesystem without flock on directories gets leases without
the exclusion (best effort).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import socket
import stat
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..generation import Listing, list_dir

LEASES = ".leases"
LEASE_NAME = re.compile(r"[0-9]+\.[0-9a-f]{8}\.json")       # PID.TOKEN.json, as ReadLease names it

__all__ = ["LEASES", "ReadLease", "honoured", "active_leases"]


@contextlib.contextmanager
def _excluding(run: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold an flock on the run directory: shared for readers, exclusive for retention."""
    try:
        fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        fd = None           # unreadable directory: the caller's own listing will say so
    try:
        if fd is not None:
            with contextlib.suppress(OSError):   # no flock on directories here (NFS): best effort
                fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        if fd is not None:
            os.close(fd)    # closing drops the flock


class ReadLease:
    """A reader's lease on the committed generations of a run, from ``acquire`` to ``release``.

    Examples:
        >>> import tempfile; d = tempfile.mkdtemp()
        >>> with ReadLease(d, purpose="doctest") as lease:
        ...     (lease.held, lease.steps, lease.listing.generations)
        (True, [], [])
    """

    def __init__(self, run: "str | os.PathLike[str]", purpose: str = "reader"):
        self.run = Path(run)
        self.purpose = purpose
        self.listing: Listing | None = None
        self.steps: list[int] = []
        self.path: Path | None = None       # the lease file while held
        self.problem: str | None = None     # why there is no lease (read-only run directory)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """True while retention honours this lease."""
        return self._fd is not None

    def acquire(self) -> "ReadLease":
        """List the run and lease every committed generation listed, as one step that retention
        cannot interleave with; ``self.listing`` is that listing."""
        with _excluding(self.run, exclusive=False):
            self.listing = list_dir(self.run)
            self.steps = [g.step for g in self.listing.generations if g.committed]
            try:
                self._create()
            except OSError as exc:
                self.problem = f"{self.run / LEASES}: cannot write a read lease ({exc.strerror or exc}); " \
                               "reading without one"
        return self

    def _create(self) -> None:
        leases = self.run / LEASES
        leases.mkdir(exist_ok=True)
        if not _is_real_dir(leases):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory of its own (a symlink?)", str(leases))
        path = leases / f"{os.getpid()}.{secrets.token_hex(4)}.json"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # ours alone: a new file
            _write(fd, self._record())
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        self._fd, self.path = fd, path

    def _record(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                "since": time.time(), "steps": self.steps}

    def narrow(self, steps: Iterable[int]) -> None:
        """Keep the lease only on ``steps`` (those the reader goes on to read), so retention
        may prune the rest now. A lease never grows: steps it did not hold are ignored."""
        keep = set(steps)
        self.steps = [s for s in self.steps if s in keep]
        if self._fd is not None:
            with _excluding(self.run, exclusive=False):
                _write(self._fd, self._record())

    def release(self) -> None:
        """End the lease: retention may delete these generations from its next run on."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)        # first, so the file is never seen unheld while we live
        os.close(self._fd)
        self._fd = None
        with _excluding(self.run, exclusive=True):
            _remove_if_empty(self.run / LEASES)     # a reader leaves no trace in the run

    def __enter__(self) -> "ReadLease":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _write(fd: int, record: dict[str, Any]) -> None:
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _scan(run: Path, *, sweep: bool) -> list[tuple[str, dict[str, Any]]]:
    """(file name, record) of each live lease; lease files nobody holds are stale (their reader
    died) and removed when ``sweep``."""
    out: list[tuple[str, dict[str, Any]]] = []
    if not _is_real_dir(run / LEASES):
        return out                      # absent, or not ours to sweep (a symlink elsewhere)
    for entry in sorted(os.scandir(run / LEASES), key=lambda e: e.name):
        if not LEASE_NAME.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
            continue                    # only lease files of our own naming are read or swept
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue                    # its reader ended the lease just now
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            out.append((entry.name, _read(fd)))       # held: a live reader
            continue
        finally:
            os.close(fd)
        if sweep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    return out


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _read(fd: int) -> dict[str, Any]:
    try:
        record = json.loads(os.pread(fd, 1 << 20, 0) or b"{}")
    except (ValueError, RecursionError):
        record = {}
    return record if isinstance(record, dict) else {}


@contextlib.contextmanager
def honoured(run: "str | os.PathLike[str]", *, sweep: bool = True) -> Iterator[set[int]]:
    """For retention: the steps live readers hold, with readers kept from taking new leases
    until the block ends (delete inside it). ``sweep`` removes stale lease files."""
    path = Path(run)
    with _excluding(path, exclusive=True):
        leased: set[int] = set()
        for _, record in _scan(path, sweep=sweep):
            leased |= {s for s in record.get("steps", []) if isinstance(s, int)}
        if sweep:
            _remove_if_empty(path / LEASES)
        yield leased


def _remove_if_empty(leases: Path) -> None:
    """Remove ``.leases/`` when no lease is left; only under the exclusive flock, so no reader
    is between creating the directory and its lease file."""
    with contextlib.suppress(OSError):      # absent, or another reader's lease is in it
        os.rmdir(leases)


def active_leases(run: "str | os.PathLike[str]", *, own: "ReadLease | None" = None) -> list[dict[str, Any]]:
    """Live leases (pid, host, purpose, since, steps) for ``ls``, less the caller's ``own``.

    Examples:
        >>> import os
        >>> from ckptfmt.run import ReadLease, active_leases
        >>> os.makedirs("leased", exist_ok=True)
        >>> with ReadLease("leased", purpose="export"):
        ...     [lease["purpose"] for lease in active_leases("leased")]
        ['export']
        >>> active_leases("leased")
        []
    """
    mine = own.path.name if own is not None and own.path is not None else None
    return [record for name, record in _scan(Path(run), sweep=False) if name != mine]
