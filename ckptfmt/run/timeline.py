"""The canonical history (spec/RUN.md §3.4) in step order, holding a few numbers per resume.

Why: ``history.index`` keeps every canonical step (8 bytes a step, and 8 more for where its line
is), which at a few million steps passes 100 MB for two runs. A trainer's history has a simpler
shape: between two ``resume`` (or ``fork``) events its steps only go forward. Such a history is
a stack of *segments*, byte ranges of the file whose records are canonical up to a last step, so
one pass finds the segments (a resume at S drops the segments that start after S and lowers the
last step of the one it cuts into) and a second pass reads the records back, segment by segment,
already in step order. Memory is a few numbers per resume, at any length.

The first pass reads the step of a line as the trainer writes it (``{"step":N,...}``) without
parsing the line (half the cost of that pass); every other line is parsed. The second pass parses
the lines it yields, so a line the first pass took for a record and is not one (a torn append, a
damaged line) is found there if it matters, and the history is then planned again, parsing every
line; the line that gives the last step is checked in the first pass already (``last_step`` is
exact before any record is read). A history that steps back without a resume (a step written twice, or out of order: not
what a trainer writes, but legal, §3.4) is read through ``history.index``, which sorts any order.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator

from ..errors import HistoryCorruptError
from . import history as hist


@dataclass
class Segment:
    """Records in bytes ``start:end`` of the file, steps ascending; canonical up to ``last``."""
    start: int
    end: int
    first: int
    last: int
    cut: bool = False          # a resume lowered ``last`` to its step, maybe between two records'
    unparsed: int | None = None   # where the line of step ``last`` starts, if its step was read unparsed


@dataclass
class Timeline:
    """The plan of one pass: the segments in step order (None: the history steps back without a
    resume and is read through ``index``) and the events of the kinds asked for, in file order.
    ``parsed``: every line was parsed in the first pass (no line's step was taken unparsed)."""
    path: str
    length: int | None
    segments: list[Segment] | None
    events: list[tuple[str, int]] = field(default_factory=list)
    parsed: bool = False
    index: hist.HistoryIndex | None = None     # a history that steps back: its steps and lines
    source: Any = None                         # what is read (``history.opened``): the path, or a store's history

    @property
    def forward(self) -> bool:
        """Whether the steps only go forward between resumes (read in two passes, no index)."""
        return self.segments is not None

    @property
    def last_step(self) -> int | None:
        """The last canonical step (None: no records), known before the records are read (a
        chart buckets by it)."""
        if self.segments is None:
            return self.index.steps[-1] if len(self.index) else None
        return self.segments[-1].last if self.segments else None

    def records(self) -> Iterator[dict[str, Any]]:
        """The canonical records in step order, one line in memory at a time."""
        if self.segments is None:
            yield from self.index.records()
            return
        if not self.segments:                  # no records (or no history at all)
            return
        last = None
        try:
            with hist.opened(self.source) as f:
                for seg in self.segments:
                    for rec in _segment_records(f, seg, self.parsed):
                        last = rec["step"]
                        yield rec
        except _Misread:                       # a line taken for a record is none: parse them all
            for rec in plan(self.source, self.length, parse=True).records():
                if last is None or rec["step"] > last:
                    yield rec


class _Misread(Exception):
    """The first pass took a line for a step record and the second found it is not one."""


_RECORD = b'{"step":'


def _step_of(raw: bytes) -> int | None:
    """The step of a line as a writer appends a record (``{"step":N,...}``: one ``"step"`` key,
    first, no ``"event"`` key, no escapes, a closing brace), read without parsing the line; None
    for any other line. That the rest is well-formed is not checked here (``_segment_records``
    does, where it matters)."""
    if (not raw.startswith(_RECORD) or not raw.endswith(b"}") or b"\\" in raw or b'"event"' in raw
            or raw.count(b'"step"') != 1):
        return None                            # a torn append rarely ends in a brace
    comma = raw.find(b",", 8)
    try:
        return int(raw[8:comma]) if comma > 0 else None
    except ValueError:
        return None


def _segment_records(f: BinaryIO, seg: Segment, parsed: bool) -> Iterator[dict[str, Any]]:
    """The step records of one segment up to its last canonical step (events and damaged lines
    are passed over); ``_Misread`` where a line the first pass took for a record unparsed (not
    ``parsed``) is none. (A line that parses as a record has the step ``_step_of`` reads.)
    ``HistoryCorruptError`` where the segment's bytes are no longer all there (the history is
    append-only: a shorter file was cut or replaced, and its records would be lost silently)."""
    f.seek(seg.start)
    end = 0
    for _, end, raw in hist._lines(f, seg.end - seg.start):
        rec = hist.record_of(raw)
        if rec is None:
            taken = None if parsed else _step_of(raw)
            if taken is not None and taken <= seg.last:
                raise _Misread
            continue
        if "event" in rec:
            continue
        if rec["step"] > seg.last:
            return
        yield rec
    if end != seg.end - seg.start:         # shorter than planned: not appended to, cut or replaced
        raise HistoryCorruptError(f.name, f"the history changed while it was read (bytes {seg.start}:{seg.end} "
                                  f"of its plan end at byte {seg.start + end})")


def plan(path: "str | os.PathLike[str]", length: int | None = None, *,
         events: tuple[str, ...] = (), parse: bool = False) -> Timeline:
    """One pass over the history: its segments and the events of the kinds in ``events`` as
    (kind, step) in file order. A history that steps back without a resume gets no segments
    (``forward`` is False) and is read through ``history.index``. ``parse``: parse every line
    (what ``records`` falls back to when a line's step was misread, and ``plan`` itself when the
    last segment's last step cannot be known exactly otherwise: see ``_last_is_exact``)."""
    source = path if hasattr(path, "read_all") else os.fspath(path)    # a store's history: its segments
    timeline = Timeline(hist.name_of(source), length, [], parsed=parse, source=source)
    segments: list[Segment] = []
    open_seg: Segment | None = None            # the segment records are appended to
    f = hist.opened(source)
    if f is None:
        return timeline
    with f:
        for offset, end, raw in hist._lines(f, length):
            step = None if parse else _step_of(raw)
            taken = step is not None
            if step is None:
                rec = hist.record_of(raw)
                if rec is None:
                    continue
                if "event" in rec:
                    _event(timeline, segments, rec, events)
                    open_seg = None if rec["event"] in hist.CUTS else open_seg
                    continue
                step = rec["step"]
            if segments and step <= segments[-1].last:
                return _stepping_back(source, length, events)
            if open_seg is None:
                open_seg = Segment(offset, end, step, step)
                segments.append(open_seg)
            open_seg.end, open_seg.last, open_seg.unparsed = end, step, offset if taken else None
        if segments and not _last_is_exact(f, segments[-1], parse):
            return plan(source, length, events=events, parse=True)
    timeline.segments = segments
    return timeline


def _last_is_exact(f: BinaryIO, seg: Segment, parsed: bool) -> bool:
    """Make the last segment's ``last`` the last canonical step, known before any record is read
    back (a chart buckets by it); False where a line was misread (plan again, parsing all).

    Where a resume cut the segment (the history ends in it), ``last`` is the resume's step, which
    may lie above every record left: the segment is read once more for its last record's step.
    Else ``last`` is the step of the segment's last line, which is parsed if its step was read
    unparsed (a damaged last line of step 10^8 drew the whole history in one bucket)."""
    if seg.cut:
        last = seg.last
        try:
            for rec in _segment_records(f, seg, parsed):
                last = rec["step"]
        except _Misread:
            return False
        seg.last, seg.cut = last, False
        return True
    if seg.unparsed is None:
        return True
    f.seek(seg.unparsed)
    raw = f.read(seg.end - seg.unparsed)
    rec = hist.record_of(raw[:-1] if raw.endswith(b"\n") else raw)
    return rec is not None and "event" not in rec and rec["step"] == seg.last


def _event(timeline: Timeline, segments: list[Segment], rec: dict[str, Any], events: tuple[str, ...]) -> None:
    """An event line: noted if asked for; a resume, fork or start at S cuts the segments at S (those
    that start after S are lost, the one it cuts into ends at S; their lines stay in the file)."""
    kind, step = rec["event"], rec["step"]
    if kind in events:
        timeline.events.append((kind, step))
    if kind not in hist.CUTS:
        return
    while segments and segments[-1].first > step:
        segments.pop()
    if segments and segments[-1].last > step:
        segments[-1].last, segments[-1].cut = step, True


def _stepping_back(source: Any, length: int | None, events: tuple[str, ...]) -> Timeline:
    """The plan of a history that is not forward-only: no segments; its index (16 bytes a
    step: ``records`` reads the lines back by their offsets) and the events of that pass."""
    found = hist.index(source, length, events=events)
    return Timeline(hist.name_of(source), length, None, events=found.events, parsed=True, index=found, source=source)


def canonical(path: "str | os.PathLike[str]", length: int | None = None) -> Iterator[dict[str, Any]]:
    """The canonical records of ``path`` in step order (``plan(...).records()``)."""
    return plan(path, length).records()
