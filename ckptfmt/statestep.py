"""The step a checkpoint's state records (spec/FORMAT.md §10.7), one rule for every reader and
writer of foreign state: ``inspect``, ``validate`` and ``diff`` of a foreign file, ``convert``
into a ``.bin`` and a Lightning checkpoint directory all say the same step for the same state.

1. An optimizer that counts its own steps (Adam, AdamW): its count (the largest step any
   parameter took; 0 for one that never stepped).
2. Otherwise the step the caller names (a canonical ``.bin`` name's: the header must agree with
   it; Lightning's ``global_step``), where it names one.
3. Otherwise a whole number the container held beside the state under one of ``STEP_KEYS``
   (``{"model": ..., "step": 5}``; nanoGPT's ``iter_num``), a Python int or a 0-d integer
   tensor, within the header's range.
4. Otherwise 0.

Torch-free: a state (``statemap.State``) is read by its fields only.

>>> from types import SimpleNamespace as NS
>>> header_step(NS(optimizer=None, imported={"other": {"iter_num": 7}}, extra={}), None)
7
>>> header_step(NS(optimizer=None, imported={"other": {"iter_num": 7}}, extra={}), 9)
9
"""
from __future__ import annotations

from typing import Any

from . import format as fmt

__all__ = ["STEP_KEYS", "header_step", "beside"]

STEP_KEYS = ("step", "global_step", "iter_num", "iteration")   # what loops save beside their state


def header_step(state: Any, named: int | None) -> int:
    """The step a ``.bin`` of ``state`` records, by the rule above; ``named``: the step the
    caller's name says (None: it says none)."""
    opt = state.optimizer
    if opt is not None and opt.counts_steps:      # statemap.Optimizer: by the one optimizer table
        return opt.step
    if named is not None:
        return named
    found = beside(state)
    return found if found is not None else 0


def beside(state: Any) -> int | None:
    """The first of ``STEP_KEYS`` the container held beside the state as a whole number in the
    header's range (a 0-d integer tensor too); None where none is."""
    other = state.imported.get("other") if isinstance(state.imported, dict) else None
    if not isinstance(other, dict):
        return None
    for key in STEP_KEYS:
        value = other.get(key)
        if isinstance(value, dict) and isinstance(value.get("__tensor__"), str):
            value = _scalar((state.extra or {}).get(value["__tensor__"]))
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= fmt.MAX_STEP:
            return value
    return None


def _scalar(tensor: Any) -> Any:
    """A 0-d tensor's (torch or numpy) Python value; None for anything else."""
    if getattr(tensor, "ndim", None) != 0 or not hasattr(tensor, "item"):
        return None
    return tensor.item()
