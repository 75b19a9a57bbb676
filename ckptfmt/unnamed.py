"""The moments of an optimizer whose param groups do not name their parameters: several groups
and no usable ``param_names`` (every nanoGPT ``ckpt.pt``). Which parameter each moment belongs
to cannot be known from the file (a shape match is no proof), so ``convert`` into a ``.bin``
asks for ``--groups`` (spec/FORMAT.md §10.6). The commands that only read (inspect, validate,
diff) take the moments in the optimizer's own order instead: their statistics and value checks
do not depend on the order, and two files of one optimizer compare index by index.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .errors import UnsupportedConversionError
from .statemap import Entry, Optimizer, widen

__all__ = ["ORDER", "members", "by_index", "moments", "structure"]

PREFIX = "#"            # a member named by the optimizer's own index, not by a parameter
ORDER = "in the optimizer's order (its param groups do not name their parameters)"
HINT = "--groups FILE, a JSON list of each param group's parameter names, to name them"


def members(indices: list[list[int]]) -> list[list[str]]:
    """Each group's members named by the optimizer's index (``#3``)."""
    return [[f"{PREFIX}{i}" for i in group] for group in indices]


def by_index(opt: Optimizer | None) -> bool:
    """The optimizer's members are its indices, not parameter names."""
    return opt is not None and any(name.startswith(PREFIX) for name in opt.order)


def moments(opt: Optimizer, params: list[Entry], path: str) -> tuple[np.ndarray, np.ndarray]:
    """(m, v) as float32 in the optimizer's order, beside ``params`` (the tensors that look like
    parameters); refused where they cannot stand beside them value for value."""
    order = opt.order
    if len(order) != len(params):
        raise UnsupportedConversionError(path, f"the optimizer holds {len(order)} parameters, the model state dict "
                                               f"{len(params)} floating tensors that look like parameters: cannot "
                                               f"tell parameters from buffers (convert into a .bin with {HINT})")
    empty = next((name for name in order if opt.first.get(name) is None), None)
    if empty is not None:
        raise UnsupportedConversionError(path, f"optimizer index {empty[len(PREFIX):]} has no state yet and its param "
                                               f"groups do not name their parameters, so its size is unknown "
                                               f"(convert into a .bin with {HINT})")
    first = [widen(opt.first[name]) for name in order]
    second = [widen(opt.second[name]) if opt.second.get(name) is not None else np.zeros(f.size, "<f4")
              for name, f in zip(order, first)]
    m = np.concatenate(first) if first else np.zeros(0, "<f4")
    if m.size != sum(int(np.prod(e.shape)) for e in params):
        raise UnsupportedConversionError(path, f"the optimizer's moments hold {m.size} values, the parameters "
                                               f"{sum(int(np.prod(e.shape)) for e in params)}: they do not belong "
                                               "to these parameters")
    return m, np.concatenate(second) if second else np.zeros(0, "<f4")


def structure(opt: Optimizer) -> list[dict[str, Any]]:
    """What must be equal for two files' moments to be compared index by index: each group's
    settings and the shape of each member's moments, in the optimizer's order."""
    return [{"settings": settings, "shapes": [list(opt.first[name].shape) if opt.first.get(name) is not None
                                              else None for name in group]}
            for settings, group in zip(opt.groups, opt.members)]
