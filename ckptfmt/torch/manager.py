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

The manager is the run layer's ``StateManager`` (the session, the one manifest writer, the one
restore order) with the torch state side, ``TorchState``, and the RAM tier torch keeps besides.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..run import SavePolicy
from ..run.hooks import Hooks
from ..run.statemanager import UNSET, StateManager, policies
from . import memtier, optim, refusals
from .digests import DEFAULT as DIGESTS
from .memtier import MemoryTier, at_close, forget_after
from .stateside import TorchState

__all__ = ["CheckpointManager"]


class CheckpointManager(StateManager):
    """Saves, retains and restores every piece of a training loop's state in a run directory: the
    torch state side (``TorchState``: what is captured and restored) over a
    ``ckptfmt.run.statemanager.StateManager`` (a ``Session``: the run lock, the save clock, the
    history, commit -> retention -> hooks -> mirror, signals).

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

    Args:
        directory: a run directory (created if needed), a ``Run``, or the URL of a run on
            object storage (spec/RUN.md §2.0.2).
        model: the ``torch.nn.Module`` whose parameters (stored as float32) and persistent
            buffers are saved.
        optimizer: Adam, AdamW (without ``amsgrad``) or SGD; any other is refused here.
        scheduler: a learning-rate scheduler, saved and restored with its class checked.
        scaler: a ``torch.amp.GradScaler``, saved and restored.
        state: the loop's other objects by name, each with ``state_dict`` /
            ``load_state_dict`` (a ``StatefulDataLoader``, a sampler, a counter).
        generators: named ``torch.Generator`` or NumPy generators whose states a resume
            puts back, beside the global RNGs it always saves.
        every: save every N steps (default 100); ``None``: only on request and at ``close``.
        keep_last: keep the last K generations (default 3); ``keep_last=None`` alone keeps
            every generation.
        keep_every: also keep every generation whose step is a multiple of N (milestones).
        retention: a ``ckptfmt.run.Policy`` instead of ``keep_last`` / ``keep_every``: the
            best K by a metric, time windows (spec/RUN.md §5.1); ``None`` keeps every generation.
        saving: a ``ckptfmt.run.SavePolicy`` instead of ``every``: a step cadence, wall time,
            a new best of a metric (§5.5). The run records both policies in ``.policy.json``
            (§5.6).
        async_save: write each generation on a background thread, so ``step()`` returns
            while it is written; ``wait()`` blocks until it is committed.
        memory_every: also commit a generation to node-local RAM (``/dev/shm``) every N steps
            between durable ones (spec/RUN.md §13).
        handle_signals: install the SIGUSR1 (save and go on) and SIGTERM / SIGINT (save and
            stop) handlers; ``False`` leaves the signals to the caller
            (``request_save()``, ``request_stop()``).
        config: a JSON-able object (the run's hyper-parameters) recorded in every manifest
            and returned as stored; one JSON cannot hold is refused here.
        mirror: an fsspec URL (``s3://bucket/runs/x``; the ``remote`` extra) each committed
            generation is uploaded to, verified, with the same retention (spec/RUN.md §10).
        lock: ``False`` when the caller already holds the run's writer lock.
        digests: record with each step a digest of every piece of state the next step starts
            from (the history's ``state``, §3.9: where a resume that went wrong parted); off by
            default, for it costs about 3 % of a tiny step.
        **hooks: ``manifest_fields``, ``on_restore``, ``upgrade``, ``on_commit``, ``log``
            (described above).

    Examples:
        A loop that saves every 10 steps, keeps the last 3 and resumes where it stopped (the README's
        example; SIGTERM, SIGUSR1 and Ctrl-C save too):

        ```python
        import torch
        from ckptfmt.torch import CheckpointManager

        model = torch.nn.Linear(4, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        x, y = torch.randn(64, 4), torch.randn(64, 1)

        with CheckpointManager("runs/demo", model, opt, every=10, keep_last=3) as mgr:
            start = step = mgr.restore()                 # 0 on a fresh run
            for step in range(start + 1, 51):
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if mgr.step(step, loss=loss.item()):     # True after SIGTERM: committed, stop
                    break
            mgr.close(step)
        ```
    """

    _ram_tier = True     # a RAM tier to clean at close: restore() finds whether the run has one

    def __init__(self, directory: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, scaler: Any = None, *, state: Mapping[str, Any] | None = None,
                 generators: Mapping[str, Any] | None = None, every: Any = UNSET,
                 keep_last: Any = UNSET, keep_every: int | None = None, retention: Any = UNSET,
                 saving: SavePolicy | None = None, async_save: bool = False, memory_every: int | None = None,
                 handle_signals: bool = True, config: Any = None, mirror: str | None = None, lock: bool = True,
                 digests: bool = DIGESTS, **hooks: Callable[..., Any]):
        """Build the manager and take the run lock; the arguments are the class's (above)."""
        optim.kind(optimizer)
        given = Hooks.given("CheckpointManager", hooks)
        memtier.check_every(memory_every)          # before the run lock is taken
        retention, saving = policies("CheckpointManager", every, keep_last, keep_every, retention, saving)
        side = TorchState(model, optimizer, scheduler, scaler, state=state, generators=generators,
                          async_save=async_save, digests=digests)
        self._memory: MemoryTier | None = None       # at_close reads it
        super().__init__(directory, side, saving=saving, retention=retention, hooks=given, config=config,
                         mirror=mirror, lock=lock, handle_signals=handle_signals, digests=digests,
                         at_close=lambda committed: at_close(self._memory, self.run,   # no RAM tier: no store call
                                                             committed if self._ram_tier else None, self.log))
        self._memory = MemoryTier(self.run, memory_every, rank=self.rank, world=self.world, log=self.log,
                                  event=self.session.event, asynchronous=async_save) if memory_every is not None else None

    # ------------------------------------------------------------ the torch state side's
    model = property(lambda self: self.side.model, doc="The model.")
    optimizer = property(lambda self: self.side.optimizer, doc="The optimizer.")
    scheduler = property(lambda self: self.side.scheduler, doc="The learning-rate scheduler, or None.")
    scaler = property(lambda self: self.side.scaler, doc="The GradScaler, or None.")
    state = property(lambda self: self.side.state, doc="The loop's named state objects.")
    generators = property(lambda self: self.side.generators, doc="The named generators.")

    def pieces(self) -> list[tuple[str, Any]]:
        """(name in the manifest, object) of every ``state_dict`` piece the loop gave."""
        return self.side.pieces()

    def unsaved(self, step: int) -> None:
        """A step the session did not save: a RAM generation when its cadence asks (``memory_every``)."""
        if self._memory is not None and self._memory.due(step) and self.committed != step:
            self._memory.save(step, self.model, self.optimizer, self._manifest)   # RAM: between durable ones

    # ------------------------------------------------------------ restore
    def restore(self, source: Any = None, *, strict: bool = True, restore_rng: bool = True,
                allow_nonfinite: bool = False, allow_device_change: bool = False) -> int:
        """Restore everything from the newest valid generation of the run (or from the
        generation ``source``, a ``step_NNNNNN.bin`` anywhere or its ``.json`` manifest, a sharded
        generation's manifest: verified first); its step, or 0
        on a fresh run (the order and the checks: ``ckptfmt.run.resuming``, ``ckptfmt.torch.restore``).

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
        return super().restore(source, allow_nonfinite=allow_nonfinite, strict=strict, restore_rng=restore_rng,
                               allow_device_change=allow_device_change)

    def restored(self, step: int | None) -> None:
        """The RAM generations of a lost timeline removed; a restore that found nothing after the
        model was trained in memory said."""
        self._ram_tier = forget_after(self.run, step or 0, self.log) or self._memory is not None
        if step is None:
            refusals.trained_before_restore(self.model, self.optimizer, self.side.built, self.run.where, self.log)
