"""Per-step digests of the state a loop's next step starts from (spec/RUN.md §3.9).

``mgr.step(k)`` records, beside step k's loss, a short digest of every piece of state the
manager saves, as it stands when the loop hands step k over: after step k's update, before
anything of step k+1. Two runs that should be one (a straight run and a resumed one) then
write the same digests step by step, and the first step where they part names the piece that
parted (an RNG a restore did not put back, a scheduler restored one step off), long before
the losses drift apart. The Lightning and Hugging Face callbacks record the same components of
what their frameworks' checkpoints restore (``lightning.callback``, ``hf.digests``), a state that
is a value there rather than one object's as a ``Held`` piece.

A digest is the first 16 hex digits of blake3 over a canonical encoding: the value's JSON text
(Python's ``json.dumps`` with sorted keys, no whitespace; NaN and infinities as ``NaN``,
``Infinity``), with each tensor or array written as ``{"__tensor__": [dtype, shape]}`` and its
raw bytes (C order) hashed after the text, in the order the text names them. The learning rates,
the optimizer's step and the GradScaler's scale are not digested: the record holds them as they
are (a diagnosis wants the number).
"""
from __future__ import annotations

import json
import random
from array import array
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from .. import fingerprint
from ..errors import UnsupportedOptimizerError
from . import loaders, optim, rng
from .state import dtype_name

__all__ = ["Held", "UpdateLrs", "digest", "state_digests"]

HEX = 16                                  # hex digits kept: 64 bits, collisions out of reach
# The manager's ``digests=``: off, for they cost about 3 % of a tiny-config step (0.45 ms, most of
# it the caches the training step leaves cold), over the 1 % a default may cost
# (``python -m benchmarks digests``, benchmarks/results/digests.jsonl).
DEFAULT = False
BUILT_IN = ("python", "numpy", "torch")   # the process's own RNGs: "rng.python", ...


def digest(value: Any) -> str:
    """The first ``HEX`` hex digits of blake3 over ``value``'s canonical encoding.

    >>> digest({"b": 1, "a": [1.5, None]}) == digest({"a": [1.5, None], "b": 1})
    True
    >>> digest(torch.zeros(2)) == digest(np.zeros(2, dtype=np.float32)), digest(torch.zeros(2)) == digest(torch.zeros(3))
    (True, False)
    >>> digest(torch.tensor(1.0)) == digest(np.array(1.0, dtype=np.float32)) != digest(torch.ones(1))
    True
    """
    tensors: list[Any] = []
    text = _text(value, tensors)
    h = fingerprint.hasher(1)
    h.update(text.encode("ascii"))
    for raw in tensors:
        h.update(raw)
    return h.hexdigest()[:HEX]


def _text(value: Any, tensors: list[Any]) -> str:
    """The JSON text of ``value``; each tensor's bytes appended to ``tensors`` as the text names it."""
    def default(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return tensor(dtype_name(obj.dtype), _array(obj))
        if isinstance(obj, np.ndarray):        # (ascontiguousarray would make a 0-d array 1-d)
            return tensor(str(obj.dtype), obj if obj.flags.c_contiguous else np.ascontiguousarray(obj))
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, (set, frozenset)):
            return sorted(obj, key=repr)
        return {"__unencodable__": type(obj).__qualname__}   # the manager refuses it at save anyway

    def tensor(dtype: str, arr: np.ndarray) -> dict[str, Any]:
        tensors.append(arr.reshape(-1).view(np.uint8))
        return {"__tensor__": [dtype, list(arr.shape)]}
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=default)
    except TypeError:            # keys of several types (1 and "a") cannot be sorted: all as text
        tensors.clear()
        return json.dumps(_str_keys(value), sort_keys=True, separators=(",", ":"), default=default)


def _str_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _str_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_str_keys(v) for v in value]
    return value


def _array(t: torch.Tensor) -> np.ndarray:
    """A CPU array of the tensor's exact bytes (bfloat16, which NumPy lacks, as its int16 bits)."""
    t = t.detach().cpu().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


class Held:
    """A piece of state a framework's checkpoint holds as a value rather than as one object's
    ``state_dict()`` (Lightning's list of several schedulers' states, the Trainer's epoch),
    given to ``state_digests`` as a piece like any other."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state


def state_digests(*, optimizer: torch.optim.Optimizer | None, pieces: Iterable[tuple[str, Any]],
                  generators: Mapping[str, Any], scaler: Any, step: int) -> dict[str, Any]:
    """Every component of a step record's ``state`` (spec/RUN.md §3.9), as the state stands now:
    the RNGs, each piece's ``state_dict()`` as saved (``scheduler``, ``amp.scaler``, ``state.NAME``; one
    with a ``digest_every`` of N only at steps that are multiples of N), each param group's lr,
    the optimizer's step (no optimizer: neither) and the GradScaler's scale."""
    out = rng_digests(generators)
    scaler_state = None
    for piece, obj in pieces:
        if step % every(piece, obj):
            continue                 # an expensive state_dict, digested every N steps only
        state = loaders.state_of(obj)       # what the manager saves of it
        out[piece] = digest(state)
        if obj is scaler:
            scaler_state = state
    if optimizer is not None:
        for g, group in enumerate(optimizer.param_groups):
            out[f"lr.{g}"] = float(group["lr"])
        out["optimizer.step"] = optimizer_step(optimizer, step)
    if scaler is not None:       # its state_dict holds the scale (a disabled one's is empty)
        out["amp.scale"] = float((scaler_state or {}).get("scale", scaler.get_scale()))
    return out


def rng_digests(generators: Mapping[str, Any]) -> dict[str, str]:
    """The digest of every RNG ``rng.rng_state`` captures (and of every CUDA device's), each
    over its state as its library gives it: Python's ``getstate()`` (its 625 words as uint32),
    NumPy's global ``get_state()``, torch's CPU and CUDA states (uint8 tensors), a named
    NumPy generator's ``bit_generator.state``, a torch generator's ``get_state()``. Raw, not
    the manifest's JSON of them: as JSON text the 1,249 words of Python's and NumPy's Mersenne
    Twisters took 90 us a step, as arrays 10."""
    version, internal, gauss = random.getstate()
    out = {"rng.python": digest([version, np.frombuffer(array("I", internal), dtype=np.uint32), gauss]),
           "rng.numpy": digest(np.random.get_state()),
           "rng.torch": digest(torch.get_rng_state())}
    if rng.cuda_device() is not None:     # not before the process uses CUDA: asking initialises it
        for i in range(torch.cuda.device_count()):
            out[f"rng.cuda.{i}"] = digest(torch.cuda.get_rng_state(i))
    for name, gen in generators.items():
        if isinstance(gen, np.random.Generator):
            out[generator_key(name)] = digest(gen.bit_generator.state)
        else:
            out[generator_key(name)] = digest(gen.get_state())
    return out


def every(piece: str, obj: Any) -> int:
    """How often ``obj``'s state is digested: its ``digest_every`` (a loader whose ``state_dict``
    asks each worker process for its state), every step without one."""
    n = getattr(obj, "digest_every", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{piece}.digest_every must be a positive integer (digest its state every N steps), "
                         f"got {n!r}")
    return n


def generator_key(name: str) -> str:
    """``rng.NAME`` of a named generator; ``rng.generators.NAME`` where NAME is one of the
    process's own RNGs' (``numpy``) or a CUDA device's (``cuda.0``), which it would hide."""
    clash = name in BUILT_IN or name.startswith(("cuda.", "generators."))
    return f"rng.generators.{name}" if clash else f"rng.{name}"


def optimizer_step(optimizer: torch.optim.Optimizer, step: int) -> int:
    """The optimizer's step as the manifest records it (``optim.step_of``: the most any parameter
    has taken; the loop's ``step`` for SGD), with one device sync per device, not one per
    parameter (fused and capturable Adam keep each step on the parameter's device). An optimizer
    the seed layout cannot hold (a Trainer's Adafactor: its checkpoint is the Trainer's own
    ``optimizer.pt``) gives the most steps its state counts, the loop's ``step`` where it counts none."""
    try:
        if optim.OPTIMIZERS[optim.kind(optimizer)][1] is None:
            return step
    except UnsupportedOptimizerError:
        if not any("step" in state for state in optimizer.state.values()):
            return step
    steps = [state["step"] for state in optimizer.state.values() if "step" in state]
    here = [s for s in steps if getattr(s, "is_cpu", True)]     # a number, or a tensor on the CPU
    counted = [max(map(float, here))] if here else []
    on_device: dict[Any, list[torch.Tensor]] = {}
    for s in steps if len(here) < len(steps) else ():
        if not getattr(s, "is_cpu", True):
            on_device.setdefault(s.device, []).append(s.reshape(()))
    counted += [torch.stack(group).max().item() for group in on_device.values()]
    return int(max(counted, default=0))


class UpdateLrs:
    """The learning rate each param group's update used, seen by a step pre-hook on the optimizer
    (``update.lr.G`` in the record of the step: spec/RUN.md §3.9). The record's ``lr.G`` is the lr
    the next step will find; an lr written into ``param_groups`` after restore that the
    scheduler's next step writes over (a scheduler built or loaded after restore) shows only here."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.used: list[float] | None = None
        self.handle = optimizer.register_step_pre_hook(self._seen)

    def _seen(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.used = [float(group["lr"]) for group in optimizer.param_groups]

    def fields(self) -> dict[str, float]:
        """``update.lr.G`` of the newest update, none before the first."""
        return {} if self.used is None else {f"update.lr.{g}": lr for g, lr in enumerate(self.used)}
