"""The checkpoint manager's RAM tier (``memory_every=N``, spec/RUN.md §13).

Every N steps that are not saved durably anyway, the manager commits a generation to the run's
RAM tier (``ckptfmt.run.tiers``: node-local shared memory, keyed by the run's ID) through a
second ``Saver``: the same manifest, the same files, the same atomic commit, into a ``Run`` at
the tier's directory. With ``async_save`` (one process) the RAM saves go to the background too,
after a snapshot of the tensors into the tier's own host buffers: the step loop pays for the
copy, one RAM save is in flight at most, its event is written once it committed, and a process
killed while it is in flight resumes the RAM generation before it. It keeps the newest two there. Under torchrun every
rank writes its shard, at once, and on more than one node sends it to a partner rank on the next
node (``peers``). A RAM generation survives the process
(SIGKILL, an OOM kill, a crash in a collective), not a reboot, and is never acknowledged as
durable: no ``on_commit`` hook, no mirror, no durable retention, no fsync of the history (its
records were written with ``write(2)`` before the commit, so they are in the page cache, which a
process kill does not lose). The history gets a ``checkpoint`` event with ``tier: "memory"``.

A save the tier cannot take (a full tmpfs: ENOSPC, a missing ``/dev/shm``) is said in the log and
skipped, never a failed step: the log says the first failure and when saves work again.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CheckpointError
from ..run import Run, SaveClock, SavePolicy, ramdirs, tiers
from . import peers, refusals
from .distributed import decided_by_rank0, reshard
from .saver import Saver


def check_every(every: int | None) -> None:
    """``memory_every``: None (no RAM tier) or a whole number of at least 1."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"memory_every must be a whole number of at least 1, got {every!r}")


class MemoryTier:
    """The RAM tier of one manager: ``due(step)``, then ``save``."""

    def __init__(self, run: Run, every: int, *, rank: int, world: int, log: Callable[..., None],
                 event: Callable[..., None], asynchronous: bool = False):
        check_every(every)
        self.topology = peers.checked() if world > 1 else peers.topology()   # equal nodes, or refused
        self.run, self.path = run, None     # the tier's directory, known at the first RAM save
        self.rank, self.world, self.log, self.event = rank, world, log, event
        self.clock = SaveClock(SavePolicy(every=every))
        self.asynchronous = asynchronous   # as the durable saves (async_save): one process only
        self._saver: Saver | None = None
        self._skipped = 0                # RAM saves skipped since the last that worked
        self._pending: int | None = None  # the step of the newest RAM save (in flight, one process)

    def due(self, step: int) -> bool:
        """The tier's cadence asks for ``step``; a RAM save that finished in the background is
        settled first (its event written, or its failure said)."""
        self.settle(block=False)
        return "cadence" in self.clock.due(step, {}, now=0.0)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             manifest_of: Callable[[int], tuple[dict[str, Any], dict[str, Any]]]) -> bool:
        """Commit generation ``step`` to RAM (with ``asynchronous``, in one process: in the
        background after a snapshot of the tensors); False (said in the log) when the tier
        refused it."""
        reshard(model)
        manifest, extra = manifest_of(step)
        refusals.strict_json(manifest)             # a refusal of the loop's own state: raised
        self.settle()                              # one RAM save in flight at most
        started, doc = time.perf_counter(), None
        try:
            self._made_again(step)
            if self.world > 1:           # every rank's shard, and a partner's copy on the next node
                doc = peers.save(self._where(), step, model, optimizer, manifest, extra)
                self._prune(step, manifest)
            else:
                if self._saver is None:
                    self._saver = Saver(self._open(), asynchronous=self.asynchronous, after_commit=self._prune,
                                        intent=lambda s, root: self.event("committing", s, tier=tiers.MEMORY,
                                                                          root=root))   # a kill keeps it: no fsync
                self._saver.save(step, model, optimizer, manifest, extra)
        except (CheckpointError, OSError) as exc:
            self._failed(step, exc)
            return False
        stall_ms, self._pending = round((time.perf_counter() - started) * 1e3, 3), step
        if self._saver is not None:
            self._saver.then(lambda: self._committed(step, stall_ms, root=self._saver.run.committed_root(step)))
        else:                            # the manifest's blake3: which RAM generation is this timeline's
            self._committed(step, stall_ms, blake3=(doc or {}).get("blake3"))
        return True

    def settle(self, block: bool = True) -> None:
        """The RAM save in flight (one process): wait for its commit (``block``), or only look
        whether it has finished; its event once committed, its failure said in the log."""
        if self._saver is None:
            return
        try:
            self._saver.wait() if block else self._saver.poll()
        except (CheckpointError, OSError) as exc:
            self._failed(self._pending, exc)

    def _committed(self, step: int, stall_ms: float, **more: Any) -> None:
        if self._skipped:
            self.log(f"RAM tier {self.path}: saves work again at step {step} ({self._skipped} skipped)")
            self._skipped = 0
        self.event("checkpoint", step, reason="cadence", tier=tiers.MEMORY, stall_ms=stall_ms,
                   **{k: v for k, v in more.items() if v is not None})

    def _failed(self, step: int | None, exc: BaseException) -> None:
        if not self._skipped:
            self.log(f"RAM tier {self.path or tiers.memory_root()}: skipped the save of step {step}: {exc}; training "
                     "goes on (the durable generations are unaffected; said again when RAM saves work again)")
        self._skipped += 1

    def _where(self) -> Path:
        """The tier's directory (not made here): the run's ID is written once by the first
        writer (rank 0, which holds the run lock)."""
        if self.path is None:
            self.path = tiers.tier_dir(decided_by_rank0(lambda: tiers.run_id(self.run, create=True)))
        return self.path

    def _open(self) -> Run:
        """The tier's ``Run``, its directory made (a full or missing tmpfs: an ``OSError`` here)."""
        return Run(self._where(), create=True)

    def _made_again(self, step: int) -> None:
        """The tier's directory, with its record of the run (``ramdirs``), made before the RAM
        save; one removed while the run trains (systemd's ``RemoveIPC``, a per-job tmpfs) is made
        again and said, instead of every later RAM save failing."""
        again = self.path is not None and not self.path.exists()
        ramdirs.make(self.run, self._where(), record=self.topology.leader)
        ramdirs.keep(self.path)          # held, so that `ckptfmt ram` never removes it under us
        if again:
            self.log(f"RAM tier {self.path}: its directory was removed while the run trained (RemoveIPC, a "
                     f"per-job tmpfs?); made again at step {step}")

    def _prune(self, step: int, manifest: dict[str, Any]) -> None:
        """The tier's retention after each RAM commit (each node's first rank); a failure is
        only said."""
        if not self.topology.leader or self.path is None:
            return
        try:
            tiers.prune(self.path)
        except (CheckpointError, OSError) as exc:
            self.log(f"RAM tier {self.path}: retention after step {step} failed: {exc}")


def at_close(memory: MemoryTier | None, run: Run, step: int | None, log: Callable[..., None]) -> None:
    """When the manager closes with ``step`` its newest durable generation: the RAM save in
    flight is settled, then (each node's first rank, in its node's tier; with ``memory_every``
    or without it) the RAM generations at or below ``step`` are removed, and the tier's
    directory with the last of them, so a finished run leaves nothing in shared memory that its
    durable tier does not cover (``ramdirs.release``)."""
    if memory is not None:
        memory.settle()
    if step is not None:
        _remove(run, log, lambda: ramdirs.release(run, step), f"up to step {step}",
                f": the durable step {step} covers them")


def forget_after(run: Run, step: int, log: Callable[..., None]) -> bool:
    """After a restore to ``step`` (each node's first rank, in its node's tier): the RAM
    generations newer than it are a lost timeline's, removed so that no later restore mixes the
    two timelines. Then the tier's record names the run where it is now (a run moved between a
    kill and its restart is not taken for an orphan). True when the run has a RAM tier here
    (an ID: made or not; each node's first rank)."""
    _remove(run, log, lambda: tiers.forget_after(run, step), f"after step {step}",
            f" of the timeline after step {step}")
    where = tiers.memory_dir(run) if peers.topology().leader else None
    if where is not None and where.is_dir():
        try:
            ramdirs.claim(run, where)
        except (CheckpointError, OSError) as exc:
            log(f"RAM tier {where}: the record of its run could not be written: {exc}")
    return where is not None


def _remove(run: Run, log: Callable[..., None], remove: Callable[[], list[int]], which: str, why: str) -> None:
    """Each node's first rank removes RAM generations from its node's tier (``remove``: the
    steps it removed), said in the log; a failure is only said."""
    if not peers.topology().leader:
        return
    try:
        gone = remove()
    except (CheckpointError, OSError) as exc:
        log(f"{run.where}: the RAM tier's generations {which} could not be removed: {exc}")
        return
    if gone:
        log(f"{run.where}: removed RAM generations {gone}{why}", info=True)
