"""A PyTorch training checkpoint in and out (spec §10.7): a ``torch.save`` of a model state
dict and an Adam/AdamW optimizer state dict, under ``model``/``optimizer``,
``state_dict``/``optimizer``, ``model_state_dict``/``optimizer_state_dict``, or a bare model
state dict. Loaded only with ``torch.load(weights_only=True)`` (``pt.read``); torch comes from
``require_torch``, so nothing here runs without it. ``to_state`` turns the loaded object into a
``mapping.State``; ``from_state`` builds the object back (``--to torch``); ``difference``
compares two such objects bit for bit.
"""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from ...errors import UnsupportedConversionError
from .mapping import Entry, Optimizer, State
from .source import require_torch

CONTAINERS = (("model", "optimizer"), ("state_dict", "optimizer"), ("model_state_dict", "optimizer_state_dict"))
PREFIXES = ("module.", "_orig_mod.")       # DDP's and torch.compile's wrappers
MOMENTS = ("step", "exp_avg", "exp_avg_sq")


def require_dict(obj: Any, path: str) -> None:
    """Every checkpoint a ``torch.save`` can hold for us is a dict: refuse anything else by type."""
    if not isinstance(obj, dict):
        raise UnsupportedConversionError(path, f"a torch.save of a {type(obj).__name__}: expected a model "
                                               "state dict or a dict holding one")


def to_state(obj: Any, path: str) -> State:
    """The foreign checkpoint ``obj`` (as ``torch.load`` returned it) as a ``State``."""
    torch = require_torch(path)
    require_dict(obj, path)
    keys, model_sd, opt_sd = _container(obj, path, torch)
    other = {k: v for k, v in obj.items() if k not in (keys.get("model"), keys.get("optimizer"))} if keys["model"] else {}
    for key, value in other.items():
        _require_json(value, f"top-level entry {key!r}", path)
    model_sd, prefix = _strip(model_sd)
    imported = {"from": "torch.save", "file": os.path.basename(path), "keys": keys, "prefix": prefix,
                "top": list(obj) if keys["model"] else None, "other": other}
    opt = _optimizer(opt_sd, torch, path) if opt_sd is not None else None
    return State(_entries(model_sd, torch, path), opt, imported)


def _container(obj: dict, path: str, torch: Any) -> tuple[dict[str, Any], dict, Any]:
    for model_key, opt_key in CONTAINERS:
        if isinstance(obj.get(model_key), dict):
            has_opt = isinstance(obj.get(opt_key), dict)
            return {"model": model_key, "optimizer": opt_key if has_opt else None}, obj[model_key], \
                obj[opt_key] if has_opt else None
    if obj and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        return {"model": None, "optimizer": None}, obj, None
    raise UnsupportedConversionError(path, "no model state dict found: expected keys model/optimizer, "
                                           "state_dict/optimizer, model_state_dict/optimizer_state_dict or a "
                                           f"bare state dict of tensors; found {sorted(map(str, obj))[:8]}")


def _strip(sd: dict) -> tuple[dict, str]:
    """``sd`` without the DDP / torch.compile prefixes every key carries; the prefix removed."""
    prefix = ""
    while sd:
        found = next((p for p in PREFIXES if all(isinstance(k, str) and k.startswith(p) for k in sd)), None)
        if found is None:
            break
        prefix += found
        sd = {k[len(found):]: v for k, v in sd.items()}
    return sd, prefix


def _entries(sd: dict, torch: Any, path: str) -> list[Entry]:
    out, seen = [], {}
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise UnsupportedConversionError(path, f"model state dict entry {name!r} is a {type(t).__name__}, "
                                                   "not a tensor: it cannot be mapped")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in seen:
            out.append(Entry(name, seen[key].dtype, seen[key].shape, seen[key].data, seen[key].name))
            continue
        entry = _entry(name, t, torch, path)
        seen[key] = entry
        out.append(entry)
    return out


def _entry(name: str, t: Any, torch: Any, path: str) -> Entry:
    dtype = str(t.dtype).removeprefix("torch.")
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        data = t.view(torch.int16).numpy().view("<u2")
    else:
        try:
            data = t.numpy()
        except TypeError:
            raise UnsupportedConversionError(path, f"{name}: a {dtype} tensor cannot be stored") from None
    if data.dtype.kind == "c":
        raise UnsupportedConversionError(path, f"{name}: a {dtype} tensor cannot be stored")
    return Entry(name, dtype, list(t.shape), data)


def _optimizer(osd: dict, torch: Any, path: str) -> Optimizer:
    state, groups = osd.get("state"), osd.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise UnsupportedConversionError(path, "the optimizer entry is not an optimizer state dict (state, param_groups)")
    settings, indices, tuples = _groups(groups, path)
    order = [i for group in indices for i in group]
    if len(set(order)) != len(order) or not set(state) <= set(order):
        raise UnsupportedConversionError(path, "optimizer: param_groups list an index twice, or state has an "
                                               "index no group lists")
    ms, vs, steps = [], [], []
    for i in order:
        m, v, step = _moments(i, state.get(i), torch, path)
        ms.append(m)
        vs.append(v)
        steps.append(step)
    return Optimizer(_kind(groups, path), settings, indices, sorted(tuples), ms, vs, steps)


def _groups(groups: list[dict], path: str) -> tuple[list[dict[str, Any]], list[list[int]], set[str]]:
    settings, indices, tuples = [], [], set()
    for n, group in enumerate(groups):
        if "betas" not in group or "eps" not in group or group.get("amsgrad"):
            raise UnsupportedConversionError(path, f"optimizer param group {n} is not Adam/AdamW without amsgrad: "
                                                   "only their exp_avg and exp_avg_sq map onto m and v")
        params = group.get("params")
        if not isinstance(params, list) or not all(isinstance(i, int) for i in params):
            raise UnsupportedConversionError(path, f"optimizer param group {n}: params is not a list of indices")
        indices.append(list(params))
        row = {}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, tuple):
                tuples.add(key)
                value = list(value)
            _require_json(value, f"optimizer param group {n}: {key}", path)
            row[key] = value
        settings.append(row)
    return settings, indices, tuples


def _kind(groups: list[dict], path: str) -> str:
    """'AdamW' or 'Adam', from ``decoupled_weight_decay`` (every Adam/AdamW group since torch 2.6)."""
    flags = {g.get("decoupled_weight_decay") for g in groups}
    if flags == {True}:
        return "AdamW"
    if flags == {False}:
        return "Adam"
    raise UnsupportedConversionError(path, "cannot tell Adam from AdamW: param_groups lack or disagree on "
                                           "decoupled_weight_decay (a torch older than 2.6 saved them)")


def _moments(i: int, st: Any, torch: Any, path: str) -> tuple[Entry | None, Entry | None, int | None]:
    if st is None:
        return None, None, None
    extra = sorted(set(st) - set(MOMENTS)) if isinstance(st, dict) else ["(not a dict)"]
    if extra or not all(isinstance(st.get(k), torch.Tensor) for k in MOMENTS[1:]):
        raise UnsupportedConversionError(path, f"optimizer state of parameter {i} holds {extra or 'no moments'}: "
                                               "only Adam/AdamW's step, exp_avg and exp_avg_sq map onto m and v")
    step = float(st.get("step", 0))
    if not step.is_integer() or step < 0:
        raise UnsupportedConversionError(path, f"optimizer state of parameter {i}: step {step} is not a count")
    return (_entry(f"state.{i}.exp_avg", st["exp_avg"], torch, path),
            _entry(f"state.{i}.exp_avg_sq", st["exp_avg_sq"], torch, path), int(step))


def _require_json(value: Any, what: str, path: str) -> None:
    """Refuse, naming it, anything the manifest (strict JSON) cannot hold."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float) and math.isfinite(value):
        return
    if isinstance(value, list):
        for item in value:
            _require_json(item, what, path)
        return
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for item in value.values():
            _require_json(item, what, path)
        return
    raise UnsupportedConversionError(path, f"{what} is a {type(value).__name__} ({value!r:.40}): only JSON "
                                           "values can go beside the model")


# ---------------------------------------------------------------- the way back
def from_state(state: State, path: str) -> Any:
    """The object ``torch.save`` wrote, rebuilt from ``state`` (tied aliases share a tensor)."""
    torch = require_torch(path)
    imported = state.imported
    prefix = imported.get("prefix") or ""
    tensors: dict[str, Any] = {}
    model = {}
    for e in state.model:
        tensors[e.name] = tensors[e.alias_of] if e.alias_of else _tensor(e, torch)
        model[prefix + e.name] = tensors[e.name]
    keys = imported.get("keys") or {"model": "model", "optimizer": "optimizer"}
    if keys.get("model") is None and state.optimizer is None:
        return model
    parts = {keys.get("model") or "model": model, **(imported.get("other") or {})}
    if state.optimizer is not None:
        parts[keys.get("optimizer") or "optimizer"] = _optimizer_sd(state.optimizer, torch)
    top = imported.get("top") or list(parts)
    return {k: parts[k] for k in top + [k for k in parts if k not in top] if k in parts}


def _tensor(e: Entry, torch: Any) -> Any:
    if e.dtype == "bfloat16":
        flat = torch.from_numpy(np.array(e.data, dtype="<u2").view("<i2")).view(torch.bfloat16)
    else:
        flat = torch.from_numpy(np.array(e.data))
    return flat.reshape(e.shape)


def _optimizer_sd(opt: Optimizer, torch: Any) -> dict[str, Any]:
    state = {}
    for i, m, v, step in zip(opt.order, opt.exp_avg, opt.exp_avg_sq, opt.steps):
        if step is not None and m is not None and v is not None:
            state[i] = {"step": torch.tensor(float(step), dtype=torch.float32),
                        "exp_avg": _tensor(m, torch), "exp_avg_sq": _tensor(v, torch)}
    groups = [{**{k: tuple(v) if k in opt.tuples else v for k, v in g.items()}, "params": list(idx)}
              for g, idx in zip(opt.groups, opt.indices)]
    return {"state": state, "param_groups": groups}


def difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where ``a`` and ``b`` first differ (tensors by dtype, shape and bytes), None if nowhere."""
    torch = require_torch(where)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(_bytes(a, torch), _bytes(b, torch))
        return None if same else where or "(top)"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):          # as dict equality: the order of keys is not data (the manifest sorts them)
            return f"{where or '(top)'}: keys {sorted(map(str, set(a) ^ set(b)))[:5]} are not in both"
        return next((d for k in a if (d := difference(a[k], b[k], f"{where}/{k}")) is not None), None)
    if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return next((d for n, (x, y) in enumerate(zip(a, b)) if (d := difference(x, y, f"{where}/{n}")) is not None), None)
    return None if type(a) is type(b) and a == b else where or "(top)"


def _bytes(t: Any, torch: Any) -> Any:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
