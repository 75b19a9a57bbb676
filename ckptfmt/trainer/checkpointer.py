"""Commits generations for the trainer, synchronously or in the background.

Asynchronous mode: the step loop pays only for a snapshot of weights, m and v into reused
host buffers; hashing, writing, fsync, commit, sidecars and retention run on a thread. At most
one save is in flight; the next snapshot (and exit) waits for it, so a failure is never lost.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from .. import torch as ct
from ..run import Run


class Checkpointer:
    def __init__(self, run: Run, *, asynchronous: bool = False,
                 after_commit: Callable[[int, dict[str, Any]], None] | None = None):
        self.run = run
        self.asynchronous = asynchronous
        self.after_commit = after_commit
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: list[np.ndarray] | None = None
        self.last_stall_s = 0.0

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             manifest: dict[str, Any]) -> None:
        started = time.perf_counter()
        self.wait()
        if not self.asynchronous:
            w, m, v, n, _ = ct.regions(model, optimizer)
            self._commit(step, w, m, v, n, manifest)
        else:
            w, m, v, n = self._snapshot(model, optimizer)
            self._thread = threading.Thread(target=self._background, name="ckptfmt-save",
                                            args=(step, w, m, v, n, manifest))
            self._thread.start()
        self.last_stall_s = time.perf_counter() - started

    def _snapshot(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        params = list(model.parameters())
        ms, vs, _ = ct.moments(model, optimizer)
        n = sum(p.numel() for p in params)
        if self._buffers is None or self._buffers[0].size != n:
            self._buffers = [np.empty(n, dtype="<f4") for _ in range(3)]
            for b in self._buffers:
                b.fill(0)   # touch the pages now, not inside the first stall
        threads = torch.get_num_threads()
        torch.set_num_threads(max(2, threads))   # a copy is exact whatever the thread count
        try:
            for buf, tensors in zip(self._buffers, (params, ms, vs)):
                torch.cat([t.detach().reshape(-1) for t in tensors], out=torch.from_numpy(buf))
        finally:
            torch.set_num_threads(threads)
        return (*self._buffers, n)

    def _background(self, *args: Any) -> None:
        try:
            self._commit(*args)
        except BaseException as exc:  # surfaced by wait() in the training thread
            self._error = exc

    def _commit(self, step: int, w: Any, m: Any, v: Any, n: int, manifest: dict[str, Any]) -> None:
        self.run.history.sync()   # history up to this step is durable before the commit marker
        self.run.commit(step, w, m, v, manifest=manifest, n_params=n)
        if self.after_commit is not None:
            self.after_commit(step, manifest)

    def wait(self) -> None:
        """Block until the save in flight is committed; re-raise its failure here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
