"""Durable atomic write (spec §5): sibling temp, write, fsync, rename, fsync dir, cleanup.

A final path is never opened for writing: the new bytes go to a temp file in the same
directory whose name never matches ``step_*.bin`` and is created with O_EXCL, then replace the
final name in one rename. A reader's existing mmap of the old file keeps its inode and survives.
Any failure removes the temp file and raises ``SaveError``; a failed fsync fails the save (no
retry that could report success after the kernel dropped the data, PostgreSQL "fsyncgate").
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

from . import fingerprint, fsio
from .errors import FingerprintMismatchError, SaveError
from .format import TEMP_PREFIX, is_temp_name

WRITEBACK_EVERY = 64 << 20   # start writeback every 64 MiB (spec §5: speed-up only)
EXISTS = "exists already; refusing to overwrite a checkpoint"   # a save that may not overwrite
COPY_CHUNK = 8 << 20         # bytes per read/write in copy_verified


class _RecordingFile(io.FileIO):
    """A file that keeps the first OS error of a write, for ``AtomicWriter.fileobj``."""
    error: OSError | None = None

    def write(self, data: Any) -> int | None:
        try:
            return super().write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise


def missing_dirs(path: "str | os.PathLike[str]") -> list[Path]:
    """``path`` and those of its parents that do not exist yet, innermost first: what a command
    is about to create, so that ``remove_dirs`` can take exactly those away again on failure."""
    path = Path(path)
    return [p for p in (path, *path.parents) if not p.exists()]


def remove_dirs(dirs: list[Path]) -> None:
    """Remove the (empty) directories ``missing_dirs`` listed, innermost first, stopping at the
    first that is not empty or already gone."""
    for path in dirs:
        try:
            path.rmdir()
        except OSError:
            break


def temp_path_for(final: "str | os.PathLike[str]") -> str:
    """``.ckptfmt-tmp.FINAL.PID.TOKEN`` beside ``final`` (spec §5.1): the pid says whose save it
    is (``temp_pid`` reads it back), the random token keeps two saves of one process apart."""
    final = Path(final)
    token = f"{os.getpid()}.{secrets.token_hex(4)}"
    return str(final.parent / f"{TEMP_PREFIX}{final.name}.{token}")


def temp_pid(name: str) -> int | None:
    """The writer's pid in a name ``temp_path_for`` made; None for other names."""
    if not is_temp_name(name):
        return None
    parts = name.rsplit(".", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


class AtomicWriter:
    """Write a file under a temp name and publish it with ``commit()``.

    >>> import tempfile; d = tempfile.mkdtemp()
    >>> with AtomicWriter(d + "/x.json") as w:
    ...     w.write(b"{}")
    ...     w.commit()
    """

    def __init__(self, final: "str | os.PathLike[str]", *, exclusive: bool = False):
        self.final = os.fspath(final)
        self.exclusive = exclusive      # publish only where nothing is (a link, not a rename over)
        self.temp = temp_path_for(self.final)
        self.fd: int | None = None
        self.offset = 0
        self._flushed = 0
        self.committed = False

    def __enter__(self) -> "AtomicWriter":
        try:
            self.fd = fsio.open_excl(self.temp)
        except OSError as exc:
            raise SaveError(self.final, f"cannot create temp file: {exc.strerror or exc}") from exc
        return self

    def write(self, data: "bytes | memoryview") -> None:
        assert self.fd is not None
        try:
            fsio.write_all(self.fd, data, self.temp)
        except OSError as exc:
            raise SaveError(self.final, f"write failed at offset {self.offset}: {exc.strerror or exc}",
                            offset=self.offset) from exc
        self.offset += memoryview(data).nbytes
        if self.offset - self._flushed >= WRITEBACK_EVERY:
            fsio.writeback(self.fd, self._flushed, self.offset - self._flushed)
            self._flushed = self.offset

    @contextlib.contextmanager
    def fileobj(self) -> Iterator[BinaryIO]:
        """A seekable file object over the temp file (for writers that need one, e.g. zipfile).
        A write that the OS refused (a full disk) is a ``SaveError`` naming the final path,
        whatever the writer made of it (the file object's errors name no file; torch.save turns
        them into a RuntimeError)."""
        assert self.fd is not None
        raw = _RecordingFile(self.fd, "w", closefd=False)
        try:
            with io.BufferedWriter(raw) as f:
                yield f
        except Exception as exc:
            cause = raw.error or (exc if isinstance(exc, OSError) and exc.filename is None else None)
            if cause is None:                 # not a write of ours (a source read names its file)
                raise
            raise SaveError(self.final, f"write failed: {cause.strerror or cause}") from cause

    def commit(self) -> None:
        """fsync, close, rename over the final name, fsync the directory."""
        assert self.fd is not None
        fd, self.fd = self.fd, None
        try:
            try:
                fsio.fsync(fd, self.temp)
            finally:
                fsio.close(fd, self.temp)
            self._publish()
        except OSError as exc:
            raise SaveError(self.final, f"commit failed: {exc.strerror or exc}") from exc
        self.committed = True
        sync_dir_of(self.final)

    def _publish(self) -> None:
        """Rename over the final name; ``exclusive``: a hard link, which fails where a file
        appeared since the caller looked (a rename would replace it), then the temp name goes.
        A filesystem without hard links gets the rename after one more look."""
        if not self.exclusive:
            return fsio.replace(self.temp, self.final)
        try:
            fsio.link(self.temp, self.final)
        except OSError as exc:           # EEXIST, or no hard links here (EPERM, ENOSYS, EACCES on FUSE...)
            if isinstance(exc, FileExistsError) or os.path.lexists(self.final):
                raise SaveError(self.final, EXISTS) from None
            return fsio.replace(self.temp, self.final)
        with contextlib.suppress(OSError):   # published: a temp name left is a leftover, swept later
            fsio.unlink(self.temp)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.committed:
            return
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        try:
            os.unlink(self.temp)
        except FileNotFoundError:
            pass


def sync_dir_of(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fsio.fsync_dir(directory)
    except OSError as exc:
        raise SaveError(path, f"fsync of directory {directory} failed: {exc.strerror or exc}") from exc


def write_bytes(final: "str | os.PathLike[str]", chunks: "bytes | Iterable[bytes]", *,
                exclusive: bool = False) -> None:
    """Durably replace ``final`` with ``chunks`` (small files: manifests, sidecars);
    ``exclusive``: only where nothing is (``SaveError`` ``EXISTS`` otherwise)."""
    if isinstance(chunks, (bytes, bytearray, memoryview)):
        chunks = [chunks]
    with AtomicWriter(final, exclusive=exclusive) as writer:
        for chunk in chunks:
            writer.write(chunk)
        writer.commit()


def remove(path: "str | os.PathLike[str]") -> None:
    """Unlink durably (the directory is fsynced afterwards)."""
    path = os.fspath(path)
    try:
        fsio.unlink(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SaveError(path, f"cannot remove: {exc.strerror or exc}") from exc
    sync_dir_of(path)


def make_durable_dir(path: Path) -> None:
    """mkdir -p, fsyncing each parent whose entry was created, so a new run directory survives
    a power cut together with the first generation committed into it."""
    for d in reversed(missing_dirs(path)):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        fsio.fsync_dir(str(d.parent))


def write_json(path: "str | os.PathLike[str]", value: Any) -> None:
    write_bytes(path, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


def copy_verified(src: Path, dst: Path, expected: str | None, progress=None,
                  length: int | None = None) -> str:
    """Copy through the durable write, hashing as it goes; refuse a copy whose hash differs.

    The size is that of the file opened (a sidecar replaced meanwhile is another file, not a
    mix of two). ``length``: copy exactly the first ``length`` bytes, a prefix of a file that
    grows while it is copied (the history of a live run)."""
    with open(src, "rb") as f, AtomicWriter(dst) as out:
        size = os.fstat(f.fileno()).st_size if length is None else length
        h = fingerprint.hasher(0)
        while True:
            chunk = f.read(COPY_CHUNK if length is None else min(COPY_CHUNK, length - out.offset))
            if not chunk:
                break
            h.update(chunk)
            out.write(chunk)
            if progress is not None:
                progress(len(chunk))
        digest = h.hexdigest()
        if expected is not None and digest != expected:      # the source is damaged: name it
            raise FingerprintMismatchError(str(src), fingerprint.mismatch(expected, digest) + "; not copied",
                                           expected=expected, got=digest)
        if out.offset != size:
            raise SaveError(str(dst), f"copied {out.offset} bytes, source has {size}")
        out.commit()
    return digest
