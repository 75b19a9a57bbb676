"""Retention policy (spec/RUN.md §5): a pure function; deleting is ``Run.gc``'s separate step."""
from __future__ import annotations

from typing import Iterable


def plan_retention(steps: Iterable[int], *, keep_last: int, keep_every: int | None = None,
                   pinned: Iterable[int] = (), protect: Iterable[int] = ()) -> list[int]:
    """Pure policy: which of ``steps`` to delete. Keeps the last ``keep_last``, every multiple
    of ``keep_every`` (milestones), pinned steps and protected steps (the newest valid).

    >>> plan_retention([100, 200, 300, 400, 500], keep_last=2, keep_every=200)
    [100, 300]
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    ordered = sorted(set(steps))
    keep = set(ordered[-keep_last:]) | set(pinned) | set(protect)
    if keep_every:
        keep |= {s for s in ordered if s % keep_every == 0}
    return [s for s in ordered if s not in keep]
