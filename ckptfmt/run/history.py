"""The loss history ``.loss.json`` (spec/RUN.md §3): one JSON object per line, append-only.

Why JSON lines: an append is one ``write`` of one line, O(1) at 200,000 entries, and a torn
append damages only the last line. The file is never archived and never rewritten. After a
crash the trainer appends a ``resume`` event; records of steps past the resumed step are kept
(nothing is deleted) but leave the canonical history, where the last record of a step wins.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from .. import fsio
from ..errors import HistoryCorruptError

NAME = ".loss.json"


def encode_float(x: float) -> float | str:
    """NaN and infinities are written as the strings 'nan', 'inf', '-inf' (JSON has no NaN)."""
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def decode_float(x: float | str) -> float:
    return float(x)


@dataclass
class HistoryRead:
    records: list[dict[str, Any]] = field(default_factory=list)   # every parsed line, in order
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)             # corruption in the middle

    def canonical(self) -> list[dict[str, Any]]:
        """Exactly one record per step: resume events cut lost timelines, last writer wins."""
        by_step: dict[int, dict[str, Any]] = {}
        for rec in self.records:
            if rec.get("event") in ("resume", "fork"):
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
    can skip it; ``read`` gives the canonical one-record-per-step view (spec/RUN.md §4).
    """
    def __init__(self, path: "str | os.PathLike[str]"):
        self.path = os.fspath(path)
        self._fd: int | None = None

    def _ensure_open(self) -> int:
        if self._fd is None:
            self._fd = fsio.open_append(self.path)
            self._terminate_torn_tail()
        return self._fd

    def _terminate_torn_tail(self) -> None:
        """A torn last line gets its newline, so the next record starts on a line of its own."""
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            fsio.write_all(self._fd, b"\n", self.path)

    def append(self, record: dict[str, Any]) -> None:
        """Append one record as strict JSON (a NaN loss is refused: use ``encode_float``)."""
        line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        fsio.write_all(self._ensure_open(), line.encode(), self.path)

    def event(self, kind: str, step: int, **fields: Any) -> None:
        """Append an event record (resume, pivot, fork, signal) at ``step``."""
        self.append({"event": kind, "step": step, "time": time.time(), **fields})

    def sync(self) -> None:
        """fsync what was appended, so it survives a power cut."""
        if self._fd is not None:
            fsio.fsync(self._fd, self.path)

    def close(self) -> None:
        """Close the file (appending again reopens it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read(self) -> HistoryRead:
        """Read the whole history (see the module function ``read``)."""
        return read(self.path)


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
        return None
    return rec


def read(path: "str | os.PathLike[str]", length: int | None = None) -> HistoryRead:
    """Every complete record; a torn or NUL-filled tail is a warning, damage mid-file a problem.
    ``length``: read only that prefix (``complete_length`` while a writer appends)."""
    path = os.fspath(path)
    out = HistoryRead()
    if not os.path.exists(path):
        return out
    with open(path, "rb") as f:
        lines = f.read(-1 if length is None else length).split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    bad: list[int] = []
    for i, raw in enumerate(lines):
        rec = _parse(raw) if raw.strip(b"\0 \r") else None
        if rec is None:
            bad.append(i)
            continue
        if bad and bad[-1] == i - 1 and rec.get("event") == "resume":
            out.warnings.append(f"{path}: line {i}: torn line before a resume marker (recovered)")
        elif bad and bad[-1] == i - 1:
            out.problems.append(f"{path}: line {bad[-1] + 1}: corrupt record in the middle of the history")
        out.records.append(rec)
    if bad and bad[-1] == len(lines) - 1:
        out.warnings.append(f"{path}: line {len(lines)}: torn last line ignored")
    return out


def require_intact(path: str) -> HistoryRead:
    result = read(path)
    if result.problems:
        raise HistoryCorruptError(path, result.problems[0].split(": ", 1)[1])
    return result


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
