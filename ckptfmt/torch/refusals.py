"""What the checkpoint manager refuses before anything is written (spec/RUN.md §8): arguments
that are no policy, state objects without ``state_dict``, parameters the layout cannot hold
exactly, a manifest JSON cannot hold (a step the format cannot hold: ``ckptfmt.run.session.step_of``)."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import manifest as mf
from ..run import Policy, SavePolicy
from . import adapter, loaders

UNSET: Any = type("Unset", (), {})()   # an argument not given


def policies(every: Any, keep_last: Any, keep_every: int | None, retention: Any,
             saving: SavePolicy | None) -> tuple[Policy | None, SavePolicy]:
    """(retention, save policy) of the manager's arguments: ``retention`` (None: every
    generation is kept) or the step-only ``keep_last`` (default 3; None: no last-K rule) and
    ``keep_every``; ``saving`` or ``every`` (default 100)."""
    if retention is not UNSET and (keep_last is not UNSET or keep_every is not None):
        raise TypeError("CheckpointManager: give retention=Policy(...) or keep_last/keep_every, not both")
    if saving is not None and every is not UNSET:
        raise TypeError("CheckpointManager: give saving=SavePolicy(...) or every, not both")
    for name, value, kind in (("retention", retention, Policy), ("saving", saving, SavePolicy)):
        if value not in (None, UNSET) and not isinstance(value, kind):
            raise TypeError(f"CheckpointManager: {name} must be a {kind.__name__}, got {type(value).__name__}")
    every = 100 if every is UNSET else every
    if every is not None and every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    if retention is UNSET:
        keep_last = 3 if keep_last is UNSET else keep_last
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        retention = Policy.by_count(keep_last, keep_every) if keep_last or keep_every else None
    return retention, saving or SavePolicy(every=every)


def check_state(state: Mapping[str, Any] | None) -> None:
    """Every state object can give its state and take it back."""
    for name, obj in (state or {}).items():
        loaders.refuse_plain(name, obj)
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"state[{name!r}]: needs state_dict() and load_state_dict()")


def check_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    """Parameters the layout holds exactly, and no optimizer tensor outside the model
    (``adapter.refuse_unheld``, as the Lightning callback refuses them); the parameters' versions now (``versions``), to tell later whether they were trained since."""
    adapter.refuse_unheld(model, [optimizer])
    return versions(model)


def versions(model: torch.nn.Module) -> tuple[int, ...]:
    """Each parameter's version counter (torch counts every in-place change: an optimizer step,
    a ``load_state_dict``), cheap at any size."""
    return tuple(p._version for p in model.parameters())


def trained_before_restore(model: torch.nn.Module, built: tuple[int, ...], run: Any, log: Any) -> None:
    """``restore()`` found no generation: say so when the parameters changed since the manager
    was built (trained before ``restore()``, or by a notebook cell run before it), because the
    loop then goes on from the weights in memory, not from a fresh start."""
    if versions(model) != built:
        log(f"{run}: restore() found no generation, but the model's parameters changed since this manager was "
            "built (trained before restore()?): training goes on from the weights in memory, not from a fresh "
            "start, and the next save commits them as the run's first generation")


def strict_json(manifest: dict[str, Any]) -> None:
    """Refuse, before anything is written, a manifest JSON cannot hold (a NaN or a Path in the
    config, a generator whose state is not JSON): a failure after the .bin is on disk would
    leave an uncommitted leftover behind."""
    try:
        mf.dumps(manifest)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot checkpoint: the manifest would not be strict JSON ({exc})") from None
