"""Every filesystem call of a save, commit, history append and prune goes through here.

Why one module: tests crash or fail the k-th operation by installing ``hook`` (the way
LevelDB routes I/O through its Env), and strace-free fault injection becomes a one-liner.
A hook receives (operation, path) before the call and may raise or ``os._exit``.
"""
from __future__ import annotations

import ctypes
import os
import re
import stat
from typing import Callable

from .errors import UnsupportedSetupError

Hook = Callable[[str, str], None]
hook: Hook | None = None

_SYNC_FILE_RANGE_WRITE = 2
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _sync_file_range = _libc.sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except (OSError, AttributeError):  # not Linux: writeback-ahead is only a speed-up
    _sync_file_range = None


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(text: "str | os.PathLike[str]") -> bool:
    """A URL (``s3://bucket/runs/x``, ``gs://...``, ``file:///...``), not a local path.

    >>> is_url("s3://bucket/runs/x"), is_url("runs/x")
    (True, False)
    """
    return isinstance(text, str) and bool(_URL.match(text))


# What takes a URL (spec/RUN.md §2.0.2, §10), for the refusals of one that is not taken somewhere
TAKES_URL = ("a run at a URL is written by CheckpointManager(URL), train --run URL and mirror RUN URL, and "
             "taken by ls, validate, inspect, export, fork, bisect, plot, pivot, gc, pin, diff and import URL DEST")


def refuse_url(path: "str | os.PathLike[str]", what: str, instead: str = TAKES_URL) -> None:
    """A URL where only a local path is taken is refused (``UnsupportedSetupError``, exit 2):
    ``pathlib`` would make ``s3://b/r`` the local directory ``s3:/b/r`` and a run would train,
    save and compare there, silently (spec/RUN.md §10). ``instead``: what the user can do with
    the URL (by default, what takes one)."""
    if is_url(path):
        raise UnsupportedSetupError(str(path), f"a URL where {what} on a local filesystem is expected; {instead}")


def _call(op: str, path: "str | os.PathLike[str]") -> None:
    if hook is not None:
        hook(op, os.fspath(path))


def open_excl(path: str) -> int:
    """Create ``path`` for writing; fails if it exists (O_EXCL), so no final path is reused."""
    _call("open", path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)


def open_append(path: str) -> int:
    _call("open", path)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)


def write_all(fd: int, data: "bytes | memoryview", path: str = "") -> None:
    """Write every byte: a short write is continued, never mistaken for success."""
    view = memoryview(data).cast("B")
    while view:
        _call("write", path)
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(f"write returned {written}")
        view = view[written:]


def writeback(fd: int, offset: int, length: int) -> None:
    """Start writeback of a written range early, so the final fsync has little left to do."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def fsync(fd: int, path: str = "") -> None:
    _call("fsync", path)
    os.fsync(fd)


def close(fd: int, path: str = "") -> None:
    _call("close", path)
    os.close(fd)


def replace(src: str, dst: str) -> None:
    _call("rename", dst)
    os.replace(src, dst)


def special(mode: int) -> str:
    """What a path that is not a regular file is, for messages: "a directory", "a FIFO", ..."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return what
    return "a special file"


def fsync_dir(directory: str) -> None:
    """fsync a directory so a rename or unlink in it survives a power cut (ALICE's top fix)."""
    _call("fsync_dir", directory)
    fd = os.open(directory or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    _call("unlink", path)
    os.unlink(path)


def link(src: str, dst: str) -> None:
    _call("link", dst)
    os.link(src, dst)


def tree_size(path: "str | os.PathLike[str]") -> int:
    """Bytes of a file, or of every file under a directory (a DCP or Hugging Face checkpoint)."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
