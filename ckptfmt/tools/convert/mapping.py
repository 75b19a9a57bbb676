"""The mapping rule for foreign checkpoints (spec §10.7), without torch: a model state dict and
an Adam/AdamW state as plain arrays (``State``), which tensors are parameters and which are
buffers, and the exact float32 widening of float16/bfloat16 parameters.

The rule: the optimizer's parameter indices, concatenated in ``param_groups`` order, are the
model's parameters in ``model.parameters()`` order. Every floating tensor of the state dict is
a parameter unless it is an alias of an earlier tensor (tied weights) or named like a
BatchNorm buffer (``running_mean``, ``running_var``, ``num_batches_tracked``); everything else
(integer tensors, those buffers) goes to the companion file. With an optimizer, the count of
parameters must equal its count of indices and every shape must equal that index's state
shape, or the file is refused naming the tensor: nothing is guessed.

>>> e = Entry("bn.weight", "bfloat16", [2], np.array([0x3F80, 0xC000], dtype="<u2"))
>>> widen(e).tolist(), narrow(widen(e), "bfloat16").tolist() == e.data.tolist()
([1.0, -2.0], True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import UnsupportedConversionError

BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked")
FLOATING = ("float32", "float16", "bfloat16")        # the float types float32 holds exactly


@dataclass
class Entry:
    """One tensor of a state dict: its exact bytes, little-endian (bfloat16 as uint16 bits)."""
    name: str
    dtype: str                  # torch's spelling: float32, bfloat16, int64, ...
    shape: list[int]
    data: np.ndarray
    alias_of: str | None = None     # tied weights: the same tensor under an earlier name

    def same(self, other: "Entry") -> bool:
        """Equal name, dtype, shape, alias and bytes (NaN payloads and -0.0 included)."""
        return (self.name, self.dtype, list(self.shape), self.alias_of) == \
            (other.name, other.dtype, list(other.shape), other.alias_of) and \
            np.ascontiguousarray(self.data).tobytes() == np.ascontiguousarray(other.data).tobytes()


@dataclass
class Optimizer:
    """An Adam/AdamW state dict in parameter-index order (param_groups concatenated)."""
    kind: str                                   # "Adam" or "AdamW"
    groups: list[dict[str, Any]]                # each group's settings, JSON (tuples as lists)
    indices: list[list[int]]                    # each group's "params"
    tuples: list[str]                           # settings that were tuples (betas)
    exp_avg: list[Entry | None]                 # None: the index has no state yet
    exp_avg_sq: list[Entry | None]
    steps: list[int | None]

    @property
    def order(self) -> list[int]:
        """Parameter indices in param_groups order."""
        return [i for group in self.indices for i in group]


@dataclass
class State:
    """A foreign checkpoint: the model state dict (in its order, aliases included), the
    optimizer (None without one) and what the foreign container held besides (``imported``)."""
    model: list[Entry]
    optimizer: Optimizer | None = None
    imported: dict[str, Any] = field(default_factory=dict)


def is_buffer_name(name: str) -> bool:
    """True for names like a BatchNorm buffer (``bn1.running_mean``)."""
    return name.rsplit(".", 1)[-1] in BUFFER_NAMES


def split(state: State, path: str) -> tuple[list[Entry], list[Entry]]:
    """(parameters in order, buffers in order) by the rule above; refuses what it cannot map."""
    params, buffers = [], []
    for e in state.model:
        if e.alias_of is not None:
            continue
        floating = e.dtype in FLOATING or e.dtype == "float64"
        (params if floating and not is_buffer_name(e.name) else buffers).append(e)
    if not params:
        kinds = sorted({e.dtype for e in buffers})
        raise UnsupportedConversionError(path, f"no floating-point parameter tensor (it holds {', '.join(kinds) or 'none'}"
                                               "): nothing to put in the weights")
    for e in params:
        if e.dtype == "float64":
            raise UnsupportedConversionError(path, f"{e.name}: a float64 parameter does not fit the float32 "
                                                   "layout without rounding; cast the model to float32 first")
    if state.optimizer is not None:
        _match(params, state.optimizer, path)
    return params, buffers


def _match(params: list[Entry], opt: Optimizer, path: str) -> None:
    order = opt.order
    if len(params) != len(order):
        names = ", ".join(e.name for e in params[len(order):][:3]) or "none left"
        raise UnsupportedConversionError(path, f"the model state dict has {len(params)} floating tensors "
                                               f"that look like parameters, the optimizer holds {len(order)} "
                                               f"(first unmatched: {names}): cannot tell parameters from buffers")
    for position, (e, moment) in enumerate(zip(params, opt.exp_avg)):
        if moment is not None and list(moment.shape) != list(e.shape):
            raise UnsupportedConversionError(path, f"{e.name}: shape {list(e.shape)} in the model, optimizer "
                                                   f"parameter {position} has {list(moment.shape)} (its "
                                                   "param_groups are not in model.parameters() order)")


def widen(e: Entry) -> np.ndarray:
    """The entry's values as flat float32, exactly (float16 and bfloat16 fit in float32)."""
    flat = np.ascontiguousarray(e.data).reshape(-1)
    if e.dtype == "float32":
        return flat.view("<f4")
    if e.dtype == "float16":
        return flat.view("<f2").astype("<f4")
    if e.dtype == "bfloat16":
        return (flat.view("<u2").astype("<u4") << 16).view("<f4")
    raise UnsupportedConversionError(None, f"{e.name}: {e.dtype} is not a float type")


def narrow(values: np.ndarray, dtype: str) -> np.ndarray:
    """The inverse of ``widen`` for values that came from ``dtype`` (bytes, bfloat16 as bits)."""
    values = np.ascontiguousarray(values, dtype="<f4")
    if dtype == "float32":
        return values
    if dtype == "float16":
        return values.astype("<f2")
    if dtype == "bfloat16":
        return (values.view("<u4") >> 16).astype("<u2")
    raise UnsupportedConversionError(None, f"{dtype} is not a float type")


def layout(params: list[Entry]) -> list[dict[str, Any]]:
    """The manifest's layout: name, shape, offset, and dtype where it is not float32."""
    out, offset = [], 0
    for e in params:
        row: dict[str, Any] = {"name": e.name, "shape": list(e.shape), "offset": offset}
        if e.dtype != "float32":
            row["dtype"] = e.dtype
        out.append(row)
        offset += math.prod(e.shape)
    return out


def regions(params: list[Entry], opt: Optimizer | None) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """(weights, m, v) as float32 pieces in parameter order; zeros where there is no state."""
    weights = [widen(e) for e in params]
    if opt is None:
        zeros = [np.zeros(w.size, dtype="<f4") for w in weights]
        return weights, zeros, zeros
    ms = [widen(a) if a is not None else np.zeros(w.size, "<f4") for a, w in zip(opt.exp_avg, weights)]
    vs = [widen(a) if a is not None else np.zeros(w.size, "<f4") for a, w in zip(opt.exp_avg_sq, weights)]
    return weights, ms, vs
