"""The store of a local directory: a run directory, and the RAM tier's (spec/RUN.md §13)."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterable

from .. import atomic, fingerprint, fsio
from ..errors import FingerprintMismatchError, SaveError
from . import DIRECTORY, FILE, OTHER, Entry, Written


class LocalStore:
    """A local directory (the run directory, the RAM tier's): the durable removal of
    ``atomic`` (the directory fsynced after each unlink), nothing followed through a link."""

    def __init__(self, root: "str | os.PathLike[str]"):
        self.root = Path(root)

    def where(self, name: str = "") -> str:
        return str(self.root / name) if name else str(self.root)

    def locate(self, name: str) -> Path:
        return self.root.joinpath(*name.split("/"))

    def entries(self) -> list[Entry]:
        out = []
        for entry in sorted(os.scandir(self.root), key=lambda e: e.name):
            if entry.is_file(follow_symlinks=False):
                out.append(Entry(entry.name, None, FILE))     # sized on demand: a listing opens nothing
            elif entry.is_dir(follow_symlinks=False):
                out.append(Entry(entry.name, None, DIRECTORY))
            else:
                out.append(Entry(entry.name, None, OTHER))
        return out

    def size(self, name: str) -> int | None:
        try:
            return self.locate(name).stat().st_size
        except FileNotFoundError:
            return None

    def read_bytes(self, name: str) -> bytes:
        return self.locate(name).read_bytes()

    def read_range(self, name: str, start: int, end: int) -> bytes:
        with open(self.locate(name), "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))

    def digest(self, name: str) -> tuple[str, int]:
        path = self.locate(name)
        return fingerprint.of_file(path), path.stat().st_size

    def checksum(self, name: str) -> None:
        """A local file has no checksum of its own: a commit reads it back (``store.confirm``)."""
        return None

    def stat(self, name: str) -> tuple[int | None, None]:
        return self.size(name), None

    def download(self, name: str, local: Path, expected: str | None, progress=None) -> str:
        """Copy ``name`` to ``local`` through the durable write, hashed as copied; a copy whose
        blake3 is not ``expected`` is refused and never published (``atomic.copy_verified``)."""
        return atomic.copy_verified(self.locate(name), Path(local), expected, progress)

    def under(self, prefix: str) -> "LocalStore":
        return LocalStore(self.locate(prefix))

    def open_part(self, name: str) -> atomic.AtomicWriter:
        """The durable write of ``name`` (temp file; ``commit``: fsync, rename, the directory
        fsynced); the folders it is in are made first."""
        return atomic.AtomicWriter(self._parent(name))

    def _parent(self, name: str) -> Path:
        """``name``'s path, the folders it is in made first (a store under a prefix not made yet)."""
        path = self.locate(name)
        if not path.parent.is_dir():
            atomic.make_durable_dir(path.parent)
        return path

    def write(self, name: str, chunks: Iterable[bytes], *, expected: str | None = None) -> Written:
        """The durable write (temp file, fsync, rename, the directory fsynced), hashed as written;
        a part whose blake3 is not ``expected`` is never renamed into place."""
        path = self.locate(name)
        h = fingerprint.hasher(0)
        with self.open_part(name) as out:
            for chunk in chunks:
                h.update(chunk)
                out.write(chunk)
            if expected is not None and h.hexdigest() != expected:
                raise FingerprintMismatchError(str(path), fingerprint.mismatch(expected, h.hexdigest(), by="writer")
                                               + "; not written")
            out.commit()
        return Written(name, out.offset, h.hexdigest())

    def put_bytes(self, name: str, data: bytes) -> None:
        atomic.write_bytes(self._parent(name), data)

    def create(self, name: str, data: bytes) -> bool:
        try:
            atomic.write_bytes(self._parent(name), data, exclusive=True)
        except SaveError as exc:
            if exc.problem == atomic.EXISTS:
                return False
            raise
        return True

    def remove(self, name: str, *, recursive: bool = False) -> None:
        path = self.locate(name)
        if not recursive:
            atomic.remove(path)
            return
        if path.is_symlink() or not path.is_dir():
            atomic.remove(path)          # a link is removed, never followed; absent is no error
            return
        try:                             # an entry another remover took first is no error: go on
            for entry in _entries(path):
                with contextlib.suppress(FileNotFoundError):
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, onerror=_gone_is_fine)
                    else:
                        fsio.unlink(entry.path)
            with contextlib.suppress(FileNotFoundError):
                path.rmdir()
        except OSError as exc:
            raise SaveError(str(path), f"cannot remove: {exc.strerror or exc}") from exc
        fsio.fsync_dir(str(path.parent))


def _entries(path: Path) -> list[os.DirEntry]:
    try:
        return list(os.scandir(path))
    except FileNotFoundError:
        return []


def _gone_is_fine(function, path, info) -> None:
    """``rmtree``'s error handler: an entry removed meanwhile is what was asked for."""
    if not issubclass(info[0], FileNotFoundError):
        raise info[1]
