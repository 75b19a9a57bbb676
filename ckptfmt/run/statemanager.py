"""A session driving one state side: what every framework's checkpoint manager is (spec/RUN.md §8).

``StateManager(directory, side, ...)`` refuses what the state side cannot store, opens the
``Session`` (the run lock, the save clock, the history, commit -> retention -> hooks -> mirror,
the signals), writes each generation's manifest through the one writer
(``ckptfmt.run.stateside.manifest``) and hands it to the state side's writer, and restores through
the one restore order (``ckptfmt.run.resuming``), recording the history's ``start`` or ``resume``
event. A framework's manager subclasses it with its own arguments (``CheckpointManager``: torch's);
what it keeps besides (torch's RAM tier) goes in ``unsaved`` and ``restored``; ``policies``
turns the step-count arguments every manager takes (``every``, ``keep_last``, ``keep_every``)
into the policies.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, TypeVar

from . import resuming, tiers
from .hooks import Hooks
from .mirror_thread import BackgroundMirror, check_url
from .retention import Policy
from .saving import SavePolicy
from .session import Mirror, Session
from .stateside import Resuming, StateSide, manifest, strict_json

__all__ = ["StateManager", "UNSET", "policies"]

UNSET: Any = type("Unset", (), {})()   # an argument not given
Manager = TypeVar("Manager", bound="StateManager")


def policies(owner: str, every: Any, keep_last: Any, keep_every: int | None, retention: Any,
             saving: SavePolicy | None) -> tuple[Policy | None, SavePolicy]:
    """(retention, save policy) of a manager's arguments (``owner``: its name, for the
    refusals): ``retention`` (None: every generation is kept) or the step-only ``keep_last``
    (default 3; None: no last-K rule) and ``keep_every``; ``saving`` or ``every`` (default 100)."""
    if retention is not UNSET and (keep_last is not UNSET or keep_every is not None):
        raise TypeError(f"{owner}: give retention=Policy(...) or keep_last/keep_every, not both")
    if saving is not None and every is not UNSET:
        raise TypeError(f"{owner}: give saving=SavePolicy(...) or every, not both")
    for name, value, kind in (("retention", retention, Policy), ("saving", saving, SavePolicy)):
        if value not in (None, UNSET) and not isinstance(value, kind):
            raise TypeError(f"{owner}: {name} must be a {kind.__name__}, got {type(value).__name__}")
    every = 100 if every is UNSET else every
    if every is not None and every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    if retention is UNSET:
        keep_last = 3 if keep_last is UNSET else keep_last
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        retention = Policy.by_count(keep_last, keep_every) if keep_last or keep_every else None
    return retention, saving or SavePolicy(every=every)


class StateManager:
    """Saves, retains and restores a loop's state (``side``) in a run directory (created if
    needed), a ``Run`` or a URL; the run lock is held from construction to ``close()``.

    ``saving`` and ``retention`` are the policies (spec/RUN.md §5.1, §5.5; ``retention=None``
    keeps every generation), ``hooks`` the loop's (``ckptfmt.run.hooks.Hooks``), ``config`` a
    JSON value every manifest records, ``mirror=URL`` a copy of the run kept up to date on a
    background thread (spec/RUN.md §10); ``digests`` records the state side's digests with each
    step (spec/RUN.md §3.9; a side without ``digests`` is refused); ``at_close(committed)``
    settles what else the manager keeps once the writer is idle at ``close``."""

    def __init__(self, directory: Any, side: StateSide, *, saving: SavePolicy, retention: Policy | None,
                 hooks: Hooks = Hooks(), config: Any = None, mirror: str | None = None, lock: bool = True,
                 handle_signals: bool = True, digests: bool = False,
                 at_close: Callable[[int | None], None] | None = None):
        if digests and not callable(getattr(side, "digests", None)):
            raise TypeError(f"{type(side).__name__} computes no state digests: digests=True needs its digests(step)")
        side.refuse()
        strict_json({"config": config})               # a config JSON cannot hold: refused now
        if mirror is not None:
            check_url(mirror)                         # a plain path, a scheme no filesystem serves: now
        self.side, self.config, self.digests = side, config, digests
        self.session = Session(
            directory, write=self._write, writer=side.writer, saving=saving, retention=retention,
            collective=side.collective, hooks=hooks, lock=lock, handle_signals=handle_signals,
            mirror=(lambda s: _start_mirror(s, mirror)) if mirror else None, at_close=at_close)
        self.rank, self.world = self.session.rank, self.session.world
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
                       doc="Seconds the loop waited in the newest save (the snapshot only, when asynchronous).")

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
        if not saved:
            self.unsaved(step)
        return stop

    def state_digests(self, step: int) -> Mapping[str, Any]:
        """What ``step(step)`` records as the history's ``state`` (spec/RUN.md §3.9): the state
        side's digest of every piece of its state now, when the loop is done with ``step``. Every
        rank computes it (a piece's ``state_dict`` may be a collective); rank 0's is recorded."""
        return self.side.digests(step)

    def unsaved(self, step: int) -> None:
        """A step the session did not save (a framework's manager may keep it elsewhere)."""

    def save(self, step: int, reason: str = "requested") -> None:
        """Commit generation ``step`` now (in the background with an asynchronous writer); the
        history's ``checkpoint`` event records ``reason`` and how long the loop stalled.
        Everything that cannot be stored is refused here, before a byte is written."""
        self.session.save(step, reason)

    def _manifest(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(manifest, companion arrays) of generation ``step``, from the one manifest writer."""
        return manifest(self.session, self.side, step, self.config)

    def _write(self, step: int) -> None:
        """The session's ``write``: the loop's state at ``step``, refused before a byte is
        written if it cannot be stored, handed to the state side's writer."""
        doc, extra = self._manifest(step)
        self.side.commit(self.session.writer, step, doc, extra)

    def metric(self, name: str) -> Any:
        """The newest value of the metric ``name`` given to ``step()`` (or recorded by the restored
        generation), as a float with NaN and inf; None if there is none."""
        return self.session.metrics.value(name)

    def wait(self) -> None:
        """Block until a save in flight is committed; re-raise its failure."""
        self.session.wait()

    def close(self, step: int | None = None) -> None:
        """Commit ``step`` unless it is committed already, wait for a save in flight, release the
        run lock and the signal handlers. Idempotent."""
        self.session.close(step)

    def __enter__(self: Manager) -> Manager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log(self, message: str, *, info: bool = False) -> None:
        """Say what the manager decided: to the ``log`` hook; without one, a warning (an
        ``info`` message, such as what retention deleted, is then left unsaid)."""
        self.session.log(message, info=info)

    # ------------------------------------------------------------ restore
    def restore(self, source: Any = None, *, allow_nonfinite: bool = False, **options: Any) -> int:
        """Restore the newest valid generation of the run (or the generation ``source``, verified
        first) into the state side (``ckptfmt.run.resuming``: the order); its step, or 0 on a
        fresh run. Newer diverged generations are passed over (``skipped_diverged``) unless
        ``allow_nonfinite``; ``options`` are the state side's (``StateSide.plan``)."""
        self.session.require_open()
        self.fresh = []
        self.restored_from = self.skipped_diverged = None
        done = resuming.restore(Resuming.of(self.session), self.side, source, allow_nonfinite, options)
        self.fresh, self.restored_from, self.skipped_diverged = list(done.fresh), done.path, done.skipped_diverged
        step, self.restored_tier = done.step, done.tier
        self.restored(step)
        # the newest durable generation is the one restored (a RAM one, or a source, is not)
        self.session.resumed(step, done.metrics, durable=source is None and not tiers.in_ram(done.tier))
        if step is None:
            self.session.event("start", 0, world_size=self.world)
            return 0
        passed = {k: v for k, v in (("skipped_diverged", self.skipped_diverged), ("tier", done.tier)) if v}
        self.session.event("resume", step, fresh_pieces=self.fresh, **passed)
        return step

    def restored(self, step: int | None) -> None:
        """A restore went through (``step`` None: it found no generation), before the session
        goes on from it (a framework's manager may settle what else it keeps)."""


def _start_mirror(session: Session, url: str) -> Mirror:
    """The background mirror of ``mirror=URL``, with the run's own retention. Its thread holds the
    session weakly and ends once the session is collected: a manager a notebook cell left
    unclosed gives its run lock up when nothing refers to it, its mirror or not."""
    mirror = BackgroundMirror(session.run.path, url, retention=session.retention, log=weakly(session.log))
    weakref.finalize(session, mirror.stop)
    return mirror


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of an object, held weakly: once the object is collected a call does nothing."""
    ref = weakref.WeakMethod(method)    # type: ignore[arg-type]

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)
    return call
