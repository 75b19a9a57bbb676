"""Commits generations of a model + optimizer, synchronously or in the background (the
checkpoint manager's and the reference trainer's one writer).

Asynchronous mode: the step loop pays only for a snapshot of weights, m and v into reused
float32 host buffers (one multi-threaded ``torch.cat`` per region for float32 CPU tensors; one
``copy_`` per tensor otherwise, which widens bf16/fp16 and works from any device); hashing,
writing, fsync, commit and what follows run on a thread. At most one save is in flight; the next
save (and ``wait``) waits for it, so a failure is never lost.

Sharded mode (under torchrun): a collective, synchronous save; every rank writes its shard of
weights, m and v and rank 0 commits the manifest (``distributed.save_sharded``).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from .. import format as fmt
from ..run import Run
from ..run.stateside import announcing, commit_regions
from . import adapter, optim, staging
from .distributed import rank_world, save_sharded


class Saver:
    """One writer of a run's generations; ``save`` then ``wait``."""

    def __init__(self, run: Run, *, asynchronous: bool = False, sharded: bool = False,
                 after_commit: Callable[[int, dict[str, Any]], None] | None = None,
                 intent: Callable[[int, str], None] | None = None):
        """``intent(step, root)``: records, durably, the root digest of the generation about to
        be committed, before its manifest is written (on the saving thread: spec/RUN.md §3.7)."""
        self.run = run
        self.asynchronous = asynchronous and not sharded
        self.sharded = sharded
        self.after_commit = after_commit
        self.intent = intent
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: list[np.ndarray] | None = None
        self._then: list[Callable[[], None]] = []    # what waits on the save in flight's commit
        self.last_stall_s = 0.0

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             manifest: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        """Commit generation ``step``; ``extra`` tensors go to its companion file."""
        started = time.perf_counter()
        self.wait()
        if self.sharded:
            self._commit_sharded(step, model, optimizer, manifest, extra)
            self.last_stall_s = time.perf_counter() - started
            return
        params = list(model.parameters())
        ms, vs, _ = optim.moments(params, optimizer, step)
        n = sum(p.numel() for p in params)
        if self.asynchronous:
            regions = self._snapshot((params, ms, vs), n)
            self._thread = threading.Thread(target=self._background, name="ckptfmt-save",
                                            args=(step, regions, n, manifest, extra))
            self._thread.start()
        else:
            stager = staging.Stager()   # this save's staging pair (spec/FORMAT.md §5.7.2)
            regions = [adapter.chunks((t.detach().float() for t in ts), stager) for ts in (params, ms, vs)]
            self._commit(step, regions, n, manifest, extra)
        self.last_stall_s = time.perf_counter() - started

    def _snapshot(self, groups: tuple[list[torch.Tensor], ...], n: int) -> list[np.ndarray]:
        if self._buffers is None or self._buffers[0].size != n:
            self._buffers = [np.zeros(n, dtype=fmt.DTYPE) for _ in range(3)]   # touched now, not in a stall
        threads = torch.get_num_threads()
        torch.set_num_threads(max(2, threads))   # a copy is exact whatever the thread count
        try:
            for buf, tensors in zip(self._buffers, groups):
                _copy_into(torch.from_numpy(buf), tensors)
        finally:
            torch.set_num_threads(threads)
        return self._buffers

    def _background(self, *args: Any) -> None:
        try:
            self._commit(*args)
        except BaseException as exc:  # surfaced by wait() in the training thread
            self._error = exc

    def _commit(self, step: int, regions: list[Any], n: int, manifest: dict[str, Any],
                extra: dict[str, Any] | None) -> None:
        commit_regions(self.run, step, regions, n, manifest, extra, intent=self.intent,
                       after_commit=self.after_commit)

    def _commit_sharded(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        manifest: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        if rank_world()[0] == 0 and self.intent is None:
            self.run.history.sync()   # as in _commit: the history first, then the commit marker
        save_sharded(self.run, step, model, optimizer, manifest, announcing(self.intent, step), extra or None)
        if self.after_commit is not None:
            self.after_commit(step, manifest)

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` (in the caller's thread: the history is written by one thread) once
        the newest save is committed: now when it is, else at the ``poll`` or ``wait`` that
        finds it committed; never if it fails (a history event only for what happened)."""
        if self._thread is None:
            action()
        else:
            self._then.append(action)

    def poll(self) -> None:
        """Run what waits on a background save that has finished (its failure stays for ``wait``)."""
        if self._thread is not None and not self._thread.is_alive():
            self._finish()

    def wait(self) -> None:
        """Block until the save in flight is committed; re-raise its failure here."""
        if self._thread is not None:
            self._finish()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _finish(self) -> None:
        assert self._thread is not None
        self._thread.join()
        self._thread = None
        actions, self._then = self._then, []
        if self._error is None:
            for action in actions:
                action()


def _copy_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Concatenate ``tensors`` into the float32 host tensor ``flat``."""
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        torch.cat([t.detach().reshape(-1) for t in tensors], out=flat)   # one threaded pass
        return
    offset = 0
    for t in tensors:                   # widens bf16/fp16; copies from any device
        flat[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
        offset += t.numel()
