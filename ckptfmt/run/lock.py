"""One writer per run: an flock on ``RUN/.lock`` naming its holder (spec/RUN.md §3)."""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from .. import format as fmt
from ..atomic import temp_pid
from ..errors import RunLockedError

LOCK = ".lock"
UNWRITTEN = {"never_written": True}   # what a released .lock holds while no writer has held the run
_FIRST: dict[str, "RunLock"] = {}     # run directory -> the lock this process holds as its first writer


class RunLock:
    """An flock on ``RUN/.lock`` for the life of a writer; it dies with its process, so a lock
    left by a dead process is stale by construction and is taken over (and reported)."""

    def __init__(self, run: "str | os.PathLike[str]", purpose: str = "writer", *, writes_generations: bool = True):
        self.path = Path(run) / LOCK
        self.purpose = purpose
        self.first = False              # no writer held the run before (``first_writer``)
        # a first writer that writes no generation (gc, pivot) leaves the run marked unwritten
        self.keep_unwritten = not writes_generations
        self.fd: int | None = None
        self.stale: dict[str, Any] | None = None

    def acquire(self) -> "RunLock":
        """Take the lock or raise ``RunLockedError`` naming the live holder; a lock left by a
        dead process is taken over and recorded in ``stale``."""
        try:
            fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), True
        except FileExistsError:
            fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644), False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            mine = holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
            raise RunLockedError(str(self.path.parent), f"locked by {holder.get('purpose', 'a writer')} "
                                 f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
                                 + (" (this process: close() the writer that holds it first, e.g. an "
                                    "earlier CheckpointManager)" if mine else ""),
                                 got=holder) from None
        previous = _read_holder(fd)
        if previous.get("pid") and previous.get("pid") != os.getpid():
            self.stale = previous
        info = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        self.first = created or previous == UNWRITTEN
        if self.first:
            _FIRST[os.path.realpath(self.path.parent)] = self
        return self

    def release(self) -> None:
        """Give the lock up (also on process death, by the kernel). The ``.lock`` stays (a
        writer waiting on it holds it open): empty, or ``UNWRITTEN`` when a first writer wrote
        no generation on purpose (gc, pivot, a refused bare run), so the next one is first too."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            if self.first and self.keep_unwritten:
                os.pwrite(self.fd, json.dumps(UNWRITTEN).encode(), 0)
            os.close(self.fd)
            self.fd = None
            _FIRST.pop(os.path.realpath(self.path.parent), None)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def first_writer(run: "str | os.PathLike[str]") -> bool:
    """Whether the lock this process holds on ``run`` is its first writer's: it created the
    ``.lock``, or found it ``UNWRITTEN``. The run's manifest-less ``.bin`` files are then not
    leftovers of an interrupted save of ours (a crash keeps a ``.lock`` holding its holder, made
    durable by the save's directory fsync) but bare checkpoints someone put there (RUN.md §2.2)."""
    return os.path.realpath(run) in _FIRST


def keep_unwritten(run: "str | os.PathLike[str]") -> None:
    """The first writer of ``run`` refuses it: its ``.lock`` is left ``UNWRITTEN`` at release,
    so a retry is a first writer too (it would otherwise take the bare ``.bin`` files for
    leftovers of ours and replace them)."""
    lock = _FIRST.get(os.path.realpath(run))
    if lock is not None:
        lock.keep_unwritten = True


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (ValueError, RecursionError):
        return {}
    return holder if isinstance(holder, dict) else {}


def lock_holder(run: "str | os.PathLike[str]") -> dict[str, Any] | None:
    """Who holds the writer lock now, or None (used by ls and pivot)."""
    path = Path(run) / LOCK
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _read_holder(fd)
    finally:
        os.close(fd)


def save_in_progress(entry: Path, holder: dict[str, Any] | None) -> bool:
    """True when ``entry`` (a temp file, or part of a generation without its manifest) is the
    live writer's unfinished save rather than a crash leftover: the run lock is held (``holder``,
    from ``lock_holder``) and the entry is a temp file named with the holder's pid
    (``atomic.temp_path_for``), or another entry written since the holder took the lock."""
    if holder is None:
        return False
    pid = temp_pid(entry.name)
    if pid is not None:
        return pid == holder.get("pid")
    since = holder.get("since")
    if not isinstance(since, (int, float)) or isinstance(since, bool):
        since = float("-inf")            # a hand-edited .lock: in progress, as when it says nothing
    try:
        return entry.stat(follow_symlinks=False).st_mtime >= since
    except FileNotFoundError:
        return True             # renamed or committed while we looked: it was in progress


def sidecar_in_progress(entry: Path) -> bool:
    """True when ``entry`` is the temp file of a sidecar (not a generation's ``step_`` file)
    named with the pid of another process alive on this machine (``atomic.temp_path_for``): a
    ``mirror --watch`` or ``pin`` replacing ``.mirrors.json`` or ``.pins.json`` beside the
    writer, which takes no run lock, so a sweep must leave it. A generation's temp files are
    only ever written under the lock: the lock holder sweeps them whatever their pid (a pid in
    a leftover's name may belong to another process after a restart)."""
    pid = temp_pid(entry.name)
    if pid is None or pid == os.getpid() or entry.name[len(fmt.TEMP_PREFIX):].startswith("step_"):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                 # alive, another user's
    return True
