"""Loop state as JSON plus tensors: ``split`` a ``state_dict()`` into a strict-JSON tree (for the
manifest) and the tensors and arrays it holds (for the generation's companion file); ``join``
puts them back, bit for bit.

A tensor or array in the tree becomes ``{"__tensor__": KEY, "kind": "torch"|"numpy", ...}``
with KEY its name in the companion file; a float JSON cannot hold (NaN, inf) becomes
``{"__float__": "nan"}``; a tuple becomes ``{"__tuple__": [...]}`` so it comes back a tuple.
Anything else that JSON cannot hold is refused by its path, never dropped silently.

>>> tree, tensors = split({"perm": torch.tensor([2, 0, 1]), "epoch": 3, "best": float("inf")}, "data")
>>> tree["perm"], tree["best"], sorted(tensors)
({'__tensor__': 'data/perm', 'kind': 'torch', 'dtype': 'int64'}, {'__float__': 'inf'}, ['data/perm'])
>>> back = join(tree, {k: v for k, v in tensors.items()})
>>> back["perm"].tolist(), back["epoch"], back["best"]
([2, 0, 1], 3, inf)
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np
import torch

from .. import companion
from ..errors import IncompleteResumeStateError

MARKERS = ("__tensor__", "__float__", "__tuple__", "__dict__")

# torch dtypes the companion file holds, by name; bfloat16 travels as its uint16 bits.
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
          "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for ``torch.bfloat16`` (the names of ``DTYPES``)."""
    return str(dtype).removeprefix("torch.")


def to_array(t: torch.Tensor) -> "np.ndarray | tuple[str, np.ndarray]":
    """A CPU numpy array of the tensor's exact bytes (``("BF16", uint16 bits)`` for bfloat16)."""
    t = t.detach().to("cpu", copy=True).contiguous()   # a copy: training goes on changing t
    if t.dtype == torch.bfloat16:
        return "BF16", t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_array(array: np.ndarray, dtype: str) -> torch.Tensor:
    """The tensor ``to_array`` stored (a copy: the companion's map is read-only)."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.array(array, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(array))


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``state_dict`` holds besides parameters (tied aliases of a parameter included in
    the parameters, not the buffers)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in model.state_dict().items() if k not in params}


def split(obj: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """(strict-JSON tree, {companion key: array}) of a nested state."""
    tensors: dict[str, Any] = {}
    return _split(obj, prefix, tensors), tensors


def _key(path: str, tensors: dict[str, Any]) -> str:
    """A companion key for ``path`` no other entry has (paths can coincide: "a/b" vs a.b)."""
    return path if path not in tensors else f"{path}#{len(tensors)}"


def _split(obj: Any, path: str, tensors: dict[str, Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.dtype.is_complex or dtype_name(obj.dtype) not in DTYPES:
            raise TypeError(f"{path}: a {obj.dtype} tensor cannot be checkpointed")
        key = _key(path, tensors)
        tensors[key] = to_array(obj)
        return {"__tensor__": key, "kind": "torch", "dtype": dtype_name(obj.dtype)}
    if isinstance(obj, (np.ndarray, np.generic)):
        return _split_numpy(np.asarray(obj), path, tensors, scalar=isinstance(obj, np.generic))
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [_split(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_split(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
            raise TypeError(f"{path}: state keys must be str or int")
        if any(isinstance(k, int) or k in MARKERS for k in obj):    # keys JSON or the markers would change
            return {"__dict__": [[k, _split(v, f"{path}/{k}", tensors)] for k, v in obj.items()]}
        return {k: _split(v, f"{path}/{k}", tensors) for k, v in obj.items()}
    raise TypeError(f"{path}: a {type(obj).__name__} cannot be checkpointed (not JSON, tensor or array)")


def _split_numpy(array: np.ndarray, path: str, tensors: dict[str, Any], scalar: bool) -> dict[str, Any]:
    try:
        companion.code_of(array)            # refused here, before anything is written
    except TypeError:
        raise TypeError(f"{path}: a numpy {array.dtype} array cannot be checkpointed") from None
    key = _key(path, tensors)
    tensors[key] = np.array(array, copy=True, order="C")   # the companion writes it little-endian
    return {"__tensor__": key, "kind": "numpy-scalar" if scalar else "numpy", "dtype": array.dtype.str}


def join(tree: Any, tensors: "Mapping[str, Any] | Callable[[str], Any]") -> Any:
    """The state ``split`` took apart; ``tensors`` maps (or looks up) companion keys to arrays."""
    get = tensors if callable(tensors) else tensors.__getitem__
    if isinstance(tree, list):
        return [join(v, get) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "__tensor__" in tree:
        return _tensor(tree, get)
    if "__float__" in tree:
        return float(tree["__float__"])
    if "__tuple__" in tree:
        return tuple(join(v, get) for v in tree["__tuple__"])
    if "__dict__" in tree:
        return {k: join(v, get) for k, v in tree["__dict__"]}
    return {k: join(v, get) for k, v in tree.items()}


def _tensor(tree: dict[str, Any], get: Callable[[str], Any]) -> Any:
    try:
        array = get(tree["__tensor__"])
    except KeyError:
        raise IncompleteResumeStateError(None, f"companion file lacks tensor {tree['__tensor__']}") from None
    if isinstance(array, tuple):          # straight from split: (safetensors code, array)
        array = array[1]
    if tree["kind"] in ("numpy", "numpy-scalar"):
        value = np.array(array, dtype=np.dtype(tree["dtype"]))
        return value[()] if tree["kind"] == "numpy-scalar" else value
    return from_array(array, tree["dtype"])
