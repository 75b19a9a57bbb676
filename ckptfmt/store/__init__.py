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
    checksum(name)              the file's checksum as the store computed it (S3: its ETag), or None
    stat(name)                  (size, checksum) in one look (S3: one ``HEAD``); (None, None): not there
    download(name, local, expected, progress)
                                a file streamed to a local path through the durable write, hashed
                                as it comes (one whose blake3 is not ``expected`` is never published)
    remove(name, recursive=)    a file (or, recursive, a shard directory); absent is no error

A remover takes a generation's manifest first (uncommitted at once), then its parts
(``Generation.remove``), so no reader ever takes a half-removed generation as committed. A crash
between those calls leaves parts without a manifest: listed as uncommitted (``Generation.leftover``), never as
committed, and removed by the next removal of that step
(retention, ``gc``). A crash inside ``remove(recursive=True)`` leaves some
shards of a generation whose manifest is gone already: the same leftover.

A writer calls, in this order::

    write(name, chunks, expected=)  each part as a stream, its blake3 computed as it is written
                                    (``expected``: refused, never published, when it differs);
                                    returns a ``Written`` (name, size, blake3)
    open_part(name)                 the same as a sink the caller writes and hashes itself
                                    (``write``, ``offset``, ``commit``; leaving it uncommitted
                                    publishes nothing: the seed writer's hashing thread uses it)
    commit(store, manifest, data, parts, before=)
                                    every part confirmed on the store by its size and the
                                    checksum the store computed as it received it (S3's ETag,
                                    ``multipart``), else its blake3 read back, ``before()`` (the run records the root it commits),
                                    then the manifest (the commit marker) written last, create-only
    put_bytes(name, data)           a small file whole (a sidecar, a history segment)
    create(name, data)              an object made only where none is (the run's writer lock, a
                                    manifest, a history segment):
                                    False when one is there already (S3's ``If-None-Match: *``)

A crash before the manifest leaves parts without one: the uncommitted leftover above.

Three stores, two classes. The run directory is a ``local.LocalStore`` (the durable protocol:
temp file, fsync, rename, the directory fsynced). The RAM tier is a ``LocalStore`` too, over a
directory in shared memory (``/dev/shm/ckptfmt-UID/RUN-ID``, ``run.tiers``): the same calls and
the same on-disk format, so a RAM generation is listed, verified, restored and removed as a
durable one is; what is the tier's own is its life, not its store (made again when removed,
emptied at close of what a durable generation covers, orphans found: ``run.ramdirs``,
``torch.memtier``). Object storage is ``objects.ObjectStore`` over fsspec, which imports fsspec
only when one is made (the optional extra ``ckptfmt[remote]``). Neither class imports
``generation``: the listing is made there, from ``entries()`` (``generation.list_store``).
"""
from __future__ import annotations

import os

from dataclasses import dataclass
from pathlib import PurePath
from typing import Callable, Iterable, Protocol

from ..errors import CheckpointError, RemoteError, SaveError

FILE, DIRECTORY, OTHER = "file", "directory", "other"


@dataclass(frozen=True)
class Entry:
    """One entry at the top of a store: its ``name``, ``size`` (a file's bytes; None for
    anything else) and ``kind``: ``file``, ``directory`` (a prefix, on object storage) or
    ``other`` (a symbolic link, a FIFO, a device: never followed or opened)."""
    name: str
    size: int | None
    kind: str


@dataclass(frozen=True)
class Written:
    """A part as its writer sent it: ``name`` in the store, ``size`` in bytes, ``blake3`` of the
    bytes as they were written, and ``checksum``: what the store said, computing it itself, of
    the bytes it received (S3: the ETag their MD5s make, ``multipart``), None where it vouched
    for nothing (a local file, a store whose ETags are not MD5s)."""
    name: str
    size: int
    blake3: str
    checksum: str | None = None


def written(name: str, sink: "Sink", blake3: str) -> Written:
    """The ``Written`` of a committed ``open_part`` sink (a local file's sink has no checksum)."""
    return Written(name, sink.offset, blake3, getattr(sink, "checksum", None))


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

    def checksum(self, name: str) -> str | None:
        """The file's checksum as the store computed it when it received it (S3: the ETag), None
        where the store keeps none (a local file: confirmed by reading it back)."""

    def stat(self, name: str) -> tuple[int | None, str | None]:
        """(``size``, ``checksum``) of the file from one look at it; (None, None) when it is not there."""

    def download(self, name: str, local: "os.PathLike[str]", expected: str | None,
                 progress: "Callable[[int], None] | None" = None) -> str:
        """Stream the file to ``local`` (durably), its blake3 computed as it comes and returned;
        one that is not ``expected`` is refused (``FingerprintMismatchError``), never published."""

    def remove(self, name: str, *, recursive: bool = False) -> None:
        """Remove the file, or with ``recursive`` the directory and what it holds; absent is
        no error."""

    def write(self, name: str, chunks: Iterable[bytes], *, expected: str | None = None) -> Written:
        """Write part ``name`` from ``chunks``, hashed as written; one whose blake3 is not
        ``expected`` is refused (``FingerprintMismatchError``) and never published."""

    def put_bytes(self, name: str, data: bytes) -> None:
        """Write one small file whole (a manifest, a sidecar), published at once or not at all."""

    def create(self, name: str, data: bytes) -> bool:
        """Make ``name`` holding ``data`` only where nothing is; False when something is."""

    def open_part(self, name: str) -> "Sink":
        """A part to write: ``with store.open_part(name) as out: out.write(chunk) ...;
        out.commit()`` publishes it; leaving the block uncommitted publishes nothing."""

    def under(self, prefix: str) -> "Store":
        """The store of the files under ``prefix`` (a folder of this one: the history's segments)."""


class Sink(Protocol):
    """A part being written (``Store.open_part``): ``offset`` bytes so far."""
    offset: int

    def write(self, data: "bytes | memoryview") -> None: ...

    def commit(self) -> None: ...


def commit(store: Store, manifest: str, data: bytes, parts: "list[Written]",
           before: "Callable[[], None] | None" = None) -> None:
    """Publish a generation: each part of ``parts`` confirmed on ``store`` (``confirm``), then ``before()`` (what raises there fails the commit), then ``manifest``
    written last. A part that is not what was written is a ``SaveError`` naming it, and no
    manifest is written: the generation stays uncommitted."""
    confirm(store, parts)
    if before is not None:
        before()
    put_manifest(store, manifest, data)


def put_manifest(store: Store, manifest: str, data: bytes) -> None:
    """The commit marker, written create-only (``created``): a manifest another writer put there
    (one that took the run's lease over while this one stalled) is never replaced (``SaveError``)."""
    if not created(store, manifest, data):
        raise SaveError(store.where(manifest), "is on the store already (another writer's); not overwritten, "
                                               "not committed")


def created(store: Store, name: str, data: bytes) -> bool:
    """``store.create``, where a create whose reply was lost and that the client retried (S3
    then answers that the object exists) is told from another's by its bytes: ours if equal."""
    if store.create(name, data):
        return True
    try:
        return store.read_bytes(name) == data
    except RemoteError as exc:
        if getattr(exc, "unanswered", False):
            raise                  # a store that stopped answering: not another writer's object
        return False
    except (OSError, CheckpointError):
        return False


def confirm(store: Store, parts: "list[Written]") -> None:
    """Each of ``parts`` on ``store`` as it was written: its size, then the checksum the store
    computed when it received the part, both asked again now in one look (``stat``: one ``HEAD``),
    or, where the store vouched for nothing or now says otherwise, its blake3 read back
    (``SaveError`` naming the first part that is not as written; a sharded save's ranks each
    confirm their own)."""
    for part in parts:
        size, checksum = store.stat(part.name)
        if size != part.size:
            raise SaveError(store.where(part.name), f"on the store: {size} bytes, {part.size} were written; "
                                                    "not committed")
        if part.checksum is not None and checksum == part.checksum:
            continue
        got = store.digest(part.name)[0]
        if got != part.blake3:
            raise SaveError(store.where(part.name), f"on the store it hashes to {got}, {part.blake3} was "
                                                    "written; not committed")
