"""Mirror a run from inside a training loop, on a background thread (spec/RUN.md §10.13).

``BackgroundMirror(run, url).on_commit`` fits the ``CheckpointManager``'s ``on_commit`` hook: it
only wakes the thread and returns, so the step loop never waits for the network. The thread runs
mirror passes (``tools.mirror``) while there is something new; ``close()`` runs a last pass that
catches up and ends the thread. A pass that fails is logged and retried at the next commit.
``mirror_pass`` replaces the pass (the Lightning callback mirrors a directory of runs with
``mirror_runs``).
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any, Callable

from ..errors import CheckpointError
from ..run import Policy, list_dir, mirrors
from .mirror import mirror
from ..store.objects import redact

__all__ = ["BackgroundMirror"]


class BackgroundMirror:
    """One thread that mirrors ``run_dir`` to ``url`` whenever woken.

    >>> import tempfile; run, there = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> bg = BackgroundMirror(run, f"file://{there}/mirror")
    >>> bg.close()["passes"], bg.lag()
    (1, [])
    """

    def __init__(self, run_dir: "str | os.PathLike[str]", url: str, *, retention: "Policy | None" = None,
                 log: Callable[[str], None] | None = None, mirror_pass: Callable[..., dict[str, Any]] = mirror):
        self.run_dir, self.url, self.mirror_pass = run_dir, url, mirror_pass
        self.options = {"retention": retention} if retention is not None else {}
        self.log = log or (lambda message: warnings.warn(message, stacklevel=2))
        self.passes, self.errors, self.last, self.failed = 0, [], None, False
        self._retries, self._backoff = 0, 1.0
        self._wake, self._closing = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptfmt-mirror", daemon=True)
        self._thread.start()

    def on_commit(self, step: int | None = None, manifest: Any = None) -> None:
        """The manager's ``on_commit`` hook: wake the thread and return at once."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            closing = self._closing.is_set()
            try:    # the first pass reads back what the destination holds; later ones trust it
                self.last = self.mirror_pass(self.run_dir, self.url, recheck=self.passes == 0, **self.options)
                self.failed = False
            except (CheckpointError, OSError) as exc:
                self.errors.append(str(exc))
                self.failed = True
                self.log(f"mirror to {self.url} failed, retried at the next commit: {exc}")
            self.passes += 1
            if closing and self.failed and self._retries > 0:     # close(retries=): once more, later
                self._retries -= 1
                time.sleep(self._backoff)
                self._backoff *= 2
                self._wake.set()
            elif closing:
                return

    def lag(self) -> list[int]:
        """Committed local steps not yet confirmed at the destination (the local record)."""
        committed = [g.step for g in list_dir(self.run_dir).generations if g.committed]
        rows = [r for r in mirrors.lag(self.run_dir, committed) if r["url"] == redact(self.url)]
        return rows[0]["behind"] if rows else committed

    def close(self, timeout: float | None = None, *, retries: int = 0, backoff: float = 1.0) -> dict[str, Any]:
        """A last pass that catches up (a failed one tried again ``retries`` times, after
        ``backoff`` seconds, doubling), then the thread ends; what the mirror did."""
        self._retries, self._backoff = retries, backoff
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout)
        return {"url": redact(self.url), "passes": self.passes, "errors": self.errors, "last": self.last,
                "failed": self.failed}

