"""The run's record of its mirrors (spec/RUN.md §10): ``.mirrors.json`` says, per destination
URL, which generations were confirmed at the destination (uploaded, read back, committed there).

Why a local record: ``ls`` reports the lag (generations committed here and not yet confirmed
there) from the run directory alone, without touching the network. Only ``ckptfmt mirror``
writes it; the trainer, ``gc`` and ``pivot`` never do.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Any, Iterator

from .. import atomic
from .sidecars import read_json

NAME = ".mirrors.json"
LOCK = ".mirrors.lock"      # an empty file, kept: its flock orders the record's writers


def read(run_path: "str | os.PathLike[str]") -> dict[str, Any]:
    """``{"destinations": {URL: {"confirmed": {STEP: BLAKE3}, "deleted": [STEP...], ...}}}``."""
    doc = read_json(Path(run_path) / NAME, default=None)
    return doc if isinstance(doc, dict) and isinstance(doc.get("destinations"), dict) else {"destinations": {}}


def record(run_path: "str | os.PathLike[str]", url: str, *, confirmed: dict[int, str] | None = None,
           deleted: list[int] | None = None, kept_out: list[int] | None = None) -> dict[str, Any]:
    """Add confirmed uploads (step -> blake3) and destination deletions for ``url``, durably;
    ``kept_out`` (replaced, not added to): the steps the last pass did not upload because the
    destination's retention would delete them at once."""
    with _one_writer(run_path):
        doc = read(run_path)
        dest = doc["destinations"].setdefault(url, {"confirmed": {}, "deleted": []})
        for step, digest in (confirmed or {}).items():
            dest["confirmed"][str(step)] = digest
        dest["deleted"] = sorted(set(dest.get("deleted", [])) | set(deleted or []))
        if kept_out is not None:
            dest["kept_out"] = sorted(kept_out)
        dest["updated"] = round(time.time(), 3)
        atomic.write_json(Path(run_path) / NAME, doc)
    return doc


@contextlib.contextmanager
def _one_writer(run_path: "str | os.PathLike[str]") -> Iterator[None]:
    """Two mirrors of one run (the trainer's ``--mirror`` and a ``--watch`` to another tier)
    each read, change and replace the record; without an order the later replace drops the
    other's confirmations, and ``ls`` reports that destination behind for ever. The flock is on
    a file of its own: ``.mirrors.json`` itself is replaced, ``.lock`` is the trainer's."""
    fd = os.open(Path(run_path) / LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)                     # closing drops the flock


def lag(run_path: "str | os.PathLike[str]", committed: list[int]) -> list[dict[str, Any]]:
    """Per destination: the local committed ``steps`` not yet confirmed there (less those its
    retention keeps out of it), newest confirmed.

    >>> import tempfile; d = tempfile.mkdtemp()
    >>> _ = record(d, "s3://b/r", confirmed={20: "ab"})
    >>> lag(d, [20, 40])[0]["behind"]
    [40]
    >>> _ = record(d, "s3://b/r", confirmed={40: "cd"}, kept_out=[10])
    >>> lag(d, [10, 20, 40])[0]["behind"]
    []
    """
    rows = []
    for url, dest in sorted(read(run_path)["destinations"].items()):
        confirmed = {int(s) for s in dest.get("confirmed", {})}
        done = confirmed | set(dest.get("kept_out", []))
        rows.append({"url": url, "behind": sorted(s for s in committed if s not in done),
                     "newest_confirmed": max(confirmed, default=None), "updated": dest.get("updated")})
    return rows
