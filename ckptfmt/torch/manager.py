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
from typing import Any, Callable, Mapping

import torch

from ..run import SavePolicy, tiers
from ..run.hooks import Hooks
from ..run.mirror_thread import BackgroundMirror
from ..run.session import Mirror, Session
from . import adapter, optim, ranks, refusals, rng
from . import digests as digesting
from . import restore as restoring
from .distributed import reshard
from .memtier import MemoryTier, at_close, forget_after
from .saver import Saver
from .state import persistent_buffers, split

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Saves, retains and restores every piece of a training loop's state in a run directory: the
    torch state side (what is captured and restored) over a ``ckptfmt.run.session.Session``
    (the run lock, the save clock, the history, commit -> retention -> hooks -> mirror, signals).

    The run lock is held from construction to ``close()`` (by rank 0 under torchrun; not at all
    with ``lock=False``, when the caller holds it); an optimizer the seed layout cannot hold is
    refused here, before any training step.

    Hooks for a loop with pieces of its own (the reference trainer uses each), all optional
    (``ckptfmt.run.hooks.Hooks``): ``manifest_fields(step) -> dict`` adds the loop's own fields to every manifest;
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
                 handle_signals: bool = True, config: Any = None, mirror: str | None = None, lock: bool = True,
                 digests: bool = digesting.DEFAULT, **hooks: Callable[..., Any]):
        """``directory`` is a run directory (created if needed), a ``Run`` or a URL (a run on
        object storage, spec/RUN.md §2.0.2). ``every`` (default 100) saves every N steps,
        ``every=None`` only on request and at ``close``; ``keep_last`` (default 3) and
        ``keep_every`` are the retention of the last K and every N-th step, ``keep_last=None``
        alone keeps every generation. ``retention=Policy(...)`` instead of them (``retention=None``:
        keep every generation) composes every rule (the best K by a metric, time windows; spec/RUN.md §5.1),
        and ``saving=SavePolicy(...)`` instead of ``every`` saves on a step cadence, on wall time and
        on a new best of a metric (§5.5); the run records both in ``.policy.json`` (§5.6).
        ``digests`` records with each step a digest of every piece of state as the next step will
        find it (the history's ``state``, §3.9: what a resume that went wrong parted on)."""
        optim.kind(optimizer)
        given = Hooks.given("CheckpointManager", hooks)
        refusals.check_state(state)
        retention, saving = refusals.policies(every, keep_last, keep_every, retention, saving)
        self._built = refusals.check_params(model, optimizer)     # the parameters' versions now
        refusals.strict_json({"rng": rng.rng_state(generators), "config": config})   # a generator JSON cannot hold
        self.rank, self.world = ranks.check_setup(model, optimizer)
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.state, self.generators, self.config = dict(state or {}), dict(generators or {}), config
        self.digests = digests
        self.session = Session(
            directory, write=self._write, saving=saving, retention=retention, collective=ranks.TorchCollective(),
            hooks=given, lock=lock, handle_signals=handle_signals,
            writer=lambda s: Saver(s.run, asynchronous=async_save, sharded=self.world > 1,
                                   after_commit=s.after_commit, intent=s.intent),
            mirror=(lambda s: _start_mirror(s, mirror)) if mirror else None,
            at_close=lambda committed: at_close(self._memory, self.run,   # no RAM tier: no store call
                                                committed if self._ram_tier else None, self.log))
        self._saver = self.session.writer
        self._memory = MemoryTier(self.run, memory_every, rank=self.rank, world=self.world, log=self.log,
                                  event=self.session.event, asynchronous=async_save) if memory_every is not None else None
        self.restored_from = self.restored_tier = None   # restore's generation and its tier (spec/RUN.md §13)
        self.skipped_diverged: str | None = None   # why restore passed newer generations over
        self.fresh: list[str] = []

    # ------------------------------------------------------------ the session's
    run = property(lambda self: self.session.run, doc="The run (``Run``, or ``StoreRun`` for a URL).")
    retention = property(lambda self: self.session.retention, doc="The retention ``Policy`` (None: keep all).")
    saving = property(lambda self: self.session.saving, doc="The ``SavePolicy``.")
    committed = property(lambda self: self.session.committed, doc="The newest step committed durably.")
    last_save = property(lambda self: self.session.last_save, doc="(step, reason) of the newest save.")
    closed = property(lambda self: self.session.closed, doc="True once ``close()`` ran.")
    stall_s = property(lambda self: self.session.stall_s,
                       doc="Seconds the loop waited in the newest save (the snapshot only, with ``async_save``).")

    # ------------------------------------------------------------ driving
    def request_save(self) -> None:
        """Commit a generation at the next ``step()`` and continue (what SIGUSR1 does)."""
        self.session.request_save()

    def request_stop(self, reason: str = "SIGTERM") -> None:
        """Commit a generation at the next ``step()``, which then returns True (SIGTERM, SIGINT);
        ``reason`` is what its ``checkpoint`` event records."""
        self.session.request_stop(reason)

    def step(self, step: int, loss: Any = None, **metrics: Any) -> bool:
        """Record step ``step`` in ``.loss.json``; save on cadence or on request. True once a
        stop was requested: the generation is committed and the loop should exit."""
        stop, saved = self.session.step(step, {**({"loss": loss} if loss is not None else {}), **metrics},
                                        state=self.state_digests(step) if self.digests else None)
        if not saved and self._memory is not None and self._memory.due(step) and self.committed != step:
            self._memory.save(step, self.model, self.optimizer, self._manifest)   # RAM: between durable ones
        return stop

    def state_digests(self, step: int) -> dict[str, Any]:
        """What ``step(step)`` records as the history's ``state`` (spec/RUN.md §3.9): a digest of
        every piece of state now, when the loop is done with ``step``. Every rank computes it
        (a piece's ``state_dict`` may be a collective); rank 0's is recorded."""
        return digesting.state_digests(optimizer=self.optimizer, pieces=self.pieces(), generators=self.generators,
                                       scaler=self.scaler, step=step)

    def save(self, step: int, reason: str = "requested") -> None:
        """Commit generation ``step`` now (asynchronously with ``async_save``); the history's
        ``checkpoint`` event records ``reason`` and how long the loop stalled. Everything that
        cannot be stored is refused here, before a byte is written."""
        self.session.save(step, reason)

    def _write(self, step: int) -> None:
        """The session's ``write``: the loop's state at ``step``, refused before a byte is
        written if it cannot be stored, handed to the saver."""
        reshard(self.model)                 # FSDP2 after a sample: the optimizer's own tensors
        manifest, extra = self._manifest(step)
        refusals.strict_json(manifest)
        self._saver.save(step, self.model, self.optimizer, manifest, extra)

    def metric(self, name: str) -> Any:
        """The newest value of the metric ``name`` given to ``step()`` (or recorded by the restored
        generation), as a float with NaN and inf; None if there is none."""
        return self.session.metrics.value(name)

    def wait(self) -> None:
        """Block until a save in flight (``async_save``) is committed; re-raise its failure."""
        self.session.wait()

    def close(self, step: int | None = None) -> None:
        """Commit ``step`` unless it is committed already, wait for a save in flight, release the
        run lock and the signal handlers. Idempotent."""
        self.session.close(step)

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
        metrics = self.session.metrics.at(step)
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
        fields = self.session.hooks.manifest_fields
        for key, value in (fields(step) if fields else {}).items():
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
        hooks = self.session.hooks
        self.session.require_open()
        self.fresh = []
        self.restored_from = self.skipped_diverged = None
        loop = restoring.Loop(self.run, self.model, self.optimizer, tuple(self.pieces()), self.generators,
                              self.rank, self.log, self.session.event, hooks.upgrade, hooks.on_restore)
        done = restoring.restore(loop, source, strict, restore_rng, allow_nonfinite, allow_device_change)
        self.fresh, self.restored_from, self.skipped_diverged = list(done.fresh), done.path, done.skipped_diverged
        step, self.restored_tier = done.step, done.tier
        tiered = forget_after(self.run, step or 0, self.log)     # RAM generations of a lost timeline
        self._ram_tier = tiered or self._memory is not None
        # the newest durable generation is the one restored (a RAM one, or a source, is not)
        self.session.resumed(step, done.metrics, durable=source is None and not tiers.in_ram(done.tier))
        if step is None:
            refusals.trained_before_restore(self.model, self._built, self.run.where, self.log)
            self.session.event("start", 0, world_size=self.world)
            return 0
        passed = {k: v for k, v in (("skipped_diverged", self.skipped_diverged), ("tier", done.tier)) if v}
        self.session.event("resume", step, fresh_pieces=self.fresh, **passed)
        return step

    def log(self, message: str, *, info: bool = False) -> None:
        """Say what the manager decided: to the ``log`` hook; without one, a warning (an
        ``info`` message, such as what retention deleted, is then left unsaid)."""
        self.session.log(message, info=info)


# ---------------------------------------------------------------- helpers
def _start_mirror(session: Session, url: str) -> Mirror:
    """The background mirror of ``mirror=URL`` (the run layer's), with the run's own retention."""
    return BackgroundMirror(session.run.path, url, retention=session.retention, log=session.log)
