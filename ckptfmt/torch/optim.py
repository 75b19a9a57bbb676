"""A live model and optimizer as the mapping records them (``ckptfmt.statemap``): which
optimizers the seed layout can hold and how their state maps onto m and v (the one table,
``statemap.OPTIMIZERS``), each parameter by name, each param group by its members' names, tied
aliases, and the groups' settings stored faithfully.

Adam and AdamW fill both moment regions (``m`` = ``exp_avg``, ``v`` = ``exp_avg_sq``); SGD with
momentum fills ``m`` with its momentum buffer and leaves ``v`` zero; the manifest's
``optimizer.type`` says which. Any other optimizer keeps state the layout cannot hold, so a
manager refuses it when it is constructed, before a single training step.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

from ..errors import OptimizerMismatchError, UnsupportedOptimizerError, UnsupportedSetupError
from ..statemap import OPTIMIZERS, SUPPORTED

NOT_SETTINGS = ("params", "param_names")     # a group's members, recorded as names (``members``)


def kind(optimizer: torch.optim.Optimizer) -> str:
    """'Adam', 'AdamW' or 'SGD'; ``UnsupportedOptimizerError`` for anything else.

    >>> p = [torch.nn.Parameter(torch.zeros(2))]
    >>> kind(torch.optim.SGD(p, lr=0.1, momentum=0.9))
    'SGD'
    >>> kind(torch.optim.Adagrad(p))
    Traceback (most recent call last):
    ...
    ckptfmt.errors.UnsupportedOptimizerError: Adagrad keeps state the seed layout cannot hold; supported: Adam, AdamW (without amsgrad) and SGD (momentum or none)
    """
    optimizer = unwrapped(optimizer)
    name = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        raise UnsupportedOptimizerError(None, f"{name} keeps state the seed layout cannot hold; "
                                              f"supported: {SUPPORTED}")
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        raise UnsupportedOptimizerError(None, f"{name} with amsgrad keeps a third moment the seed "
                                              f"layout cannot hold; supported: {SUPPORTED}")
    return name


def unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a wrapper holds, where the wrapper is only a view of it: accelerate's
    ``AcceleratedOptimizer`` (what ``Accelerator.prepare`` returns) keeps the real one as
    ``.optimizer`` and hands out its very ``state`` and ``param_groups``, so mapping the wrapper
    is mapping the one inside. Known by that sharing, not by class name; anything else is itself.

    >>> class View(torch.optim.Optimizer):
    ...     def __init__(self, inner): self.optimizer = inner
    ...     state = property(lambda self: self.optimizer.state)
    ...     param_groups = property(lambda self: self.optimizer.param_groups)
    >>> inner = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    >>> unwrapped(View(inner)) is inner, kind(View(inner))
    (True, 'AdamW')
    """
    seen = 0
    while seen < 8 and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        inner = optimizer.optimizer
        if getattr(optimizer, "state", None) is not inner.state or \
                getattr(optimizer, "param_groups", None) is not inner.param_groups:
            break                           # a wrapper with state of its own: itself, refused by kind
        optimizer, seen = inner, seen + 1
    return optimizer


def scheduler_type(scheduler: Any) -> str:
    """The class name a manifest records for a scheduler (``scheduler_type``): the one inside
    accelerate's ``AcceleratedScheduler`` (``.scheduler``, whose ``state_dict`` it hands out),
    so a run saved under accelerate resumes in a plain loop and the reverse."""
    inner = getattr(scheduler, "scheduler", None)
    if inner is not None and callable(getattr(inner, "state_dict", None)) \
            and not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        return scheduler_type(inner)
    return type(scheduler).__name__


# ---------------------------------------------------------------- names
def names_of(model: torch.nn.Module) -> dict[int, str]:
    """Each parameter tensor's name (the first, for tied ones), by identity."""
    return {id(p): name for name, p in model.named_parameters()}


def aliases(model: torch.nn.Module) -> dict[str, str]:
    """Tied names -> the name their one tensor is stored under (``lm_head.weight`` ->
    ``wte.weight`` when ``lm_head.weight is wte.weight``)."""
    first = names_of(model)
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
            if first[id(p)] != name}


def members(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Each param group's parameter names, in the group's order."""
    names = names_of(model)
    return [[names[id(p)] for p in group["params"] if id(p) in names] for group in optimizer.param_groups]


def refuse_lazy(model: torch.nn.Module) -> None:
    """A lazy module's parameters (``nn.LazyLinear`` before its first forward) have no shape yet:
    refused by name, before torch fails deep inside a save."""
    for name, p in model.named_parameters():
        if isinstance(p, torch.nn.parameter.UninitializedParameter):
            raise UnsupportedSetupError(None, f"parameter {name} is uninitialized (a lazy module such as "
                                              "nn.LazyLinear): run one forward pass (or give the module its "
                                              "in_features) before checkpointing, so it has a shape")


# ---------------------------------------------------------------- settings
def settings(optimizer: torch.optim.Optimizer) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """(each param group's settings as JSON, each group's settings that were not plain JSON
    values, by kind: ``tuple``, ``numpy:float32``, ``tensor:float32:[]``). NumPy scalars and
    one-element tensors are stored as their numbers (exact for float32 and float64); anything
    else a manifest cannot hold is refused by name, before a byte is written."""
    groups, kinds = [], []
    for g, group in enumerate(optimizer.param_groups):
        row, said = {}, {}
        for key, value in group.items():
            if key in NOT_SETTINGS:
                continue
            row[key], how = setting(value, f"param group {g}: setting {key!r}")
            if how is not None:
                said[key] = how
        groups.append(row)
        kinds.append(said)
    return groups, kinds


def setting(value: Any, what: str) -> tuple[Any, str | None]:
    """(JSON value, its kind where it was not a plain JSON value) of one group setting."""
    if isinstance(value, (np.generic, np.ndarray)) and np.asarray(value).size == 1 \
            and np.asarray(value).dtype.kind in "biuf":      # before float: np.float64 is a float
        array = np.asarray(value)
        return setting(array.item(), what)[0], f"numpy:{array.dtype.name}"
    if value is None or isinstance(value, (bool, int, str)):
        return value, None
    if isinstance(value, float):
        if not math.isfinite(value):        # {"__float__"} would go into the group of a released reader
            raise UnsupportedSetupError(None, f"{what} is {value!r}: a manifest holds finite numbers only "
                                              "(strict JSON, and released readers copy each setting into the "
                                              "live group as it is)")
        return value, None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        return setting(value.item(), what)[0], f"tensor:{str(value.dtype).removeprefix('torch.')}:{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        items = [setting(v, f"{what}[{i}]") for i, v in enumerate(value)]
        if any(how is not None for _, how in items):
            raise UnsupportedSetupError(None, f"{what} is a {type(value).__name__} of {type(value[0]).__name__}s: "
                                              "a manifest holds lists of plain numbers")
        return [v for v, _ in items], "tuple" if isinstance(value, tuple) else None
    raise UnsupportedSetupError(None, f"{what} is a {type(value).__name__} ({value!r:.40}), which a manifest "
                                      "cannot hold (numbers, strings, booleans, None, NumPy scalars, one-element "
                                      "tensors and lists of them): remove it from the group before saving, or "
                                      "keep it outside the optimizer")


def setting_like(live: Any, saved: Any, how: str | None = None, recorded: bool = True) -> Any:
    """A saved setting in the type it had when saved (``how``, from ``settings``; None: a plain
    JSON value); for a file that did not record types (``recorded`` false), in the live one's
    type: tuples (betas), NumPy scalars and one-element tensors (a tensor lr, on the live
    tensor's device) come back as they were."""
    if how is None and not recorded:
        how = "tuple" if isinstance(live, tuple) else f"numpy:{np.asarray(live).dtype.name}" \
            if isinstance(live, np.generic) and np.asarray(live).dtype.kind in "biuf" else None
        if isinstance(live, torch.Tensor) and not isinstance(saved, (list, dict)):
            how = f"tensor:{str(live.dtype).removeprefix('torch.')}:{list(live.shape)}"
    if how == "tuple":
        return tuple(saved)
    if how is not None and how.startswith("numpy:"):
        return np.dtype(how.split(":", 1)[1]).type(saved)
    if how is not None and how.startswith("tensor:"):
        _, dtype, shape = how.split(":", 2)
        device = live.device if isinstance(live, torch.Tensor) else "cpu"
        return torch.tensor(saved, dtype=getattr(torch, dtype), device=device).reshape(json.loads(shape))
    return saved


# ---------------------------------------------------------------- state
def moments(params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
            step: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """(m tensors, v tensors, optimizer step) in parameter order; zeros where there is no state
    yet. The step is the largest any parameter has taken (``param_steps`` has each one); SGD
    keeps no step of its own: the caller's ``step`` is recorded instead."""
    first, second = OPTIMIZERS[kind(optimizer)]
    ms, vs = [], []
    for p in params:
        state = optimizer.state.get(p, {})
        ms.append(state[first] if state.get(first) is not None else torch.zeros_like(p))
        vs.append(state[second] if second and second in state else torch.zeros_like(p))
    return ms, vs, step_of(params, optimizer, step)


def step_of(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, step: int) -> int:
    """The optimizer step to record: the most any parameter has taken (Adam/AdamW), or the
    loop's ``step`` for SGD, which keeps no step of its own."""
    if OPTIMIZERS[kind(optimizer)][1] is None:
        return step
    return max((s for s in param_steps(params, optimizer) if s is not None), default=0)


def param_steps(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[int | None]:
    """Per parameter: its own optimizer step count (0 for SGD state), None where it has no state
    (never updated, frozen, or outside the optimizer): parameters may have taken different
    numbers of steps (a branch used every third step, experts, unfreezing)."""
    first, _ = OPTIMIZERS[kind(optimizer)]
    out: list[int | None] = []
    for p in params:
        state = optimizer.state.get(p, {})
        out.append(None if state.get(first) is None else int(state.get("step", 0)))
    return out


def describe(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """The manifest's ``optimizer``: type, step, each parameter's step (None: no state), every
    param group's settings (``setting_types`` where they were not plain numbers) and members."""
    groups, kinds = settings(optimizer)
    doc = {"type": kind(optimizer), "step": step, "hyperparams": groups, "setting_types": kinds,
           "param_steps": param_steps(list(model.parameters()), optimizer),
           "members": members(model, optimizer)}
    named = [group.get("param_names") for group in optimizer.param_groups]
    if all(isinstance(n, list) for n in named):
        doc["param_names"] = named          # torch 2.6+'s named groups: exports carry them again
    return doc


def refuse_outsiders(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer tensor that is no parameter of the model has no name and no place in the
    layout: its value and state would be lost, so it is refused."""
    known = {id(p) for p in model.parameters()}
    outside = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in known)
    if outside:
        raise UnsupportedSetupError(None, f"the optimizer holds {outside} tensor(s) that are not parameters "
                                          "of the model: their values and state would not be saved")


def check(optimizer: torch.optim.Optimizer, doc: dict[str, Any], path: str,
          names: dict[int, str] | None = None) -> list[int]:
    """For each live param group, the saved group it takes its settings from; refuses a
    checkpoint of another optimizer type, another group count, or (where the checkpoint records
    ``members`` and ``names`` gives the live parameters' names) groups of other parameters.
    Groups are matched by their members, so a loop may list them in another order; a live group
    that holds a saved group's members and more (parameters unfrozen since) takes its settings."""
    name = kind(optimizer)
    if doc.get("type") != name:
        raise OptimizerMismatchError(path, f"optimizer: the checkpoint holds {doc.get('type')} state, "
                                           f"the loop uses {name}")
    groups = doc.get("hyperparams") or []
    if len(groups) != len(optimizer.param_groups):
        raise OptimizerMismatchError(path, f"optimizer: {len(groups)} param groups in the checkpoint, "
                                           f"{len(optimizer.param_groups)} in the loop")
    saved = doc.get("members")
    if names is None or not isinstance(saved, list):
        return list(range(len(groups)))         # a file before members: by position, as it was written
    live = [[names.get(id(p), "?") for p in group["params"]] for group in optimizer.param_groups]
    return _match(live, saved, path)


def _match(live: list[list[str]], saved: list[list[str]], path: str) -> list[int]:
    out: list[int] = []
    for j, group in enumerate(live):
        same = [i for i, s in enumerate(saved) if set(s) == set(group) and i not in out] or \
            [i for i, s in enumerate(saved) if set(s) < set(group) and i not in out]   # unfrozen since
        if not same:
            near = saved[j] if j < len(saved) else []
            extra = next((n for n in group if n not in near), None)
            lacking = next((n for n in near if n not in group), None)
            said = f"holds {extra}, which the checkpoint's group {j} does not" if extra else \
                f"lacks {lacking}, which the checkpoint's group {j} holds"
            raise OptimizerMismatchError(path, f"optimizer: the loop's param group {j} ({len(group)} "
                                               f"parameters) is none of the checkpoint's groups: it {said}; "
                                               "build the optimizer's groups from the same parameters")
        out.append(j if j in same else same[0])
    return out


def restore(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], doc: dict[str, Any],
            m: list[torch.Tensor], v: list[torch.Tensor], order: list[int]) -> None:
    """Load the optimizer from the manifest's ``optimizer`` and the m, v tensors (already in
    parameter order, dtype and device): each parameter's state by identity, each live group's
    settings from the saved group ``order`` gives it (``check``, run before anything was copied)."""
    name = kind(optimizer)
    groups, kinds = doc.get("hyperparams") or [], doc.get("setting_types")
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    steps = doc.get("param_steps") or [doc["step"]] * len(params)
    first, second = OPTIMIZERS[name]
    state: dict[int, dict[str, Any]] = {}
    for p, mt, vt, taken in zip(params, m, v, steps):
        if taken is None or id(p) not in index:
            continue
        state[index[id(p)]] = {first: mt} if second is None else \
            {"step": torch.tensor(float(taken), dtype=torch.float32), first: mt, second: vt}
    saved = [{**group_settings(live, groups[i], kinds_of(kinds, i)),
              "params": [index[id(p)] for p in live["params"]]}
             for i, live in zip(order, optimizer.param_groups)]
    optimizer.load_state_dict({"state": state, "param_groups": saved})


def kinds_of(recorded: Any, group: int) -> dict[str, str] | None:
    """Group ``group``'s entry of a manifest's ``setting_types``; None for a file written before
    them (its settings then take the live group's types)."""
    if not isinstance(recorded, list):
        return None
    return recorded[group] if group < len(recorded) and isinstance(recorded[group], dict) else {}


def group_settings(live: dict[str, Any], saved: dict[str, Any], kinds: dict[str, str] | None) -> dict[str, Any]:
    """A live group's settings after a restore: the saved ones in the types they had (``kinds``;
    None: in the live group's types), the live group's own where the file has none (a setting an
    earlier writer dropped, a key a newer torch added), and the live group's ``param_names`` kept
    (a group that had none gets none)."""
    out = {k: v for k, v in live.items() if k not in NOT_SETTINGS}      # a key the file lacks stays
    out.update({k: setting_like(live.get(k), value, (kinds or {}).get(k), kinds is not None)
                for k, value in saved.items() if k not in NOT_SETTINGS})
    if "param_names" in live:
        out["param_names"] = live["param_names"]
    return out
