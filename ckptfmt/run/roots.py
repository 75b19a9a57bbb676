"""The root digest of each generation a run committed, as its history records it (spec/RUN.md §3.7).

A generation's *root digest* is its manifest's ``seal.blake3`` (spec/FORMAT.md §4.7): it covers
every field of the manifest, and through the payload's digests every byte of the generation. The
event that brings a generation into a run records it: ``checkpoint`` (a writer committed it),
``fork`` (the child's first generation), ``import`` (a run restored from a mirror), ``convert``
(a conversion into the run directory). A generation whose manifest is not the one the history's
newest such record names for its step was swapped in from another run or timeline (or the record
was damaged): latest-valid passes over it and ``validate`` calls it damaged.

The newest record of a step wins; one without a root unrecords the step. A record is never
dropped by a resume at an earlier step. The checkpoint manager records what it is about to
commit (``committing``, durably, before the manifest is written), so a kill between the commit
and its ``checkpoint`` event leaves the new generation recorded; ``Run.commit`` called on its
own vouches for what it committed (``Run.vouch``) until its caller's event. A step without a
record (a generation older than the records, a manifest without a seal) is not checked here.

>>> import tempfile, os
>>> run = tempfile.mkdtemp()
>>> from ckptfmt.run.history import History
>>> h = History(os.path.join(run, ".loss.json"))
>>> h.append({"step": 1, "loss": 2.0}); h.event("checkpoint", 1, root="a" * 64); h.event("fork", 1, root="b" * 64); h.close()
>>> recorded(os.path.join(run, ".loss.json")) == {1: "b" * 64}
True
"""
from __future__ import annotations

import os
import stat
from typing import Any, BinaryIO

from .. import format as fmt
from .. import manifest as mf
from ..errors import CheckpointError
from ..generation import Generation
from . import history as hist

FIELD = "root"
EVENTS = frozenset({"committing", "checkpoint", "fork", "import", "convert"})   # what brings a generation in
_KEY = b'"event":"'                       # how every writer spells an event line (compact JSON)
CHUNK = 8 << 20


def of(doc: dict[str, Any] | None) -> str | None:
    """The root digest of a manifest: its seal's ``blake3``; None for one without a seal."""
    seal = (doc or {}).get("seal")
    return seal.get("blake3") if isinstance(seal, dict) and isinstance(seal.get("blake3"), str) else None


def of_generation(gen: Generation) -> str | None:
    """The root digest of a committed generation's manifest (read and checked against its seal)."""
    return of(gen.read_manifest())


def of_step(run: "str | os.PathLike[str]", step: int) -> str | None:
    """The root digest of generation ``step`` of the run directory ``run``, as a writer that has
    just committed it records it; None where its manifest cannot be read (nothing recorded)."""
    try:
        return of(mf.read(os.path.join(run, fmt.manifest_name(step))))
    except (CheckpointError, OSError):
        return None


def recorded(history: "str | os.PathLike[str] | BinaryIO", length: int | None = None, *,
             tier: str = "disk") -> dict[int, str]:
    """step -> the root digest the newest event that brought that step's generation into
    ``tier`` records (``disk``: the run directory's generations; ``memory``: the RAM tier's,
    spec/RUN.md §13), from a history's path or its bytes as a binary file; ``length``: its first
    bytes only (a live writer's complete lines). A newer such event without a root (a writer
    that records none) leaves the step unrecorded. Only the event lines are parsed (a history of
    a million steps in about a tenth of a second), a damaged one records nothing; a history
    that is not there, not a regular file or not readable records nothing (validate reports it)."""
    if not isinstance(history, (str, os.PathLike)):
        data = history.read() if length is None else history.read(length)
        out: dict[int, str] = {}
        _scan(data, len(data), tier, out)
        return out
    try:
        fd = os.open(history, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return {}
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return {}                          # a FIFO or a directory: never waited on
        return _read(fd, info.st_size if length is None else min(length, info.st_size), tier)
    except OSError:
        return {}
    finally:
        os.close(fd)


def _read(fd: int, size: int, tier: str) -> dict[int, str]:
    """``recorded`` of the first ``size`` bytes of an open history, read in chunks (``pread``:
    a history cut while it is read only ends early)."""
    out: dict[int, str] = {}
    carry, at = b"", 0
    while at < size:
        chunk = os.pread(fd, min(CHUNK, size - at), at)
        if not chunk:
            break
        at += len(chunk)
        data = carry + chunk
        cut = data.rfind(b"\n") + 1 if at < size else len(data)
        _scan(data, cut, tier, out)
        carry = data[cut:]
    return out


def _scan(data: bytes, size: int, tier: str, out: dict[int, str]) -> None:
    """The event lines among the first ``size`` bytes of ``data`` (whole lines) into ``out``."""
    at = data.find(_KEY, 0, size)
    while at >= 0:
        start = data.rfind(b"\n", 0, at) + 1
        end = data.find(b"\n", at, size)
        end = size if end < 0 else end
        rec = hist.record_of(data[start:end].rstrip(b"\r"))
        if rec is not None and rec.get("event") in EVENTS and rec.get("tier", "disk") == tier:
            if isinstance(rec.get(FIELD), str):
                out[rec["step"]] = rec[FIELD]
            else:
                out.pop(rec["step"], None)
        at = data.find(_KEY, end, size)


def mismatch(gen: Generation, roots: dict[int, str]) -> str | None:
    """Why ``gen`` is not the generation its run committed at its step (its root digest differs
    from the one the history records, or its manifest has no seal where a sealed one was
    committed); None when it is, or nothing is recorded for the step."""
    if roots.get(gen.step) is None or gen.manifest is None:
        return None
    try:
        got = of_generation(gen)
    except (CheckpointError, OSError):
        return None                            # unreadable: the generation's own check says why
    return differs(gen.step, got, roots)


def differs(step: int, got: str | None, roots: dict[int, str]) -> str | None:
    """Why a manifest of root digest ``got`` (None: no seal) is not the generation the run
    committed at ``step``; None when it is, or nothing is recorded for the step."""
    want = roots.get(step)
    if want is None or got == want:
        return None
    have = "has no seal" if got is None else f"has root digest {got[:16]}..."
    return (f"not the generation this run committed at step {step}: its manifest {have}, the "
            f"history records {want[:16]}... (swapped in from another run or timeline, or the "
            "history's record is damaged)")


def record(run: "str | os.PathLike[str]", kind: str, step: int, **fields: Any) -> bool:
    """Append to the run's history that ``kind`` (an ``EVENTS`` kind) brought generation
    ``step`` in, with its root digest, durably; False where the run has no history (no record
    there can name another generation for the step)."""
    path = os.path.join(run, hist.NAME)
    if not os.path.exists(path):
        return False
    history = hist.History(path)
    try:
        history.event(kind, step, **{FIELD: of_step(run, step), **fields})
        history.sync()
    finally:
        history.close()
    return True
