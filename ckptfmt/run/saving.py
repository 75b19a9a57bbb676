"""Save decisions (spec/RUN.md §5.5): when a loop commits a generation, besides the signals.

A ``SavePolicy`` is a small immutable value, composed like the retention ``Policy``: a step is
saved if ANY rule asks for it. ``SaveClock`` keeps what the rules need between steps (the
time of the newest save, the best value of the metric so far); the loop's owner (the checkpoint
manager) agrees on the answer with the other ranks, so every rank saves at the same step.

>>> clock = SaveClock(SavePolicy(every=100, every_seconds="30m", on_best="val_loss"))
>>> clock.due(50, {"val_loss": 2.0}, now=10.0), clock.due(60, {"val_loss": 2.5}, now=20.0)
(['best val_loss'], [])
>>> clock.due(100, {}, now=30.0), clock.due(101, {"val_loss": float("nan")}, now=1810.0)
(['cadence'], ['interval'])
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from . import history as hist
from .retention import MODES, ordering, parse_duration

__all__ = ["SavePolicy", "SaveClock", "best_in_history", "best_of"]


@dataclass(frozen=True)
class SavePolicy:
    """When to save: ``every`` N steps (``cadence``), ``every_seconds`` of wall time since the
    newest save or the first step (seconds or a duration such as ``"30m"``; ``interval``), and
    on a new best value of the metric ``on_best`` (``mode`` min or max; better by more than
    ``min_delta``; NaN and inf are never best; ``best NAME``). ``None`` turns a rule off; the
    signals (SIGUSR1, SIGTERM) save whatever it says.

    Examples:
        >>> from ckptfmt.run import SavePolicy
        >>> policy = SavePolicy(every=1000, every_seconds="30m", on_best="val_loss")
        >>> policy.every_seconds
        1800
    """

    every: int | None = None
    every_seconds: int | str | None = None      # seconds once made
    on_best: str | None = None
    mode: str = "min"
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.every_seconds, str):
            object.__setattr__(self, "every_seconds", parse_duration(self.every_seconds))
        for name in ("every", "every_seconds"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
        if self.on_best is not None and (not isinstance(self.on_best, str) or not self.on_best):
            raise ValueError(f"on_best must name a metric, got {self.on_best!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")
        if _finite(self.min_delta) is None or self.min_delta < 0:
            raise ValueError(f"min_delta must be a finite number of at least 0, got {self.min_delta!r}")

    def to_json(self) -> dict[str, Any]:
        """The rules that are on, as the run's policy sidecar records them (spec/RUN.md §5.6)."""
        doc = {k: getattr(self, k) for k in ("every", "every_seconds", "on_best") if getattr(self, k) is not None}
        if self.on_best is not None:
            doc["mode"] = self.mode
            if self.min_delta:
                doc["min_delta"] = self.min_delta
        return doc


def better(value: float, than: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether the finite ``value`` beats ``than`` (None: nothing yet) under ``mode`` by more
    than ``min_delta``."""
    return than is None or ordering(mode) * (than - value) > min_delta


def best_of(values: Iterable[Any], mode: str) -> float | None:
    """The best finite number among ``values`` (others are skipped), None if there is none."""
    best = None
    for value in values:
        number = _finite(value)
        if number is not None and better(number, best, mode):
            best = number
    return best


def _finite(value: Any) -> float | None:
    """``value`` as a finite float; None for NaN, inf and what is no number (a string is none,
    as in the manifest: the history writes NaN as ``"nan"``)."""
    if isinstance(value, (bool, str)) or value is None:
        return None
    try:
        value = float(value)              # int, float, a NumPy scalar, a one-element tensor
    except (TypeError, ValueError, RuntimeError):
        return None
    return value if math.isfinite(value) else None


class SaveClock:
    """What the rules of a ``SavePolicy`` remember between steps: the time of the newest save
    (on a monotonic clock; the first step's until there is one) and the best value of
    ``on_best`` so far (``best``: e.g. from the history of a resumed run).

    Examples:
        >>> from ckptfmt.run import SaveClock, SavePolicy
        >>> clock = SaveClock(SavePolicy(every=10, on_best="loss"))
        >>> clock.due(1, {"loss": 0.9}, now=0.0), clock.due(2, {"loss": 0.95}, now=1.0), clock.due(10, {"loss": 0.8}, now=2.0)
        (['best loss'], [], ['cadence', 'best loss'])
    """

    def __init__(self, policy: SavePolicy, *, best: float | None = None):
        self.policy, self.best = policy, best
        self.saved_at: float | None = None

    def due(self, step: int, values: Mapping[str, Any], *, now: float) -> list[str]:
        """The rules that ask for a save at ``step`` (``values``: the metrics reported at it),
        in the order cadence, interval, best; the best so far is updated either way."""
        p, reasons = self.policy, []
        if self.saved_at is None:
            self.saved_at = now                 # the interval counts from the first step
        if p.every and step % p.every == 0:
            reasons.append("cadence")
        if p.every_seconds and now - self.saved_at >= p.every_seconds:
            reasons.append("interval")
        if p.on_best is not None and p.on_best in values:
            value = _finite(values[p.on_best])
            if value is not None and better(value, self.best, p.mode, p.min_delta):
                self.best = value
                reasons.append(f"best {p.on_best}")
        return reasons

    def saved(self, now: float) -> None:
        """A generation was committed (for any reason): the interval counts from ``now``."""
        self.saved_at = now


def best_in_history(path: Any, metric: str, mode: str, upto: int) -> float | None:
    """The best finite value of ``metric`` the canonical history (spec/RUN.md §3) holds at or
    before step ``upto``: where a resumed run's ``on_best`` rule goes on from. The canonical steps
    of ``history.index`` (records of a lost timeline, cut by a resume, do not count), then their
    records read back one at a time."""
    canonical = hist.index(path)
    stop = bisect.bisect_right(canonical.steps, upto)
    return best_of((rec.get(metric) for rec in canonical.records(0, stop)), mode)
