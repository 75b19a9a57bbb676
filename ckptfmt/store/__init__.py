"""Where a run's files live: a local directory, or a prefix in object storage (spec/RUN.md §2.0).

A *store* holds a run's files by name (``step_000100.bin``, ``step_000100.shards/00000-of-00002.bin``,
``.loss.json``) and is all a generation needs to be listed, checked for what it holds and removed,
wherever it is. The listing (``generation.list_store``) makes the same ``Generation`` from the
entries of any store, so one classification of names and one removal order serve the run
directory, the RAM tier and a mirror alike.

The protocol, in the order a reader and a remover call it (as torch DCP documents its
``StorageWriter``)::

    entries()                   every entry at the top of the store: name, size, kind
    locate(name)                what a listed generation holds for a part: a local path, or the name
    where(name)                 the part as a message names it (a path, or the URL without credentials)
    size(name)                  one file's size (None: not there)
    read_bytes(name)            one small file whole (a manifest, a sidecar)
    read_range(name, start, end) bytes [start, end) of a file (a header; fewer at its end)
    digest(name)                (blake3, size) of a file read back, for a part's verification
    remove(name, recursive=)    a file (or, recursive, a shard directory); absent is no error

A remover takes a generation's manifest first (uncommitted at once), then its parts
(``Generation.remove``), so no reader ever takes a half-removed generation as committed. A crash
between those calls leaves parts without a manifest: listed as uncommitted (``Generation.leftover``), never as
committed, and removed by the next removal of that step
(retention, ``gc``). A crash inside ``remove(recursive=True)`` leaves some
shards of a generation whose manifest is gone already: the same leftover.

Writing is each store's own (the durable local commit of ``atomic``; a mirror's upload, read
back before the manifest goes up, in ``tools.mirror``). Two implementations: ``local.LocalStore``
(a run directory, and the RAM tier's, which is a local directory in shared memory), and
``objects.ObjectStore`` over fsspec, which imports fsspec only when one is made (the optional
extra ``ckptfmt[remote]``). Neither imports ``generation``: the listing is made there, from
``entries()`` (``generation.list_store``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from typing import Protocol

FILE, DIRECTORY, OTHER = "file", "directory", "other"


@dataclass(frozen=True)
class Entry:
    """One entry at the top of a store: its ``name``, ``size`` (a file's bytes; None for
    anything else) and ``kind``: ``file``, ``directory`` (a prefix, on object storage) or
    ``other`` (a symbolic link, a FIFO, a device: never followed or opened)."""
    name: str
    size: int | None
    kind: str


class Store(Protocol):
    """The calls a generation makes of where it lives (the module docstring has their order)."""

    def where(self, name: str = "") -> str:
        """``name`` as a message names it: a local path, or the URL (no credentials)."""

    def locate(self, name: str) -> PurePath:
        """What a listed generation holds for part ``name``: the local path, or the name."""

    def entries(self) -> list[Entry]:
        """Every entry at the top of the store, by name."""

    def size(self, name: str) -> int | None:
        """The file's size in bytes, None when it is not there."""

    def read_bytes(self, name: str) -> bytes:
        """The whole file."""

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` of the file (fewer where it ends sooner)."""

    def digest(self, name: str) -> tuple[str, int]:
        """(blake3, size) of the file as read back now."""

    def remove(self, name: str, *, recursive: bool = False) -> None:
        """Remove the file, or with ``recursive`` the directory and what it holds; absent is
        no error."""
