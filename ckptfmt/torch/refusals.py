"""What the checkpoint manager refuses before anything is written (spec/RUN.md §8): arguments
that are no policy, state objects without ``state_dict``, parameters the layout cannot hold
exactly, a manifest JSON cannot hold, a step the format cannot hold."""
from __future__ import annotations

import operator
from typing import Any, Mapping

import torch

from .. import format as fmt
from .. import manifest as mf
from ..errors import SaveError, UnsupportedSetupError
from ..run import Policy, SavePolicy
from . import adapter, loaders

UNSET: Any = type("Unset", (), {})()   # an argument not given

HOOKS = ("manifest_fields", "on_restore", "upgrade", "on_commit", "log", "lock")


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


def check_pieces(state: Mapping[str, Any] | None, hooks: Mapping[str, Any]) -> None:
    unknown = sorted(set(hooks) - set(HOOKS))
    if unknown:
        raise TypeError(f"CheckpointManager: unknown argument(s) {unknown}; hooks are {list(HOOKS)}")
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


def step_of(run: Any, step: Any) -> int:
    """``step`` as the format holds it (an int32 >= 0), refused before anything is written."""
    if isinstance(step, bool) or not hasattr(step, "__index__") or not 0 <= operator.index(step) <= fmt.MAX_STEP:
        raise SaveError(str(run), f"step must be an integer in 0..{fmt.MAX_STEP} (an int32 in the file), "
                                  f"got {step!r}")
    return operator.index(step)


def on_store(run: Any, mirror: str | None) -> None:
    """A run on object storage (``StoreRun``, no local path) is where a mirror would upload to:
    ``mirror=`` refused in one line (exit 2) before anything is written."""
    if run.path is None and mirror:
        raise UnsupportedSetupError(run.where, "a run on object storage is not mirrored: it is in object storage "
                                               "already (mirror= is for a local run directory)")
