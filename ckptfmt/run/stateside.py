"""What a framework implements to save and restore a loop's state through a session, and the
one manifest writer every framework's generations go through (spec/RUN.md §8, "The session").

A ``Session`` (``ckptfmt.run.session``) knows when to save, what follows a commit and how the
ranks agree; it never sees the loop's state. A ``StateSide`` is the other half: what the state
is (``capture``), how it is written (``writer``, ``commit``), what cannot be stored
(``refuse``), and how a generation goes back into the loop (``choose``, ``plan``, ``load``).
``ckptfmt.run.statemanager.StateManager`` joins one of each; the torch layer's
``CheckpointManager`` is that with ``ckptfmt.torch.stateside.TorchState``. A new framework
(DeepSpeed, a JAX loop) writes a state side and a manager over ``StateManager``, never a
manifest field every manifest has: those (``COMMON``) are assembled here once (``manifest``),
with the loop's ``manifest_fields`` hook and its refusal of a clash.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from .. import manifest as mf
from ..version import software_versions
from . import roots
from .collective import Collective

if TYPE_CHECKING:
    from .directory import Run
    from .session import Session, Writer

__all__ = ["ArrayWriter", "COMMON", "announcing", "Restored", "Resuming", "StateSide", "commit_regions", "manifest",
           "strict_json"]

COMMON = ("versions", "created", "progress", "metrics", "config")   # what the writer adds to a capture


@dataclass(frozen=True)
class Resuming:
    """Where a restore reads from and how it speaks: the run, this process's rank, ``log(message,
    info=False)``, ``event(kind, step, **fields)`` (the history, rank 0) and the loop's
    ``upgrade`` and ``on_restore`` hooks (``ckptfmt.run.hooks.Hooks``)."""

    run: "Run"
    rank: int
    log: Callable[..., None]
    event: Callable[..., None]
    upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    on_restore: Callable[[dict[str, Any], str], Any] | None = None

    @classmethod
    def of(cls, session: "Session") -> "Resuming":
        return cls(session.run, session.rank, session.log, session.event, session.hooks.upgrade,
                   session.hooks.on_restore)


@dataclass(frozen=True)
class Restored:
    """What a restore did: the step and generation restored (None, None on a fresh run), the
    pieces that started fresh, and why newer diverged generations were passed over."""

    step: int | None = None
    path: str | None = None
    fresh: tuple[str, ...] = ()
    skipped_diverged: str | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)   # the manifest's, as recorded
    tier: str | None = None                   # disk, memory or peer (spec/RUN.md §13); None for a source


class StateSide(Protocol):
    """The state of one framework's loop, as a ``StateManager`` saves and restores it. Every
    rank has one; each method is called on every rank in the same order (``collective``)."""

    collective: Collective                    # how the ranks agree: OneProcess, TorchCollective

    def versions(self) -> Mapping[str, str]:
        """The framework's versions each manifest records beside ckptfmt's, NumPy's and
        Python's (``{"torch": ...}``); a resume under others is said, never refused."""
        ...

    def refuse(self) -> None:
        """Refuse what the state side cannot store, before any training step (the manager's
        construction, before the run is opened): a refusal then costs no training."""
        ...

    def writer(self, session: "Session") -> "Writer":
        """The writer of the session's generations (built once, by the session); it calls
        ``session.intent`` before a manifest and ``session.after_commit`` after a commit."""
        ...

    def capture(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(this state's manifest fields, its arrays for the companion file) at ``step``;
        what cannot be stored is refused here, before a byte is written. Never a ``COMMON``
        field."""
        ...

    def commit(self, writer: Any, step: int, manifest: dict[str, Any], extra: dict[str, Any]) -> None:
        """Hand generation ``step`` to ``writer``: its regions from the live state, ``manifest``
        (complete: ``ckptfmt.run.stateside.manifest``) and the ``extra`` arrays."""
        ...

    def choose(self, run: "Run", allow_nonfinite: bool) -> dict[str, Any]:
        """The generation to resume as every rank sees it: ``path``, ``why`` newer ones were
        passed over, ``tier``, ``skipped`` notes (``ckptfmt.run.resuming.choose_here`` in one
        process); raise ``NoValidGenerationError`` when committed ones exist and all fail."""
        ...

    def plan(self, at: Resuming, ck: Any, doc: dict[str, Any], **options: Any) -> Any:
        """Every check of a restore from the opened generation ``ck`` (``doc``: its manifest as
        the loop's ``upgrade`` views it), agreed by every rank, before a value is copied: a
        refusal here changes nothing. ``options``: the manager's ``restore`` keywords.
        Returns what ``load`` needs."""
        ...

    def load(self, at: Resuming, ck: Any, plan: Any) -> Sequence[str]:
        """Copy what ``plan`` checked into the loop; the pieces that started fresh."""
        ...

    def digests(self, step: int) -> Mapping[str, Any]:
        """Optional: the history's state digests (spec/RUN.md §3.9), one entry per component of
        this state as it stands when the loop is done with ``step``. A state side without it
        records none (``StateManager(digests=True)`` refuses it)."""
        ...


# ---------------------------------------------------------------- the one manifest writer
def manifest(session: "Session", side: StateSide, step: int,
             config: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, companion arrays) of generation ``step``: the state side's capture, then what
    every manifest has (``COMMON``: versions, the commit time retention's time rules read, the
    step, the newest metrics the loop reported, the loop's ``config``), then the loop's
    ``manifest_fields(step)``, a field already written refused. Refused too, before a byte is
    written: a manifest JSON cannot hold."""
    fields, extra = side.capture(step)
    clash = sorted(set(fields) & set(COMMON))
    if clash:
        raise ValueError(f"the state side's capture holds {clash}, fields the manifest writer writes")
    doc = {**fields, "versions": software_versions(side.versions()), "created": time.time(),
           "progress": {"step": step}}
    metrics = session.metrics.at(step)
    if metrics:
        doc["metrics"] = metrics
    if config is not None:
        doc["config"] = config
    hook = session.hooks.manifest_fields
    for key, value in (hook(step) if hook else {}).items():
        if key in doc:
            raise ValueError(f"manifest_fields: {key!r} is a field the manager writes")
        doc[key] = value
    strict_json(doc)
    return doc, extra


def strict_json(doc: dict[str, Any]) -> None:
    """Refuse, before anything is written, a manifest JSON cannot hold (a NaN or a Path in the
    config, a generator whose state is not JSON): a failure after the .bin is on disk would
    leave an uncommitted leftover behind."""
    try:
        mf.dumps(doc)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot checkpoint: the manifest would not be strict JSON ({exc})") from None


# ---------------------------------------------------------------- committing three regions
def commit_regions(run: "Run", step: int, regions: Sequence[Any], n_params: int, manifest: dict[str, Any],
                   extra: dict[str, Any] | None, *, intent: Callable[[int, str], None] | None = None,
                   after_commit: Callable[[int, dict[str, Any]], None] | None = None) -> None:
    """Commit generation ``step`` of one process (weights, m, v: arrays or chunk iterators):
    the history durable before the commit marker (``intent``'s durable record syncs it, else a
    sync), ``intent(step, root)`` before the manifest, ``after_commit`` once committed."""
    if intent is None:
        run.history.sync()
    run.commit(step, *regions, manifest=manifest, n_params=n_params, extra_tensors=extra or None,
               before_commit=announcing(intent, step))
    if after_commit is not None:
        after_commit(step, manifest)


def announcing(intent: Callable[[int, str], None] | None, step: int) -> Callable[[dict[str, Any]], None] | None:
    """What the commit of ``step`` shows its sealed manifest to: ``intent`` with its root."""
    return None if intent is None else (lambda doc: intent(step, roots.of(doc)))


class ArrayWriter:
    """A session's synchronous writer for a state side of one process whose weights, m and v
    are NumPy arrays (a JAX loop's, once on the host): committed when ``write`` returns."""

    last_stall_s = 0.0

    def __init__(self, run: "Run", *, intent: Callable[[int, str], None] | None = None,
                 after_commit: Callable[[int, dict[str, Any]], None] | None = None):
        self.run, self.intent, self.after_commit = run, intent, after_commit

    @classmethod
    def of(cls, session: "Session") -> "ArrayWriter":
        """The writer of ``session``'s generations (what ``StateSide.writer`` returns)."""
        return cls(session.run, intent=session.intent, after_commit=session.after_commit)

    def write(self, step: int, regions: Sequence[np.ndarray], manifest: dict[str, Any],
              extra: dict[str, Any] | None = None) -> None:
        started = time.perf_counter()
        commit_regions(self.run, step, regions, int(regions[0].size), manifest, extra,
                       intent=self.intent, after_commit=self.after_commit)
        self.last_stall_s = time.perf_counter() - started

    def then(self, action: Callable[[], None]) -> None:
        action()                                  # committed already

    def poll(self) -> None:
        return None

    def wait(self) -> None:
        return None
