"""``CheckpointManager``: the reference trainer's guarantees in any PyTorch training loop.

    from ckptfmt.torch import CheckpointManager
    mgr = CheckpointManager("runs/x", model, optimizer, scheduler, state={"data": sampler},
                            generators={"noise": np_gen}, every=100, keep_last=3)
    # or the composable policies (spec/RUN.md §5): what to keep, and when to save
    #   retention=Policy(keep_last=2, keep_best=3, metric="val_loss", keep_interval="1h"),
    #   saving=SavePolicy(every=100, every_seconds="30m", on_best="val_loss")
    start = mgr.restore()                  # newest valid generation, everything restored; 0 if fresh
    for step in range(start + 1, total + 1):
        loss = train_step(...)
        if mgr.step(step, loss=loss):      # records the loss; saves on cadence, SIGUSR1, SIGTERM
            break                          # True after SIGTERM/SIGINT: committed, time to exit 0
    mgr.close(step)                        # idempotent: commits `step` unless committed already

What goes where (spec/RUN.md §8): parameters (stored as float32, each tensor's own dtype in the
layout), m and v in the ``.bin``; persistent buffers and every tensor of the loop's state
objects in the generation's companion file; the optimizer's type, step and param groups, the
scheduler, the GradScaler, the JSON-able state, every RNG and the config in the manifest.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Mapping

import torch

from ..errors import CheckpointError, ConfigMismatchError
from ..run import SaveClock, SavePolicy, record_policy, tiers
from ..run.storerun import open_run
from ..run.saving import best_in_history
from ..run import signals as handlers
from ..run.mirror_thread import BackgroundMirror
from . import adapter, optim, ranks, refusals, rng
from . import restore as restoring
from .distributed import reshard
from .memtier import MemoryTier, at_close, forget_after, let_go
from .metrics import MetricsBook, history_value
from .saver import Saver
from .state import persistent_buffers, split

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Saves, retains and restores every piece of a training loop's state in a run directory.

    The run lock is held from construction to ``close()`` (by rank 0 under torchrun; not at all
    with ``lock=False``, when the caller holds it); an optimizer the seed layout cannot hold is
    refused here, before any training step.

    Hooks for a loop with pieces of its own (the reference trainer uses each), all optional:
    ``manifest_fields(step) -> dict`` adds the loop's own fields to every manifest;
    ``on_restore(manifest, path)`` sees a generation's manifest before anything is restored
    (raise a ``CheckpointError`` to refuse it); ``upgrade(manifest) -> manifest`` views
    manifests the loop's earlier versions wrote; ``on_commit(step, manifest)`` runs after
    each commit and retention (on the save thread with ``async_save``); ``log(message)``
    says what the manager decided (default: ``warnings.warn``); ``lock=False`` when the caller holds the run lock.

    ``mirror=URL`` (``s3://bucket/runs/x``, any fsspec URL; the ``remote`` extra) uploads each
    committed generation there on a background thread, verified, with the same retention
    (spec/RUN.md §10); ``close`` waits until the destination has caught up. ``memory_every=N``
    also commits a generation to node-local RAM every N steps between durable ones (spec/RUN.md §13).
    """

    _ram_tier = True     # a RAM tier to clean at close: restore() finds whether the run has one

    def __init__(self, directory: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, scaler: Any = None, *, state: Mapping[str, Any] | None = None,
                 generators: Mapping[str, Any] | None = None, every: Any = refusals.UNSET,
                 keep_last: Any = refusals.UNSET, keep_every: int | None = None, retention: Any = refusals.UNSET,
                 saving: SavePolicy | None = None, async_save: bool = False, memory_every: int | None = None,
                 handle_signals: bool = True, config: Any = None, mirror: str | None = None, **hooks: Any):
        """``directory`` is a run directory (created if needed), a ``Run`` or a URL (a run on
        object storage, spec/RUN.md §2.0.2). ``every`` (default 100) saves every N steps,
        ``every=None`` only on request and at ``close``; ``keep_last`` (default 3) and
        ``keep_every`` are the retention of the last K and every N-th step, ``keep_last=None``
        alone keeps every generation. ``retention=Policy(...)`` instead of them (``retention=None``:
        keep every generation) composes every rule (the best K by a metric, time windows; spec/RUN.md §5.1),
        and ``saving=SavePolicy(...)`` instead of ``every`` saves on a step cadence, on wall time and
        on a new best of a metric (§5.5); the run records both in ``.policy.json`` (§5.6)."""
        optim.kind(optimizer)
        refusals.check_pieces(state, hooks)
        self.retention, self.saving = refusals.policies(every, keep_last, keep_every, retention, saving)
        self._built = refusals.check_params(model, optimizer)     # the parameters' versions now
        refusals.strict_json({"rng": rng.rng_state(generators), "config": config})   # a generator JSON cannot hold
        self.rank, self.world = ranks.check_setup(model, optimizer)
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.state, self.generators, self.config = dict(state or {}), dict(generators or {}), config
        self.manifest_fields, self.on_restore = hooks.get("manifest_fields"), hooks.get("on_restore")
        self.upgrade, self.on_commit = hooks.get("upgrade"), hooks.get("on_commit")
        self._log = hooks.get("log")
        self.run = open_run(directory, create=True)     # a URL: a run on object storage (StoreRun)
        refusals.on_store(self.run, mirror)
        self._stop = self._save_requested = False
        self._stop_reason = "SIGTERM"         # another rank's signal: the one the cluster sends
        self._handlers = handlers.install(self) if handle_signals else None   # before the lock: may raise
        locked = self.rank == 0 and hooks.get("lock", True)
        with handlers.given_back_on_error(self._handlers):   # the lock refused (held, a read-only store)
            self._lock = self.run.writer_lock("checkpoint manager") if locked else None
        self._dropped = handlers.release_when_collected(self, self._lock)
        self._policy_recorded = self.rank != 0        # rank 0 records it at the first step
        self._clock = SaveClock(self.saving)
        self._saver = Saver(self.run, asynchronous=async_save, sharded=self.world > 1, after_commit=self._committed,
                            intent=lambda step, root: self._event("committing", step, root=root, durable=True))
        self._mirror = _start_mirror(self, mirror) if mirror and self.rank == 0 else None
        self._memory = MemoryTier(self.run, memory_every, rank=self.rank, world=self.world, log=self.log,
                                  event=self._event, asynchronous=async_save) if memory_every is not None else None
        self.committed: int | None = None
        self.last_save: tuple[int, str] | None = None      # (step, reason) of the newest save
        self.restored_from = self.restored_tier = None   # restore's generation and its tier (spec/RUN.md §13)
        self.skipped_diverged: str | None = None   # why restore passed newer generations over
        self.fresh: list[str] = []
        self.closed, self._metrics = False, MetricsBook()   # _metrics: the newest given to step()
        self._last_step: int | None = None    # the newest step restored or given to step()
        self._resumed_at: int | None = None
        self._checked = False                 # the run's generations looked at (restore, first step)

    # ------------------------------------------------------------ driving
    def request_save(self) -> None:
        """Commit a generation at the next ``step()`` and continue (what SIGUSR1 does)."""
        self._save_requested = True

    def request_stop(self, reason: str = "SIGTERM") -> None:
        """Commit a generation at the next ``step()``, which then returns True (SIGTERM, SIGINT);
        ``reason`` is what its ``checkpoint`` event records."""
        if not self._stop:
            self._stop_reason = reason
        self._stop = True

    def step(self, step: int, loss: Any = None, **metrics: Any) -> bool:
        """Record step ``step`` in ``.loss.json``; save on cadence or on request. True once a
        stop was requested: the generation is committed and the loop should exit."""
        self._require_open()
        step = refusals.step_of(self.run.where, step)
        self._check_order(step)
        self._saver.poll()                    # a background save that committed: its event now
        record: dict[str, Any] = {"step": step, "time": time.time()}
        values = {**({"loss": loss} if loss is not None else {}), **metrics}
        for key, value in values.items():
            record[key] = history_value(value)
        self._metrics.record(step, values)
        if self.rank == 0:
            self.run.history.append(record)
        self._record_policy()
        due = self._clock.due(step, values, now=time.monotonic())
        # the agreed decision; the local flags are only ever set here, never cleared by the
        # collective, so a signal that lands while it runs counts at the next step. The wall
        # clocks may differ between ranks: any rank's is every rank's save; a new best is rank
        # 0's (the values its history records, where a resumed run's best comes from).
        stop, save, timed, best = ranks.agree(self._stop, self._save_requested, "interval" in due,
                                              self.rank == 0 and any(r.startswith("best ") for r in due))
        if save:
            self._save_requested = False
        self._stop = self._stop or stop
        reason = (self._stop_reason if stop else "SIGUSR1" if save else "cadence" if "cadence" in due
                  else "interval" if timed else f"best {self.saving.on_best}" if best else None)
        if reason and self.committed != step:
            self.save(step, reason)
        elif self._memory is not None and self._memory.due(step) and self.committed != step:
            self._memory.save(step, self.model, self.optimizer, self._manifest)   # RAM: between durable ones
        return stop

    def _record_policy(self) -> None:
        """Rank 0, at the first step of a start that went through: the policies in
        ``.policy.json`` (spec/RUN.md §5.6), for ``ls``. Best effort: a record that cannot be
        written is said in the log, never a failed step."""
        if self._policy_recorded:
            return
        self._policy_recorded = True
        try:
            record_policy(self.run, self.retention, self.saving)
        except (CheckpointError, OSError) as exc:
            self.log(f"the run's policy record was not written: {exc}")

    def _check_order(self, step: int) -> None:
        """Steps go forward from where the run is: a loop that restarts at 1 after ``restore()``,
        or never called it on a run with generations, would replace the history's records of
        those steps and collide with committed generations. Refused before anything is written."""
        last = self._last_step
        if last is not None and step <= last:
            where = "where this run resumed" if last == self._resumed_at else "the last one given to step()"
            raise ConfigMismatchError(str(self.run.where), f"step {step} is not after step {last}, {where}: "
                                      "the loop goes on from restore()'s return (range(start + 1, ...))")
        if not self._checked:
            self._checked = True
            done = [g.step for g in self.run.generations() if g.committed]
            if done and max(done) >= step:
                raise ConfigMismatchError(str(self.run.where), f"step {step}: the run has generations up to "
                                          f"step {max(done)}; call restore() before the loop and go on "
                                          "from the step it returns")
        self._last_step = step

    def save(self, step: int, reason: str = "requested") -> None:
        """Commit generation ``step`` now (asynchronously with ``async_save``); the history's
        ``checkpoint`` event records ``reason`` and how long the loop stalled. Everything that
        cannot be stored is refused here, before a byte is written."""
        self._require_open()
        step = refusals.step_of(self.run.where, step)
        reshard(self.model)                 # FSDP2 after a sample: the optimizer's own tensors
        manifest, extra = self._manifest(step)
        refusals.strict_json(manifest)
        self._saver.save(step, self.model, self.optimizer, manifest, extra)
        self.committed, self.last_save = step, (step, reason)
        self._clock.saved(time.monotonic())
        stall_ms = round(self.stall_s * 1e3, 3)     # recorded once committed (async: later)
        self._saver.then(lambda: self._event("checkpoint", step, reason=reason, stall_ms=stall_ms,
                                             root=self.run.committed_root(step) if self.rank == 0 else None))

    def metric(self, name: str) -> Any:
        """The newest value of the metric ``name`` given to ``step()`` (or recorded by the restored
        generation), as a float with NaN and inf; None if there is none."""
        return self._metrics.value(name)

    @property
    def stall_s(self) -> float:
        """Seconds the loop waited in the newest save (the snapshot only, with ``async_save``)."""
        return self._saver.last_stall_s

    def wait(self) -> None:
        """Block until a save in flight (``async_save``) is committed; re-raise its failure."""
        self._saver.wait()

    def close(self, step: int | None = None) -> None:
        """Commit ``step`` unless it is committed already, wait for a save in flight, release the
        run lock and the signal handlers. Idempotent."""
        if self.closed:
            return
        try:
            if step is not None and self.committed != step:
                self.save(step, "close")
            self._saver.wait()
            at_close(self._memory, self.run, self.committed if self._ram_tier else None,
                     self.log)                 # the RAM tier's save in flight, its leftovers (none: no store call)
        finally:
            self.closed = True
            if self._mirror is not None:
                report = self._mirror.close()          # a last pass: the destination catches up
                if report["errors"]:
                    self.log(f"mirror to {report['url']}: {report['errors'][-1]}")
            self._release()

    def _release(self) -> None:
        """The history closed, the run lock and the signal handlers given back, whatever fails
        (a history the disk refuses to sync is still closed, the lock still released)."""
        try:
            try:
                self.run.history.sync()
            finally:
                self.run.history.close()               # a store's history: its last segment
        finally:
            let_go(self.run)                           # the RAM tier, held since its restore or first RAM save
            try:
                if self._lock is not None:
                    self._lock.release()
            finally:
                handlers.restore(self._handlers)

    def _require_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self.run.where}: the checkpoint manager is closed")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ what is saved
    def _manifest(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        params = list(self.model.parameters())
        opt_step = optim.step_of(params, self.optimizer, step)
        doc: dict[str, Any] = {**adapter.layout_fields(self.model, self.optimizer, opt_step),
                               "rng": rng.rng_state(self.generators), "versions": adapter.versions(),
                               "created": time.time(), "progress": {"step": step}}
        metrics = self._metrics.at(step)
        if metrics:
            doc["metrics"] = metrics
        extra: dict[str, Any] = {}
        doc["buffers"], more = split(persistent_buffers(self.model), "buffers")
        extra.update(more)
        for piece, obj in self.pieces():
            doc_key, name = piece.split(".", 1) if "." in piece else (piece, None)
            tree, more = split(obj.state_dict(), piece)
            extra.update(more)
            if name is None:
                doc[doc_key] = tree
            else:
                doc.setdefault(doc_key, {})[name] = tree
        if self.scheduler is not None:
            doc["scheduler_type"] = optim.scheduler_type(self.scheduler)    # a resume refuses another class
        if self.config is not None:
            doc["config"] = self.config
        ranks.add_ranks(doc, extra)
        for key, value in (self.manifest_fields(step) if self.manifest_fields else {}).items():
            if key in doc:
                raise ValueError(f"manifest_fields: {key!r} is a field the manager writes")
            doc[key] = value
        return doc, extra

    def pieces(self) -> list[tuple[str, Any]]:
        """(name in the manifest, object) of every ``state_dict`` piece the loop gave."""
        out = [("scheduler", self.scheduler)] if self.scheduler is not None else []
        if self.scaler is not None:
            out.append(("amp.scaler", self.scaler))
        return out + [(f"state.{name}", obj) for name, obj in self.state.items()]

    def _committed(self, step: int, manifest: dict[str, Any]) -> None:
        if self.rank == 0:
            names = [m for m in (self.retention.metric if self.retention else None, self.saving.on_best) if m]
            self._metrics.say_unreported(manifest, names, lambda said: self.log(f"{self.run.where}: {said}"))
        if self.rank == 0 and self.retention is not None and not self.retention.keep_all and (deleted := self.run.gc(self.retention)):
            self.log(f"retention deleted steps {deleted}", info=True)
        if self.on_commit is not None:
            self.on_commit(step, manifest)
        if self._mirror is not None:
            self._mirror.on_commit(step, manifest)     # wakes the mirror's thread; returns at once

    # ------------------------------------------------------------ restore
    def restore(self, source: Any = None, *, strict: bool = True, restore_rng: bool = True,
                allow_nonfinite: bool = False, allow_device_change: bool = False) -> int:
        """Restore everything from the newest valid generation of the run (or from the
        generation ``source``, a ``step_NNNNNN.bin`` anywhere or its ``.json`` manifest, a sharded
        generation's manifest: verified first); its step, or 0
        on a fresh run (the order and the checks: ``ckptfmt.torch.restore``).

        Newer generations that diverged (their values, recorded at save, hold NaN or inf) are
        passed over for the newest finite one, and ``log`` says so and why (``skipped_diverged``);
        ``allow_nonfinite=True`` resumes the newest valid generation, diverged or not.

        A piece the loop has but the checkpoint lacks (or the reverse) is refused by name, all
        of them together and before any value is copied; with ``strict=False`` they start fresh
        instead and are listed in ``self.fresh``. ``restore_rng=False`` is the negative control
        of resume verification.

        A generation saved on another device type (a CUDA run on a machine without CUDA, a CPU
        run with CUDA in use here) is refused by name (``DeviceChangeError``): the old device's
        RNG states cannot go back, so the run would not continue bit-exactly.
        ``allow_device_change=True`` goes on without them, says so in the log and records a
        ``device_change`` event.
        """
        self._require_open()
        self.fresh = []
        self.restored_from = self.skipped_diverged = None
        loop = restoring.Loop(self.run, self.model, self.optimizer, tuple(self.pieces()), self.generators,
                              self.rank, self.log, self._event, self.upgrade, self.on_restore)
        done = restoring.restore(loop, source, strict, restore_rng, allow_nonfinite, allow_device_change)
        self.fresh, self.restored_from, self.skipped_diverged = list(done.fresh), done.path, done.skipped_diverged
        step, self.restored_tier = done.step, done.tier
        tiered = forget_after(self.run, step or 0, self.log)     # RAM generations of a lost timeline
        self._ram_tier = tiered or self._memory is not None
        self._checked, self._last_step = True, step
        self._resumed_at = step
        if step is None:
            refusals.trained_before_restore(self.model, self._built, self.run.where, self.log)
            self._event("start", 0, world_size=self.world)
            return 0
        self._go_on_from(step, done.metrics)
        if source is None and not tiers.in_ram(done.tier):
            self.committed = step             # the newest durable generation (a RAM one is not)
        passed = {k: v for k, v in (("skipped_diverged", self.skipped_diverged), ("tier", done.tier)) if v}
        self._event("resume", step, fresh_pieces=self.fresh, **passed)
        return step

    def _go_on_from(self, step: int, metrics: Mapping[str, Any]) -> None:
        """After a restore: the metrics the generation recorded are the newest known (the next
        manifests record them until the loop reports newer ones), and ``on_best`` goes on from
        the best value the history holds up to ``step``."""
        self._metrics.seed(metrics)
        best = self.saving.on_best
        known = best_in_history(self.run.history.source, best, self.saving.mode, step) if best else None
        self._clock = SaveClock(self.saving, best=known)

    def log(self, message: str, *, info: bool = False) -> None:
        """Say what the manager decided: to the ``log`` hook; without one, a warning (an
        ``info`` message, such as what retention deleted, is then left unsaid)."""
        if self._log is not None:
            self._log(message)
        elif not info:
            warnings.warn(message, stacklevel=3)

    def _event(self, kind: str, step: int, **fields: Any) -> None:
        if self.rank == 0:
            self.run.history.event(kind, step, **fields)


# ---------------------------------------------------------------- helpers
def _start_mirror(mgr: CheckpointManager, url: str) -> BackgroundMirror:
    """The background mirror of ``mirror=URL`` (the run layer's), with the run's own retention."""
    return BackgroundMirror(mgr.run.path, url, retention=mgr.retention, log=mgr.log)
