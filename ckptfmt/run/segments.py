"""The loss history of a run on a store that cannot append (object storage; spec/RUN.md §3.8).

An object cannot be appended to, and rewriting one whole history object at each record would
cost O(steps) per record. The history is written instead as numbered *segments* under
``.loss.d/``, ``0000000001.jsonl``, ``0000000002.jsonl``, ...: each holds whole lines of the
``.loss.json`` format (§3), and read in number order and joined they are the history byte for byte
as a local run appends it, so every reader of ``ckptfmt.run.history`` (the canonical view, the
root digests, the best metric) reads it unchanged.

The writer keeps its records in memory and writes them as the next segment at ``sync``: at each
durable event (the ``committing`` record before a generation's manifest, §3.7) and at ``close``.
A segment is made with the store's exclusive create, so a segment is never replaced, and each is
whole or absent (an object is published at once). A kill loses the records since the last
segment, which are the steps after the newest commit: the restart resumes at that commit and
records them again. Numbers come from one writer at a time (the run's writer lease, §4.1); a
number taken meanwhile is an error naming it, never an overwritten segment.

>>> import tempfile
>>> from ckptfmt.store.local import LocalStore
>>> store = LocalStore(tempfile.mkdtemp())
>>> h = SegmentedHistory(store)
>>> h.append({"step": 1, "loss": 2.5}); h.event("committing", 1, durable=True)
>>> h.append({"step": 2, "loss": 2.0}); h.close()
>>> [e.name for e in store.under(DIRECTORY).entries()]
['0000000001.jsonl', '0000000002.jsonl']
>>> [r["step"] for r in h.read().canonical()]
[1, 2]
"""
from __future__ import annotations

import json
import re
import threading
import time
from typing import Any, Callable

from ..errors import CheckpointError
from ..store import FILE, Store
from . import history as hist
from ..store import created

DIRECTORY = ".loss.d"
_SEGMENT = re.compile(r"([0-9]{10})\.jsonl")


class SegmentedHistory:
    """``history.History``'s calls (``append``, ``event``, ``sync``, ``close``, ``read``) over
    ``store``'s segments; ``source`` is what the readers of ``history`` take."""

    def __init__(self, store: Store):
        self.store = store.under(DIRECTORY)
        self.path = self.store.where()           # what messages name
        self._pending: list[bytes] = []
        self._next: int | None = None
        self._lock = threading.RLock()           # appends from any thread, as History's
        self._read: dict[int, bytes] = {}        # segments read already (never replaced)
        self.guard: Callable[[], None] | None = None   # raises once this writer's lease is lost
        self._failed = False                     # the last segment's write failed

    @property
    def source(self) -> "SegmentedHistory":
        return self

    def append(self, record: dict[str, Any]) -> None:
        """Keep one record (strict JSON, as ``History.append``) for the next segment."""
        line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        with self._lock:
            self._pending.append(line.encode())

    def event(self, kind: str, step: int, *, durable: bool = False, **fields: Any) -> None:
        """An event record; ``durable``: on the store (its segment written) before this returns."""
        self.append({"event": kind, "step": step, "time": time.time(), **fields})
        if durable:
            self.sync()

    def sync(self) -> None:
        """Write the records kept since the last segment as the next one (none: nothing)."""
        with self._lock:
            if not self._pending:
                return
            number = self._next if self._next is not None else max(self.numbers(), default=0) + 1
            name = f"{number:010d}.jsonl"
            if self.guard is not None:
                try:
                    self.guard()                 # a writer taken over writes no more history
                except CheckpointError:
                    self._pending = []           # its records belong to no timeline of the run's now
                    raise
            data = b"".join(self._pending)
            self._failed = True
            if not created(self.store, name, data):
                raise CheckpointError(self.store.where(name), "a history segment of that number was written by "
                                      "another writer meanwhile; one writer per run")
            self._pending, self._next, self._read[number], self._failed = [], number + 1, data, False

    def close(self) -> None:
        """The last segment written; not tried again right after a write of it failed (a store
        that did not answer: its error was raised once, and close waits no second time)."""
        if not self._failed:
            self.sync()

    def numbers(self) -> list[int]:
        """The numbers of the segments on the store, in order."""
        try:
            entries = self.store.entries()
        except FileNotFoundError:                # a local store before its first segment
            return []
        found = (_SEGMENT.fullmatch(e.name) for e in entries if e.kind == FILE)
        return sorted(int(m.group(1)) for m in found if m)

    def read_all(self) -> bytes:
        """The history's bytes: every segment in number order, then this writer's records not
        written yet (a reader in the writer's own process sees what it appended)."""
        for n in self.numbers():
            if n not in self._read:
                self._read[n] = self.store.read_bytes(f"{n:010d}.jsonl")
        data = b"".join(self._read[n] for n in sorted(self._read))
        with self._lock:
            return data + b"".join(self._pending)

    def read(self) -> hist.HistoryRead:
        return hist.read(self)
