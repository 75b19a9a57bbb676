"""The loss history ``.loss.json`` (spec/RUN.md §3): one JSON object per line, append-only.

Why JSON lines: an append is one ``write`` of one line, O(1) at 200,000 entries, and a torn
append damages only the last line. The file is never archived and never rewritten. After a
crash the trainer appends a ``resume`` event; records of steps past the resumed step are kept
(nothing is deleted) but leave the canonical history, where the last record of a step wins.
Readers go through it a line at a time (``stream``, ``survey``, ``timeline``, ``index``) and
never hold its records: as dicts, 200,000 of them took a quarter of a gigabyte (spec/RUN.md §3.6).
"""
from __future__ import annotations

import bisect
import contextlib
import io
import json
import math
import os
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator

from .. import fsio
from ..errors import HistoryCorruptError, HistoryWriteError

NAME = ".loss.json"


# events that begin a timeline at their step: the records of later steps before them are a lost
# timeline's (spec/RUN.md §3.4); a start is at step 0, a fresh start over a run's old records
CUTS = ("resume", "fork", "start")

def encode_float(x: float) -> float | str:
    """NaN and infinities are written as the strings 'nan', 'inf', '-inf' (JSON has no NaN)."""
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def decode_float(x: float | str) -> float:
    return float(x)


def strict(value: Any) -> Any:
    """``value`` with every non-finite float, at any depth, as ``encode_float`` writes it (and
    an object with ``to_dict``, a report, as that dict): what strict JSON can hold. ``fork``
    copies a record read back from a history that held a NaN literal through it; the CLI's
    ``--json`` prints every document through it.

    >>> strict({"loss": float("nan"), "x": (1.5, float("-inf"))})
    {'loss': 'nan', 'x': [1.5, '-inf']}
    """
    if isinstance(value, float):
        return encode_float(value)
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    if hasattr(value, "to_dict"):
        return strict(value.to_dict())
    return value


@dataclass
class HistoryRead:
    records: list[dict[str, Any]] = field(default_factory=list)   # every parsed line, in order
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)             # corruption in the middle

    def canonical(self) -> list[dict[str, Any]]:
        """Exactly one record per step: resume, fork and start events cut lost timelines, last writer wins."""
        by_step: dict[int, dict[str, Any]] = {}
        for rec in self.records:
            if rec.get("event") in CUTS:
                cut = rec["step"]
                by_step = {s: r for s, r in by_step.items() if s <= cut}
            elif "event" not in rec:
                by_step[rec["step"]] = rec
        return [by_step[s] for s in sorted(by_step)]

    def events(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "event" in r]


class History:
    """The append-only ``.loss.json`` of a run: one JSON line per record, never rewritten.

    A torn last line (a crash mid-append) is terminated before the next record, so readers
    can skip it; ``read`` gives the canonical one-record-per-step view (spec/RUN.md §4). Appends
    are whole lines from any thread (a background save records what it is about to commit).

    Examples:
        >>> from ckptfmt.run import History
        >>> history = History(".loss.json")
        >>> history.append({"step": 1, "loss": 0.9})
        >>> history.append({"step": 2, "loss": 0.7})
        >>> history.close()
        >>> History(".loss.json").read().records
        [{'step': 1, 'loss': 0.9}, {'step': 2, 'loss': 0.7}]
    """
    def __init__(self, path: "str | os.PathLike[str]"):
        self.path = os.fspath(path)
        self._fd: int | None = None
        self._lock = threading.RLock()     # opening terminates a torn tail by a write of its own

    def _ensure_open(self) -> int:
        if self._fd is None:
            try:
                self._fd = fsio.open_append(self.path)
            except OSError as exc:
                raise HistoryWriteError(self.path, "opening the loss history to append", exc) from exc
            self._terminate_torn_tail()
        return self._fd

    def _terminate_torn_tail(self) -> None:
        """A torn last line gets its newline, so the next record starts on a line of its own."""
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            self._write(b"\n", "ending its torn last line")

    def append(self, record: dict[str, Any]) -> None:
        """Append one record as strict JSON (a NaN loss is refused: use ``encode_float``). The
        storage refusing it (a full disk) is a ``HistoryWriteError`` naming the file; the part
        of the line that was written is cut off again."""
        line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        self._write(line.encode(), f"appending the record of step {record.get('step')}")

    def _write(self, data: bytes, what: str) -> None:
        with self._lock:
            fd = self._ensure_open()
            size = os.fstat(fd).st_size
            try:
                fsio.write_all(fd, data, self.path)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)        # no torn line of ours left behind
                raise HistoryWriteError(self.path, what, exc) from exc

    def event(self, kind: str, step: int, *, durable: bool = False, **fields: Any) -> None:
        """Append an event record (resume, pivot, fork, signal) at ``step``; ``durable``: fsynced
        before this returns (an event that must precede what it announces, after a power cut too)."""
        self.append({"event": kind, "step": step, "time": time.time(), **fields})
        if durable:
            self.sync()

    def sync(self) -> None:
        """fsync what was appended, so it survives a power cut."""
        if self._fd is not None:
            try:
                fsio.fsync(self._fd, self.path)
            except OSError as exc:
                raise HistoryWriteError(self.path, "fsync of the loss history", exc) from exc

    def close(self) -> None:
        """Close the file (appending again reopens it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def source(self) -> str:
        """What the module's readers take (a store's history is a source of its own)."""
        return self.path

    def read(self) -> HistoryRead:
        """Read the whole history (see the module function ``read``)."""
        return read(self.path)


_DECODER = json.JSONDecoder()      # what json.loads uses


def _load(line: bytes) -> Any:
    """``json.loads(line)``, a third faster on the lines a writer appends: one that starts with
    ``{"`` is UTF-8 (``json.detect_encoding``) without leading whitespace, so the scanner starts
    at once; anything else, or anything after the object, is left to ``json.loads`` itself."""
    if line[:2] == b'{"':
        text = line.decode("utf-8", "surrogatepass")
        obj, end = _DECODER.raw_decode(text)
        if end == len(text):
            return obj
    return json.loads(line)


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        rec = _load(line)
    except (ValueError, RecursionError):    # RecursionError: nested too deeply to parse
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
        return None
    return rec


def record_of(line: bytes) -> dict[str, Any] | None:
    """The record a line (without its newline) holds; None for a damaged line, or a blank or
    NUL-filled one (a torn tail)."""
    return _parse(line) if line.strip(b"\0 \r") else None


def _lines(f: BinaryIO, length: int | None) -> Iterator[tuple[int, int, bytes]]:
    """(byte offset, offset of the next line, line without its newline) of each line of the
    first ``length`` bytes from where ``f`` stands (all of them if None), one at a time: what
    ``data.split(b"\\n")`` gives, less a final empty piece."""
    pos = 0
    for raw in f:
        if length is not None and pos + len(raw) > length:
            if length > pos:
                yield pos, length, raw[:length - pos]
            return
        yield pos, pos + len(raw), raw[:-1] if raw.endswith(b"\n") else raw
        pos += len(raw)


def name_of(source: Any) -> str:
    """The history as messages name it: its path, or a store history's ``path`` (its URL)."""
    return source.path if hasattr(source, "read_all") else os.fspath(source)


def opened(source: Any) -> BinaryIO | None:
    """The history's bytes to read once through: its file, or a store history's segments
    joined (``read_all``); None where there is none."""
    if hasattr(source, "read_all"):
        f = io.BytesIO(source.read_all())
        f.name = source.path                 # what a reader's message names (its URL)
        return f
    path = os.fspath(source)
    return open(path, "rb") if os.path.exists(path) else None


@dataclass
class Survey:
    """What one pass over the history found besides the records: how many there are, a torn
    tail (``warnings``) and damage in the middle (``problems``), with their line numbers."""
    path: str
    record_count: int = 0
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def stream(source: "str | os.PathLike[str] | Any", length: int | None = None,
           survey: Survey | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(byte offset, record) of every complete record in file order, one line in memory at a
    time; a torn or NUL-filled tail is a warning, damage mid-file a problem, both added to
    ``survey`` as the lines go by (its last-line warning once the stream is exhausted).
    ``length``: read only that prefix (``complete_length`` while a writer appends). ``source``:
    the history's path, or a history on a store (``segments.SegmentedHistory``)."""
    path = name_of(source)
    survey = Survey(path) if survey is None else survey
    f = opened(source)
    if f is None:
        return
    last_bad, count = None, 0
    with f:
        for i, (offset, _, raw) in enumerate(_lines(f, length)):
            count = i + 1
            rec = record_of(raw)
            if rec is None:
                last_bad = i
                continue
            if last_bad == i - 1 and rec.get("event") == "resume":
                survey.warnings.append(f"{path}: line {i}: torn line before a resume marker (recovered)")
            elif last_bad == i - 1:
                survey.problems.append(f"{path}: line {last_bad + 1}: corrupt record in the middle of the history")
            survey.record_count += 1
            yield offset, rec
    if last_bad is not None and last_bad == count - 1:
        survey.warnings.append(f"{path}: line {count}: torn last line ignored")


def read(path: "str | os.PathLike[str]", length: int | None = None) -> HistoryRead:
    """Every complete record in memory (small histories and tests; a run's tools use ``survey``
    or ``index``, which hold no records); warnings and problems as ``stream`` finds them."""
    found = Survey(name_of(path))
    records = [rec for _, rec in stream(path, length, found)]
    return HistoryRead(records=records, warnings=found.warnings, problems=found.problems)


def survey(path: "str | os.PathLike[str]", length: int | None = None) -> Survey:
    """Count the records and find the damage, holding one line at a time (``validate``)."""
    found = Survey(name_of(path))
    for _ in stream(path, length, found):
        pass
    return found


@dataclass
class HistoryIndex(Survey):
    """The canonical history (spec/RUN.md §3.4) without its records, for a history in any order
    (``timeline`` reads a forward-only one with less): the steps, ascending (8 bytes a step),
    the byte offset of each one's line unless not asked for (8 bytes a step; ``records`` reads
    them back one at a time). ``events``: (kind, step) of the events of the kinds asked for, in
    file order."""
    length: int | None = None
    steps: array | list = field(default_factory=lambda: array("q"))
    offsets: array | None = field(default_factory=lambda: array("q"))     # None: not kept
    events: list[tuple[str, int]] = field(default_factory=list)
    source: Any = None          # what ``records`` reads back (``opened``): the path, or a store's history

    def __len__(self) -> int:
        return len(self.steps)

    def put(self, step: int, offset: int) -> None:
        """A step record: the last record of a step wins (appending, the common case, is O(1))."""
        steps = self.steps
        if steps and step <= steps[-1]:
            self._put_back(step, offset)
            return
        try:
            steps.append(step)
        except OverflowError:              # a step beyond 64 bits (no trainer writes one): the
            self.steps = list(steps)       # steps are kept as Python ints from here on
            self.steps.append(step)
        if self.offsets is not None:
            self.offsets.append(offset)

    def _put_back(self, step: int, offset: int) -> None:
        """A step at or before the newest one: it replaces that step's record, or goes in between."""
        i = bisect.bisect_left(self.steps, step)
        if self.steps[i] != step:              # a step older than the newest, never seen yet
            try:
                self.steps.insert(i, step)
            except OverflowError:              # as in put
                self.steps = list(self.steps)
                self.steps.insert(i, step)
            if self.offsets is not None:
                self.offsets.insert(i, offset)
        if self.offsets is not None:
            self.offsets[i] = offset

    def cut(self, step: int) -> None:
        """A ``resume`` or ``fork`` at ``step``: records of later steps belong to a lost timeline."""
        i = bisect.bisect_right(self.steps, step)
        del self.steps[i:]
        if self.offsets is not None:
            del self.offsets[i:]

    def records(self, start: int = 0, stop: int | None = None) -> Iterator[dict[str, Any]]:
        """The canonical records ``start:stop`` in step order, read back from their lines one at
        a time (the history is append-only, so the lines indexed are still there)."""
        if self.offsets is None:
            raise ValueError(f"{self.path}: indexed without offsets (index(..., offsets=False))")
        offsets = self.offsets[start:stop]
        if not offsets:                     # nothing to read (the history may not exist at all)
            return
        with opened(self.path if self.source is None else self.source) as f:
            for offset in offsets:
                f.seek(offset)
                raw = f.readline() if self.length is None else f.readline(self.length - offset)
                rec = _parse(raw[:-1] if raw.endswith(b"\n") else raw)
                if rec is None:
                    raise HistoryCorruptError(self.path, f"the record at byte {offset} changed while it was read")
                yield rec


def index(path: "str | os.PathLike[str]", length: int | None = None, *,
          events: tuple[str, ...] = (), offsets: bool = True) -> HistoryIndex:
    """The canonical history of ``path`` in one pass, holding one line at a time: the same steps
    in the same order as ``read(path).canonical()``, and (``offsets``) where each one's line
    is, for ``records``."""
    found = HistoryIndex(name_of(path), length=length, offsets=array("q") if offsets else None, source=path)
    for offset, rec in stream(path, length, found):
        if "event" not in rec:
            found.put(rec["step"], offset)
            continue
        kind = rec["event"]
        if kind in events:
            found.events.append((kind, rec["step"]))
        if kind in CUTS:
            found.cut(rec["step"])
    return found


def complete_length(path: "str | os.PathLike[str]") -> int:
    """Bytes of the history up to and including its last newline: the prefix a reader copies
    while a writer appends (what follows may be an append in progress, spec/RUN.md §5.3)."""
    with open(path, "rb") as f:
        pos = os.fstat(f.fileno()).st_size
        while pos > 0:
            start = max(0, pos - (1 << 16))
            f.seek(start)
            cut = f.read(pos - start).rfind(b"\n")
            if cut >= 0:
                return start + cut + 1
            pos = start
    return 0
