"""A session: what surrounds every save of a training loop, whatever its framework (spec/RUN.md §8).

The session owns the run (``open_run``), its writer lock (rank 0's unless ``lock=False``, when
the caller holds it), the flags the signals set (``ckptfmt.run.signals``), the save clock and the
record of the policies, the order of the steps, the history's records and events, and the commit
sequence: a generation is committed, then a metric the policies name but the loop never
reported is said (once), retention runs, then the ``on_commit`` hook, then the mirror is woken.
``close`` commits the last step, waits for the writer and releases what the session holds.

What is saved is the state side's: the session is given ``write(step)`` (capture the loop's
state at ``step``, refuse what cannot be stored before a byte is written, and hand it to the
writer) and a ``Writer`` (the torch layer's ``Saver``), which calls ``after_commit`` once a
generation is committed and ``intent`` before its manifest. The ranks agree through a
``Collective`` (``ckptfmt.run.collective``). The session imports no framework.

Where a framework saves on its own (Lightning's ModelCheckpoint, the Hugging Face Trainer), the
session is built without ``write`` and ``writer``: ``step`` then says when a save is due (a
signal, the save policy) and the framework saves; once it committed a checkpoint it says so
with ``framework_saved``, and the same sequence follows (the ``checkpoint`` event, retention
through the ``retain`` given for its directory, the hook, the mirror). No policy record is
written there: the directory is the framework's, each checkpoint in it a run of its own. A
framework that logs a step's metrics after the step ends (the Trainer) gives ``step`` none and
``record``s the step once they are logged.
"""
from __future__ import annotations

import contextlib
import operator
import time
from typing import Any, Callable, Mapping, Protocol

from .. import format as fmt
from ..errors import CheckpointError, ConfigMismatchError, SaveError, UnsupportedSetupError
from . import ramdirs, signals, tiers
from .collective import Collective, OneProcess
from .history import strict
from .hooks import Hooks
from .metrics import MetricsBook, history_value
from .retention import Policy
from .saving import SaveClock, SavePolicy, best_in_history
from .sidecars import record_policy
from .storerun import open_run
from ..warn import warn

__all__ = ["Mirror", "Session", "Writer", "step_of"]


class Writer(Protocol):
    """What commits a session's generations (``write`` hands it the state); one save in flight
    at most."""

    last_stall_s: float                          # seconds the loop waited in the newest save

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` in the caller's thread once the newest save is committed (never if it
        fails): now when it is, else at the ``poll`` or ``wait`` that finds it committed."""
        ...

    def poll(self) -> None:
        """Run what waits on a save that finished in the background."""
        ...

    def wait(self) -> None:
        """Block until the save in flight is committed; re-raise its failure."""
        ...


class Mirror(Protocol):
    """A copy of the run elsewhere, kept up to date after each commit (spec/RUN.md §10)."""

    def on_commit(self, step: int, manifest: dict[str, Any]) -> None:
        """A generation was committed: catch up (in the background; returns at once)."""
        ...

    def close(self) -> dict[str, Any]:
        """A last pass that catches up; what the mirror did (``url``, ``errors``; ``failed``: the
        last pass failed, and the session says its error)."""
        ...


class Session:
    """The orchestration of one loop's saves in a run directory; every rank builds one."""

    def __init__(self, directory: Any, *, write: Callable[[int], None] | None,
                 writer: Callable[["Session"], Writer] | None, saving: SavePolicy, retention: Policy | None,
                 collective: Collective | None = None, hooks: Hooks = Hooks(), lock: bool = True,
                 handle_signals: bool = True, mirror: Callable[["Session"], Mirror] | None = None,
                 at_close: Callable[[int | None], None] | None = None,
                 retain: Callable[[], list[Any]] | None = None):
        """``directory``: a run directory (created if needed), a ``Run`` or a URL. ``writer(session)``
        builds the writer, ``mirror(session)`` the mirror (rank 0 only; refused for a run on object
        storage). ``at_close(committed)`` settles what else the state side keeps, once the writer
        is idle at ``close``. ``write`` and ``writer`` None: the framework saves (the module's
        docstring). ``retain()`` applies the retention after a commit and returns what it
        deleted (default: the run's ``gc`` with ``retention``; a framework's directory of
        checkpoints gives its own)."""
        self.collective = collective or OneProcess()
        self.rank, self.world = self.collective.rank, self.collective.world
        self.hooks, self.saving, self.retention = hooks, saving, retention
        self._write, self._at_close = write, at_close
        self._retain = retain
        self.run = open_run(directory, create=True)     # a URL: a run on object storage (StoreRun)
        if mirror is not None:
            refuse_mirror_on_store(self.run)
        self.flags = signals.Flags()          # what the signals (or the caller) asked for
        self._handlers = signals.install(self) if handle_signals else None   # before the lock: may raise
        with signals.given_back_on_error(self._handlers):   # the lock refused (held, a read-only store)
            self._lock = self.run.writer_lock("checkpoint manager") if self.rank == 0 and lock else None
        self._dropped = signals.release_when_collected(self, self._lock)
        # rank 0 records it at the first step; a framework's directory holds its checkpoints, each a
        # run of its own, not generations whose keeping the record would explain (spec/RUN.md §5.6)
        self._policy_recorded = self.rank != 0 or write is None
        self.clock, self.metrics = SaveClock(saving), MetricsBook()   # metrics: the newest given to step()
        self.committed: int | None = None
        self.last_save: tuple[int, str] | None = None      # (step, reason) of the newest save
        self.closed = False
        self._last_step: int | None = None    # the newest step restored or given to step()
        self._resumed_at: int | None = None
        self._checked = False                 # the run's generations looked at (restore, first step)
        self.due: str | None = None           # why a save is due that the framework makes (no writer)
        self.writer = self.mirror = None
        try:                                  # what fails to start leaves no lock and no handler behind
            self.writer = writer(self) if writer is not None else None
            self.mirror = mirror(self) if mirror is not None and self.rank == 0 else None
        except BaseException:
            self.closed = True
            self._release()
            raise

    # ------------------------------------------------------------ the flags signals set
    def request_save(self) -> None:
        """Commit a generation at the next ``step()`` and continue (what SIGUSR1 does)."""
        self.flags.request_save()

    def request_stop(self, reason: str = "SIGTERM") -> None:
        """Commit a generation at the next ``step()``, which then says stop (SIGTERM, SIGINT);
        ``reason`` is what its ``checkpoint`` event records."""
        self.flags.request_stop(reason)

    # ------------------------------------------------------------ driving
    def step(self, step: int, values: Mapping[str, Any] | None,
             state: Mapping[str, Any] | None = None) -> tuple[bool, bool]:
        """Record step ``step`` and its metrics ``values`` in the history, with the state side's
        ``state`` digests (spec/RUN.md §3.9) if given; save on a rule of the save policy or on
        request, as every rank agrees. (stop, saved): stop once a stop was requested (the
        generation is committed: the loop should exit); saved when this step committed a
        generation. ``values`` None: the framework logs the step's metrics after it ends (the
        Trainer, after ``on_step_end``); ``record`` writes its record then."""
        self.require_open()
        step = step_of(self.run.where, step)
        if state is not None and "state" in (values or {}):
            raise ValueError(f"{self.run.where}: step(): a metric named 'state' would hide the record's "
                             "state digests (spec/RUN.md §3.9): rename it, or turn the digests off")
        self._check_order(step)
        if self.writer is not None:
            self.writer.poll()                # a background save that committed: its event now
        if values is not None:
            self.record(step, values, state)
        self._record_policy()
        stop, reason = self._decide(step, values or {})
        saving = bool(reason) and self.committed != step
        if saving and self.writer is not None:
            self.save(step, reason)
        elif saving:
            self.due = reason                 # the framework saves; framework_saved records it
        return stop, saving

    def record(self, step: int, values: Mapping[str, Any], state: Mapping[str, Any] | None = None) -> None:
        """The history's record of step ``step`` (rank 0) with its metrics ``values``, the newest
        the session knows, and the ``state`` digests if given; once per step, in step order
        (``step`` writes it, or is told not to)."""
        record: dict[str, Any] = {"step": step, "time": time.time()}
        for key, value in values.items():
            record[key] = history_value(value)
        if state is not None:
            record["state"] = strict(dict(state))     # an lr of NaN as the history writes floats
        self.metrics.record(step, values)
        if self.rank == 0:
            self.run.history.append(record)

    def _decide(self, step: int, values: Mapping[str, Any]) -> tuple[bool, str | None]:
        """(stop, the reason to save at ``step`` or None), as every rank sees them. The local
        flags are only ever set here, never cleared by the collective, so a signal that lands
        while it runs counts at the next step. The wall clocks may differ between ranks: any
        rank's is every rank's save; a new best is rank 0's (the values its history records,
        where a resumed run's best comes from)."""
        due = self.clock.due(step, values, now=time.monotonic())
        stop, save, timed, best = self._agree("interval" in due, self.rank == 0 and any(r.startswith("best ") for r in due))
        reason = (self.flags.reason if stop else "SIGUSR1" if save else "cadence" if "cadence" in due
                  else "interval" if timed else f"best {self.saving.on_best}" if best else None)
        return stop, reason

    def requests(self) -> tuple[bool, bool]:
        """(stop, save): what a signal (or the caller) asked for on any rank, agreed by every
        rank, between two steps (a framework's batch that ends no optimizer step); a save
        request is taken (it counts once), a stop stays."""
        stop, save, _, _ = self._agree(False, False)
        return stop, save

    def _agree(self, timed: bool, best: bool) -> tuple[bool, bool, bool, bool]:
        """The flags and the due rules every rank sees (a collective call on every rank)."""
        stop, save, timed, best = self.collective.agree(self.flags.stop, self.flags.save, timed, best)
        if save:
            self.flags.save = False
        if stop:
            self.flags.request_stop("SIGTERM")   # another rank's signal: the one the cluster sends
        return stop, save, timed, best

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
        """Steps go forward from where the run is: a loop that restarts at 1 after a restore,
        or never restored a run with generations, would replace the history's records of
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
        """Commit generation ``step`` now (through the writer: in the background if it is
        asynchronous); the history's ``checkpoint`` event records ``reason`` and how long the
        loop stalled, once the generation is committed."""
        self.require_open()
        step = step_of(self.run.where, step)
        if self._write is None:
            raise RuntimeError(f"{self.run.where}: the framework saves this run's checkpoints, not the session")
        self._write(step)
        self.committed, self.last_save = step, (step, reason)
        self.clock.saved(time.monotonic())
        stall_ms = round(self.stall_s * 1e3, 3)     # recorded once committed (async: later)
        self.writer.then(lambda: self.event("checkpoint", step, reason=reason, stall_ms=stall_ms,
                                            root=self.run.committed_root(step) if self.rank == 0 else None))

    def framework_saved(self, step: int, manifest: Mapping[str, Any] | None = None, *,
                        reason: str | None = None, **fields: Any) -> None:
        """The framework committed a checkpoint of step ``step`` (the session has no writer):
        its ``checkpoint`` event (``reason``: the one ``step`` gave, else the framework's own
        schedule; ``fields`` added, such as its path), then what follows every commit
        (``after_commit``: retention, the hook, the mirror)."""
        self.require_open()
        step = step_of(self.run.where, step)
        reason, self.due = reason or self.due or "framework", None
        self.committed, self.last_save = step, (step, reason)
        self.clock.saved(time.monotonic())
        self.event("checkpoint", step, reason=reason, **fields)
        self.after_commit(step, dict(manifest or {}))

    @property
    def stall_s(self) -> float:
        """Seconds the loop waited in the newest save (the snapshot only, with an asynchronous writer)."""
        return self.writer.last_stall_s if self.writer is not None else 0.0

    def wait(self) -> None:
        """Block until a save in flight is committed; re-raise its failure."""
        if self.writer is not None:
            self.writer.wait()

    # ------------------------------------------------------------ what the writer calls
    def intent(self, step: int, root: str) -> None:
        """The root digest of generation ``step``, recorded durably before its manifest is
        written (spec/RUN.md §3.7)."""
        self.event("committing", step, root=root, durable=True)

    def after_commit(self, step: int, manifest: dict[str, Any]) -> None:
        """Generation ``step`` is committed: a metric the policies name that it does not
        record is said (once), then retention (rank 0), the ``on_commit`` hook, the mirror."""
        if self.rank == 0:
            names = [m for m in (self.retention.metric if self.retention else None, self.saving.on_best) if m]
            self.metrics.say_unreported(manifest, names, lambda said: self.log(f"{self.run.where}: {said}"))
        if self.rank == 0 and self.retention is not None and not self.retention.keep_all:
            deleted = self._retain() if self._retain is not None else self.run.gc(self.retention)
            if deleted:
                self.log(f"retention deleted steps {deleted}", info=True)
        if self.hooks.on_commit is not None:
            self.hooks.on_commit(step, manifest)
        if self.mirror is not None:
            self.mirror.on_commit(step, manifest)     # wakes the mirror's thread; returns at once

    # ------------------------------------------------------------ restore
    def resumed(self, step: int | None, metrics: Mapping[str, Any], *, durable: bool) -> None:
        """The state side restored generation ``step`` (None: it found none). The next step
        goes on after it; the metrics the generation recorded are the newest known (the next
        manifests record them until the loop reports newer ones); ``on_best`` goes on from the
        best value the history holds up to ``step``; a ``durable`` generation is the newest
        committed one (a RAM one, or a ``source`` outside the run, is not)."""
        self._checked, self._last_step, self._resumed_at = True, step, step
        if step is None:
            return
        self.metrics.seed(metrics)
        best = self.saving.on_best
        known = best_in_history(self.run.history.source, best, self.saving.mode, step) if best else None
        self.clock = SaveClock(self.saving, best=known)
        if durable:
            self.committed = step

    # ------------------------------------------------------------ close
    def close(self, step: int | None = None) -> None:
        """Commit ``step`` unless it is committed already, wait for the writer, settle the state
        side (``at_close``), then close the mirror and release the history, the run lock and the
        signal handlers, whatever failed. Idempotent."""
        if self.closed:
            return
        try:
            if step is not None and self.committed != step:
                self.save(step, "close")
            self.wait()
            if self._at_close is not None:
                self._at_close(self.committed)
        finally:
            self.closed = True
            if self.mirror is not None:
                report = self.mirror.close()          # a last pass: the destination catches up
                if report["errors"] and report.get("failed", True):   # each failed pass was said as it failed
                    self.log(f"mirror to {report['url']} is behind {self.run.where}: {report['errors'][-1]}")
            self._release()

    def _release(self) -> None:
        """The history closed, the RAM tier and the run lock let go, the signal handlers given
        back, whatever fails (a history the disk refuses to sync is still closed, the lock still
        released)."""
        try:
            try:
                self.run.history.sync()
            finally:
                self.run.history.close()               # a store's history: its last segment
        finally:
            if ramdirs.holding():      # held since a restore or a RAM save; else not even the run's ID is read
                with contextlib.suppress(CheckpointError, OSError):   # (a store that stopped answering: one call less)
                    ramdirs.let_go(tiers.memory_dir(self.run))
            try:
                if self._lock is not None:
                    self._lock.release()
            finally:
                signals.restore(self._handlers)

    def require_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self.run.where}: the checkpoint manager is closed")

    # ------------------------------------------------------------ speaking
    def log(self, message: str, *, info: bool = False) -> None:
        """Say what the session decided: to the ``log`` hook; without one, a warning (an
        ``info`` message, such as what retention deleted, is then left unsaid)."""
        if self.hooks.log is not None:
            self.hooks.log(message)
        elif not info:
            warn(message)

    def event(self, kind: str, step: int, **fields: Any) -> None:
        """A history event (rank 0 writes the history)."""
        if self.rank == 0:
            self.run.history.event(kind, step, **fields)


def step_of(run: Any, step: Any) -> int:
    """``step`` as the format holds it (an int32 >= 0), refused before anything is written."""
    if isinstance(step, bool) or not hasattr(step, "__index__") or not 0 <= operator.index(step) <= fmt.MAX_STEP:
        raise SaveError(str(run), f"step must be an integer in 0..{fmt.MAX_STEP} (an int32 in the file), "
                                  f"got {step!r}")
    return operator.index(step)


def refuse_mirror_on_store(run: Any) -> None:
    """A run on object storage (``StoreRun``, no local path) is where a mirror would upload to:
    refused in one line (exit 2) before anything is written."""
    if run.path is None:
        raise UnsupportedSetupError(run.where, "a run on object storage is not mirrored: it is in object storage "
                                               "already (mirror= is for a local run directory)")
