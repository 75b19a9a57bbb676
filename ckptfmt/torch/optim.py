"""Which optimizers the seed layout can hold, and how their state maps onto m and v.

The layout has two moment regions. Adam and AdamW fill both (``m`` = ``exp_avg``, ``v`` =
``exp_avg_sq``); SGD with momentum fills ``m`` with its momentum buffer and leaves ``v`` zero;
the manifest's ``optimizer.type`` says which. Any other optimizer keeps state the layout cannot
hold, so a manager refuses it when it is constructed, before a single training step.
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import OptimizerMismatchError, UnsupportedOptimizerError
from . import adapter

SUPPORTED = "Adam, AdamW (without amsgrad) and SGD (momentum or none)"
MOMENTS = {"Adam": ("exp_avg", "exp_avg_sq"), "AdamW": ("exp_avg", "exp_avg_sq"),
           "SGD": ("momentum_buffer", None)}


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
    name = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        raise UnsupportedOptimizerError(None, f"{name} keeps state the seed layout cannot hold; "
                                              f"supported: {SUPPORTED}")
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        raise UnsupportedOptimizerError(None, f"{name} with amsgrad keeps a third moment the seed "
                                              f"layout cannot hold; supported: {SUPPORTED}")
    return name


def moments(params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
            step: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """(m tensors, v tensors, optimizer step) in parameter order; zeros where there is no state
    yet. The step is the largest any parameter has taken (``param_steps`` has each one); SGD
    keeps no step of its own: the caller's ``step`` is recorded instead."""
    first, second = MOMENTS[kind(optimizer)]
    ms, vs = [], []
    for p in params:
        state = optimizer.state.get(p, {})
        ms.append(state[first] if state.get(first) is not None else torch.zeros_like(p))
        vs.append(state[second] if second and second in state else torch.zeros_like(p))
    return ms, vs, step_of(params, optimizer, step)


def step_of(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, step: int) -> int:
    """The optimizer step to record: the most any parameter has taken (Adam/AdamW), or the
    loop's ``step`` for SGD, which keeps no step of its own."""
    if MOMENTS[kind(optimizer)][1] is None:
        return step
    return max((s for s in param_steps(params, optimizer) if s is not None), default=0)


def param_steps(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[int | None]:
    """Per parameter: its own optimizer step count (0 for SGD state), None where it has no state
    (never updated, frozen, or outside the optimizer): parameters may have taken different
    numbers of steps (a branch used every third step, experts, unfreezing)."""
    first, _ = MOMENTS[kind(optimizer)]
    out: list[int | None] = []
    for p in params:
        state = optimizer.state.get(p, {})
        out.append(None if state.get(first) is None else int(state.get("step", 0)))
    return out


def describe(optimizer: torch.optim.Optimizer, step: int, params: list[torch.Tensor]) -> dict[str, Any]:
    """The manifest's ``optimizer``: type, step, each parameter's step (None: no state) and
    every param group's JSON-able settings."""
    return {"type": kind(optimizer), "step": step, "hyperparams": adapter.hyperparams(optimizer),
            "param_steps": param_steps(params, optimizer)}


def check(optimizer: torch.optim.Optimizer, doc: dict[str, Any], path: str) -> str:
    """The optimizer's type; refuses a checkpoint of another type or param-group count."""
    name = kind(optimizer)
    if doc.get("type") != name:
        raise OptimizerMismatchError(path, f"optimizer: the checkpoint holds {doc.get('type')} state, "
                                           f"the loop uses {name}")
    groups = doc.get("hyperparams") or []
    if len(groups) != len(optimizer.param_groups):
        raise OptimizerMismatchError(path, f"optimizer: {len(groups)} param groups in the checkpoint, "
                                           f"{len(optimizer.param_groups)} in the loop")
    return name


def restore(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], doc: dict[str, Any],
            m: list[torch.Tensor], v: list[torch.Tensor], path: str) -> None:
    """Load the optimizer from the manifest's ``optimizer`` and the m, v tensors (already in
    parameter order, dtype and device)."""
    name = check(optimizer, doc, path)
    groups = doc.get("hyperparams") or []
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    steps = doc.get("param_steps") or [doc["step"]] * len(params)
    first, second = MOMENTS[name]
    state: dict[int, dict[str, Any]] = {}
    for p, mt, vt, taken in zip(params, m, v, steps):
        if taken is None or id(p) not in index:
            continue
        state[index[id(p)]] = {first: mt} if second is None else \
            {"step": torch.tensor(float(taken), dtype=torch.float32), first: mt, second: vt}
    saved = [{**{k: adapter.setting_like(live.get(k), v) for k, v in group.items()},
              "params": [index[id(p)] for p in live["params"]]}
             for group, live in zip(groups, optimizer.param_groups)]
    optimizer.load_state_dict({"state": state, "param_groups": saved})

