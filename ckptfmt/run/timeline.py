"""The canonical history (spec/RUN.md §3.4) in step order, holding a few numbers per resume.

Why: ``history.index`` keeps every canonical step (8 bytes a step and more per field), which at
a few million steps passes 100 MB for two runs. A trainer's history has a simpler shape: between
two ``resume`` (or ``fork``) events its steps only go forward. Such a history is a stack of
*segments*, byte ranges of the file whose records are canonical up to a last step, so one pass
finds the segments (a resume at S drops the segments that start after S and lowers the last step
of the one it cuts into) and a second pass reads the records back, segment by segment, already in
step order. Memory is a few numbers per resume, at any length; the time is two passes.

A history that steps back without a resume (a step written twice, or out of order: not what a
trainer writes, but legal, §3.4: the last record of a step wins) is read through
``history.index`` instead, which sorts any order, at its cost per step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from . import history as hist


@dataclass
class Segment:
    """Records in bytes ``start:end`` of the file, steps ascending; canonical up to ``last``."""
    start: int
    end: int
    first: int
    last: int


@dataclass
class Timeline:
    """The plan of one pass: the segments in step order (None: the history steps back without a
    resume and is read through ``index``), the events of the kinds asked for, and what the pass
    found wrong (``survey``: torn tail, damage in the middle)."""
    path: str
    length: int | None
    segments: list[Segment] | None
    events: list[tuple[str, int]] = field(default_factory=list)
    survey: hist.Survey | None = None

    stepped_back_last: int | None = None      # the last step, for a history read through index

    @property
    def last_step(self) -> int | None:
        """The last canonical step (None: no records), or above it where the history ends in a
        resume that cut its last segment between two records' steps (a bound, as for a chart)."""
        if self.segments is None:
            return self.stepped_back_last
        return self.segments[-1].last if self.segments else None

    @property
    def forward(self) -> bool:
        """Whether the steps only go forward between resumes (read in two passes, no index)."""
        return self.segments is not None

    def records(self) -> Iterator[dict[str, Any]]:
        """The canonical records in step order, one line in memory at a time."""
        if self.segments is None:
            yield from hist.index(self.path, self.length).records()
            return
        if not self.segments:
            return
        with open(self.path, "rb") as f:
            for seg in self.segments:
                yield from _segment_records(f, seg)


def _segment_records(f: Any, seg: Segment) -> Iterator[dict[str, Any]]:
    """The step records of one segment up to its last canonical step (events and damaged lines,
    already reported by the first pass, are passed over)."""
    f.seek(seg.start)
    for _, _, raw in hist._lines(f, seg.end - seg.start):
        rec = hist._parse(raw) if raw.strip(b"\0 \r") else None
        if rec is None or "event" in rec:
            continue
        if rec["step"] > seg.last:
            return
        yield rec


def plan(path: "str | os.PathLike[str]", length: int | None = None, *,
         events: tuple[str, ...] = ()) -> Timeline:
    """One pass over the history: its segments, the events of the kinds in ``events`` as
    (kind, step) in file order, and the survey. A history that steps back without a resume gets
    no segments (``forward`` is False) and is read through ``history.index``."""
    path = os.fspath(path)
    found = hist.Survey(path)
    timeline = Timeline(path, length, [], survey=found)
    segments: list[Segment] = []
    open_seg: Segment | None = None            # the segment records are appended to
    for offset, end, rec in hist.positioned(path, length, found):
        if "event" not in rec:
            step = rec["step"]
            if segments and step <= segments[-1].last:
                return _stepping_back(path, length, events)
            if open_seg is None:
                open_seg = Segment(offset, end, step, step)
                segments.append(open_seg)
            open_seg.end, open_seg.last = end, step
            continue
        kind, step = rec["event"], rec["step"]
        if kind in events:
            timeline.events.append((kind, step))
        if kind in ("resume", "fork"):
            _cut(segments, step)
            open_seg = None
    timeline.segments = segments
    return timeline


def _cut(segments: list[Segment], step: int) -> None:
    """A resume or fork at ``step``: segments that start after it are lost, the one it cuts into
    ends at it (its records after ``step`` stay in the file, outside the canonical history)."""
    while segments and segments[-1].first > step:
        segments.pop()
    if segments and segments[-1].last > step:
        segments[-1].last = step


def _stepping_back(path: str, length: int | None, events: tuple[str, ...]) -> Timeline:
    """The plan of a history that is not forward-only: no segments; the events and survey of
    a pass of ``history.index`` (which ``records`` then does again, with offsets)."""
    found = hist.index(path, length, events=events, offsets=False)
    survey = hist.Survey(path, found.record_count, found.warnings, found.problems)
    return Timeline(path, length, None, events=found.events, survey=survey,
                    stepped_back_last=found.steps[-1] if len(found) else None)


def canonical(path: "str | os.PathLike[str]", length: int | None = None) -> Iterator[dict[str, Any]]:
    """The canonical records of ``path`` in step order (``plan(...).records()``)."""
    return plan(path, length).records()
