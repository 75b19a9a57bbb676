"""One writer per run: an flock on ``RUN/.lock`` naming its holder (spec/RUN.md §3)."""
from __future__ import annotations

import contextlib
import errno
import gc
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from .. import format as fmt
from ..atomic import temp_pid
from ..errors import RunLockedError, StorageError

LOCK = ".lock"
UNWRITTEN = {"never_written": True}   # what a released .lock holds while no writer has held the run
_FIRST: dict[str, "RunLock"] = {}     # run directory -> the lock this process holds as its first writer


class RunLock:
    """An flock on ``RUN/.lock`` for the life of a writer; it dies with its process, so a lock
    left by a dead process is stale by construction and is taken over (and reported).

    Examples:
        >>> import os
        >>> from ckptfmt.run import RunLock, lock_holder
        >>> os.makedirs("locked", exist_ok=True)
        >>> with RunLock("locked", purpose="writer"):
        ...     lock_holder("locked")["purpose"]
        'writer'
    """

    def __init__(self, run: "str | os.PathLike[str]", purpose: str = "writer", *, writes_generations: bool = True,
                 transient: bool = False):
        self.path = Path(run) / LOCK
        self.purpose = purpose
        self.first = False              # no writer held the run before (``first_writer``)
        # a first writer that writes no generation (gc, pivot) leaves the run marked unwritten
        self.keep_unwritten = not writes_generations
        self.transient = transient      # remove a .lock this holder created, at release (``writing_into``)
        self.created = False
        self.fd: int | None = None
        self.stale: dict[str, Any] | None = None

    def acquire(self) -> "RunLock":
        """Take the lock or raise ``RunLockedError`` naming the live holder; a lock left by a
        dead process is taken over and recorded in ``stale``. A failed acquisition releases what
        it took (descriptor, flock, a ``.lock`` it created), so the same process can retry; the
        storage refusing the holder record (a full disk) is a ``StorageError`` naming ``.lock``."""
        collected = False
        while True:
            fd, created = self._open()
            try:
                if self._take(fd, created):
                    break
            except RunLockedError as exc:
                self._abandon(fd, created)
                if collected or not _mine(exc.got):
                    raise
                collected = True      # a writer of this process nothing refers to any more (a notebook
                gc.collect()          # cell's manager left unclosed, in a cycle) gives its lock up when collected
            except BaseException:
                self._abandon(fd, created)
                raise
        self.created = created
        self.fd = fd
        if self.first:
            _FIRST[os.path.realpath(self.path.parent)] = self
        return self

    def _open(self) -> tuple[int, bool]:
        try:
            try:
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), True
            except FileExistsError:
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644), False
        except OSError as exc:
            if exc.errno in EXHAUSTED:
                raise StorageError(str(self.path), "run lock: creating the lock file", exc) from exc
            raise

    def _take(self, fd: int, created: bool) -> bool:
        """flock ``fd`` and write the holder record; False when the file was removed by its last
        holder meanwhile (a ``transient`` lock): the caller opens it again."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise locked(self.path.parent, _read_holder(fd)) from None
        if not _still_named(fd, self.path):
            os.close(fd)
            return False
        previous = _read_holder(fd)
        if previous.get("pid") and previous.get("pid") != os.getpid():
            self.stale = previous
        info = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                "since": time.time()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except OSError as exc:
            if previous:                  # put back what it said (a stale holder, UNWRITTEN)
                with contextlib.suppress(OSError):
                    os.pwrite(fd, json.dumps(previous).encode(), 0)
            if exc.errno in EXHAUSTED:
                raise StorageError(str(self.path), "run lock: writing the holder record", exc) from exc
            raise
        self.first = created or previous == UNWRITTEN
        return True

    def _abandon(self, fd: int, created: bool) -> None:
        """Give back what a failed acquisition took: a ``.lock`` it created (still empty, so no
        holder's record is lost) is removed while it is still flocked, then the descriptor."""
        with contextlib.suppress(OSError):
            if created and os.fstat(fd).st_size == 0 and _still_named(fd, self.path):
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(fd)        # closing drops the flock, if it was taken

    def release(self) -> None:
        """Give the lock up (also on process death, by the kernel). The ``.lock`` stays (a
        writer waiting on it holds it open): empty, or ``UNWRITTEN`` when a first writer wrote
        no generation on purpose (gc, pivot, a refused bare run), so the next one is first too.
        A ``transient`` holder removes a ``.lock`` it created (still flocked: a process that
        opened it meanwhile finds it unnamed and opens the new one, ``_still_named``)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            _FIRST.pop(os.path.realpath(self.path.parent), None)
            try:
                if self.transient and self.created:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)
                    return
                os.ftruncate(fd, 0)
                if self.first and self.keep_unwritten:
                    os.pwrite(fd, json.dumps(UNWRITTEN).encode(), 0)
            finally:
                os.close(fd)

    def moved(self, directory: "str | os.PathLike[str]") -> None:
        """The directory holding the lock was renamed to ``directory`` (a fork's staging
        directory published at DEST): the lock, held all along, now names that one's ``.lock``."""
        if self.fd is not None and _FIRST.pop(os.path.realpath(self.path.parent), None) is not None:
            _FIRST[os.path.realpath(directory)] = self
        self.path = Path(directory) / LOCK

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _mine(holder: Any) -> bool:
    """``holder`` (``lock_holder``) is this process."""
    return isinstance(holder, dict) and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


def locked(run: "str | os.PathLike[str]", holder: dict[str, Any]) -> RunLockedError:
    """The refusal of a writer while ``holder`` (``lock_holder``) holds ``run``."""
    return RunLockedError(str(run), f"locked by {holder.get('purpose', 'a writer')} "
                          f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
                          + (" (this process: an earlier writer on this run was never closed, e.g. a "
                             "CheckpointManager of a notebook cell that failed: call its close(), or drop "
                             "every reference to it (del it; in IPython also %reset -f out, which holds "
                             "the failed cell's traceback) and its lock goes with it)" if _mine(holder) else ""),
                          got=holder)


EXHAUSTED = (errno.ENOSPC, errno.EDQUOT, errno.EIO)     # named (StorageError), never a bare OSError


def _still_named(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a transient holder may have
    removed it between our open and our flock)."""
    try:
        st, named = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (named.st_dev, named.st_ino)


@contextlib.contextmanager
def writing_into(directory: "str | os.PathLike[str]", purpose: str) -> Iterator[RunLock]:
    """Hold the writer lock of ``directory`` while a generation is written into it from outside
    a training run (``convert``, ``import``, ``fork``): refused with ``RunLockedError`` while a
    writer holds it, and taken before the first byte, so a trainer starting meanwhile is refused
    instead (spec/RUN.md §4). The written generation is not a save of a first writer: a later
    trainer still finds the run unwritten when it was, and a ``.lock`` this created is removed
    at the end, so a directory gets no file but what was written into it.

    Examples:
        >>> import os
        >>> from ckptfmt.run import lock_holder, writing_into
        >>> os.makedirs("dest", exist_ok=True)
        >>> with writing_into("dest", "convert"):
        ...     lock_holder("dest")["purpose"]                      # a trainer starting now is refused
        'convert'
        >>> os.listdir("dest")                                      # nothing left behind
        []
    """
    key, held = os.path.realpath(directory), _writing()
    if key in held:                       # nested in this thread's own write (export's convert)
        yield held[key]
        return
    lock = RunLock(directory, purpose, writes_generations=False, transient=True)
    lock.acquire()
    held[key] = lock
    try:
        yield lock
    finally:
        held.pop(key, None)
        lock.release()


_THREAD = threading.local()


def _writing() -> dict[str, RunLock]:
    """The directories this thread's ``writing_into`` holds."""
    if not hasattr(_THREAD, "held"):
        _THREAD.held = {}
    return _THREAD.held


def writing_file(path: "str | os.PathLike[str]", purpose: str) -> "contextlib.AbstractContextManager[Any]":
    """``writing_into`` the directory of ``path`` when ``path`` is a generation's file (a
    ``step_*`` name) or that directory is a run a writer has used (it holds a ``.lock``);
    nothing otherwise, so ``convert a.bin b/other.safetensors`` into a plain directory leaves
    no ``.lock`` there (nor does a directory that does not exist yet get one)."""
    target = os.path.abspath(os.fspath(path)).rstrip(os.sep) or os.sep
    directory, name = os.path.dirname(target), os.path.basename(target)
    if name.startswith("step_") or os.path.lexists(os.path.join(directory, LOCK)):
        return writing_generations(directory, purpose)
    return contextlib.nullcontext()


def writing_generations(directory: "str | os.PathLike[str]", purpose: str) -> "contextlib.AbstractContextManager[Any]":
    """``writing_into`` ``directory`` when it exists (a sharded split writes its generation
    into a directory of any name); nothing for one that does not exist yet."""
    return writing_into(directory, purpose) if os.path.isdir(directory) else contextlib.nullcontext()


def refuse_live(dest: "str | os.PathLike[str]") -> None:
    """``RunLockedError`` naming the holder when a writer holds the run at ``dest`` (a new run
    that ``fork``, ``import`` or ``restore`` is about to build)."""
    holder = lock_holder(dest) if os.path.isdir(dest) else None
    if holder is not None:
        raise locked(dest, holder)


def publish(staging: "str | os.PathLike[str]", dest: "str | os.PathLike[str]", lock: RunLock) -> None:
    """Rename a new run built in ``staging`` under ``writing_into(staging)`` to ``dest``
    (missing or empty); the lock, held through the rename, is then ``dest``'s. A writer that
    started on ``dest`` meanwhile (its ``.lock`` makes it non-empty, so the rename fails) is
    named as the refusal."""
    try:
        os.replace(staging, dest)
    except OSError:
        refuse_live(dest)
        raise
    lock.moved(dest)


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
    """Who holds the writer lock now, or None (used by ls and pivot).

    Examples:
        >>> import os
        >>> from ckptfmt.run import RunLock, lock_holder
        >>> os.makedirs("free", exist_ok=True)
        >>> lock_holder("free") is None
        True
        >>> with RunLock("free", purpose="gc"):
        ...     sorted(lock_holder("free"))
        ['host', 'pid', 'purpose', 'since']
    """
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
    (``atomic.temp_path_for``), or another entry written since the holder took the lock.

    Examples:
        A temp file named with the pid of the live writer is its save, not a crash's leftover:

        >>> import os
        >>> from pathlib import Path
        >>> from ckptfmt.run import RunLock, lock_holder, save_in_progress
        >>> os.makedirs("busy", exist_ok=True)
        >>> temp = Path(f"busy/.ckptfmt-tmp.step_000010.bin.{os.getpid()}.ab12")
        >>> _ = temp.write_bytes(b"")
        >>> with RunLock("busy"):
        ...     save_in_progress(temp, lock_holder("busy"))
        True
        >>> save_in_progress(temp, lock_holder("busy"))             # no writer: a killed save's leftover
        False
    """
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
