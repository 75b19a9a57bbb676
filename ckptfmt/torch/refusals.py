"""What the checkpoint manager refuses before anything is written (spec/RUN.md §8): state
objects without ``state_dict`` (arguments that are no policy: ``ckptfmt.run.statemanager.policies``), parameters the layout cannot hold
exactly, a manifest JSON cannot hold (``strict_json``, the run layer's; a step the format cannot
hold: ``ckptfmt.run.session.step_of``)."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..run.stateside import strict_json
from . import adapter, loaders

__all__ = ["check_params", "check_state", "strict_json", "trained_before_restore", "versions"]


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


def trained_before_restore(model: torch.nn.Module, optimizer: Any, built: tuple[int, ...], run: Any,
                           log: Any) -> None:
    """``restore()`` found no generation: say so when the parameters changed since the manager
    was built (trained before ``restore()``), or the optimizer already took steps (a model trained
    by a notebook cell run before the manager was built), because the loop then goes on from the
    weights in memory, not from a fresh start."""
    if versions(model) != built:
        why = "the model's parameters changed since this manager was built (trained before restore()?)"
    elif any(optimizer.state.get(p) for group in optimizer.param_groups for p in group["params"]):
        why = "the optimizer already holds state (trained before this manager was built, in an earlier cell?)"
    else:
        return
    log(f"{run}: restore() found no generation, but {why}: training goes on from the weights in memory, not "
        "from a fresh start, and the next save commits them as the run's first generation")
