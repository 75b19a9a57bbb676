"""``torch.save`` files in and out (spec §10.7, the mapping's rules §10.8): ckptfmt's own
``.pt`` form (one tensor per region), and a foreign training checkpoint, a ``torch.save`` of a
model state dict and an Adam, AdamW or SGD optimizer state dict under ``model``/``optimizer``,
``state_dict``/``optimizer``, ``model_state_dict``/``optimizer_state_dict``, Lightning's
``state_dict``/``optimizer_states`` (a list of one), or a bare model state dict. Loaded only
with ``torch.load(weights_only=True)`` (``read``). ``to_state`` turns the loaded object into a
``statemap.State`` (optimizer state by parameter name); ``from_state`` builds the object back
(``--to torch``); ``difference`` compares two such objects bit for bit.
The tools layer reaches this module only through ``tools.convert.torchside``.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any

import numpy as np
import torch

from .. import atomic, unnamed
from ..errors import ConvertError, UnsupportedConversionError, UnsupportedSetupError
from ..wrappers import key_of, strip
from ..statemap import EXTRAS, OPTIMIZERS, Entry, Optimizer, State, resolve_members
from . import optim
from .state import join, split

CONTAINERS = (("model", "optimizer"), ("state_dict", "optimizer"), ("model_state_dict", "optimizer_state_dict"))
LISTED = "optimizer_states"                # Lightning's list of optimizer state dicts: one maps, more are refused


# ---------------------------------------------------------------- reading and writing files
def read(path: str) -> Any:
    """What ``torch.load(weights_only=True)`` gives for ``path`` (nothing is unpickled beyond
    tensors and plain containers)."""
    try:
        with warnings.catch_warnings():   # torch's "Detected pickle protocol N ... please file an issue"
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:     # the legacy (pre-1.6, non-zip) format has no mmap
                if "mmap can only be used with files saved with" not in str(exc):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file
        text = str(exc)
        # "Unsupported global: GLOBAL x.y", or "unsupported GLOBAL os.system whose module os is blocked"
        found = re.search(r"unsupported(?: global:)? GLOBAL ([\w.]+)", text, re.IGNORECASE)
        if found:
            raise UnsupportedConversionError(path, f"holds a pickled {found.group(1)}, which "
                                                   "torch.load(weights_only=True) refuses to run: save "
                                                   "plain containers (model.state_dict(), optimizer.state_dict(), "
                                                   "hyper-parameters as a dict) instead") from None
        # torch's first line for a refused pickle advises weights_only=False: the specific line instead
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        first = next((line for line in lines if line.startswith("Unsupported")), lines[0] if lines else type(exc).__name__)
        raise ConvertError(path, f"cannot load with torch.load(weights_only=True): {first}") from None


def save(obj: Any, dst: str) -> None:
    """``torch.save`` of ``obj`` at ``dst``, atomically."""
    with atomic.AtomicWriter(dst) as out:
        with out.fileobj() as f:
            torch.save(obj, f)
        out.commit()


def is_ckptfmt(obj: Any) -> bool:
    """True for ckptfmt's own .pt form (``format`` = ``ckptfmt``); False for a foreign checkpoint."""
    return isinstance(obj, dict) and obj.get("format") == "ckptfmt"


def own_form(obj: Any, path: str, regions: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, region arrays) of ckptfmt's .pt form: a region tensor as numpy (bfloat16 as
    its uint16 bits, which numpy lacks); anything that is not a tensor is refused here, before
    its type could surprise a writer."""
    if not isinstance(obj, dict):
        raise ConvertError(path, "not a ckptfmt .pt: expected a dict")
    out = {}
    for region in (r for r in regions if r in obj):
        value = obj[region]
        if not isinstance(value, torch.Tensor):
            raise ConvertError(path, f"region {region} is a {type(value).__name__}, expected a tensor")
        value = value.detach().contiguous().cpu()
        out[region] = value.view(torch.int16).numpy().view("<u2") if value.dtype == torch.bfloat16 else value.numpy()
    return {k: v for k, v in obj.items() if k not in regions}, out


def write_own_form(dst: str, meta: dict[str, Any], regions: dict[str, np.ndarray], dtype: str | None) -> None:
    """ckptfmt's .pt form: ``meta`` and one tensor per region (cast to ``dtype`` if given)."""
    state: dict[str, Any] = dict(meta)
    for region, values in regions.items():
        t = torch.from_numpy(np.array(values, copy=True))
        state[region] = t.to(getattr(torch, dtype)) if dtype else t
    save(state, dst)


# ---------------------------------------------------------------- a foreign checkpoint in
def require_dict(obj: Any, path: str) -> None:
    """Every checkpoint a ``torch.save`` can hold for us is a dict: refuse anything else by type."""
    if not isinstance(obj, dict):
        raise UnsupportedConversionError(path, f"a torch.save of a {type(obj).__name__}: expected a model "
                                               "state dict or a dict holding one")


def to_state(obj: Any, path: str, groups: list[list[str]] | None = None, groups_file: str = "--groups", *,
             by_index: "bool | str" = False) -> State:
    """The foreign checkpoint ``obj`` (as ``torch.load`` returned it) as a ``State``; ``groups``:
    each param group's parameter names, where the user gave them (``--groups FILE``);
    ``by_index``: several groups that name nothing keep their moments by optimizer index
    (``ckptfmt.unnamed``, for the commands that only read) instead of being refused; ``"always"``:
    one group too (its state dict's order is not the model's: a Trainer's safetensors)."""
    require_dict(obj, path)
    keys, model_sd, opt_sd = _container(obj, path)
    other = {k: v for k, v in obj.items() if k not in (keys.get("model"), keys.get("optimizer"))} if keys["model"] else {}
    model_sd, prefix = strip(model_sd)
    tree, tensors = _beside(other, path)
    imported = {"from": "torch.save", "file": os.path.basename(path), "keys": keys, "prefix": prefix,
                "top": list(obj) if keys["model"] else None, "other": tree}
    entries = _entries(model_sd, path)
    opt = _optimizer(opt_sd, entries, prefix, groups, groups_file, path, by_index) if opt_sd is not None else None
    return State(entries, opt, imported, tensors)


def _beside(other: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the container holds beside the model and optimizer (``iter_num``, ``model_args``, a
    ``best_val_loss`` tensor): a JSON tree for the manifest and its tensors for the companion."""
    try:
        return split(other, EXTRAS)
    except TypeError as exc:
        raise UnsupportedConversionError(path, f"top-level entry {exc}: it would be lost") from None


def _container(obj: dict, path: str) -> tuple[dict[str, Any], dict, Any]:
    for model_key, opt_key in CONTAINERS:
        if isinstance(obj.get(model_key), dict):
            if model_key == "state_dict" and opt_key not in obj and isinstance(obj.get(LISTED), list):
                opt_key = LISTED            # a Lightning checkpoint (RUN §11)
            opt = _listed(obj[opt_key], path) if opt_key == LISTED else obj.get(opt_key)
            has_opt = isinstance(opt, dict)
            return {"model": model_key, "optimizer": opt_key if has_opt else None}, obj[model_key], \
                opt if has_opt else None
    if obj and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        return {"model": None, "optimizer": None}, obj, None
    raise UnsupportedConversionError(path, "no model state dict found: expected keys model/optimizer, "
                                           "state_dict/optimizer, model_state_dict/optimizer_state_dict or a "
                                           f"bare state dict of tensors; found {sorted(map(str, obj))[:8]}")


def _listed(states: list, path: str) -> Any:
    """The one optimizer state dict of Lightning's ``optimizer_states`` (None when empty)."""
    if len(states) > 1:
        raise UnsupportedConversionError(path, f"{len(states)} optimizers in {LISTED}: the seed layout holds one "
                                               "optimizer's moments")
    return states[0] if states else None


def _entries(sd: dict, path: str) -> list[Entry]:
    out, seen = [], {}
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise UnsupportedConversionError(path, f"model state dict entry {name!r} is a {type(t).__name__}, "
                                                   "not a tensor: it cannot be mapped")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in seen:
            out.append(Entry(name, seen[key].dtype, seen[key].shape, seen[key].data, seen[key].name))
            continue
        entry = _entry(name, t, path)
        seen[key] = entry
        out.append(entry)
    return out


def _entry(name: str, t: Any, path: str) -> Entry:
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


def _optimizer(osd: dict, entries: list[Entry], prefix: str, given: list[list[str]] | None,
               given_by: str, path: str, by_index: "bool | str" = False) -> Optimizer:
    state, groups = osd.get("state"), osd.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise UnsupportedConversionError(path, "the optimizer entry is not an optimizer state dict (state, param_groups)")
    kind = _kind(groups, path)
    settings, indices, tuples, kinds = _groups(groups, path)
    order = [i for group in indices for i in group]
    if len(set(order)) != len(order) or not set(state) <= set(order):
        raise UnsupportedConversionError(path, "optimizer: param_groups list an index twice, or state has an "
                                               "index no group lists")
    keys = {e.name for e in entries}
    names = [[key_of(n, prefix, keys) for n in group] for group in given] if given is not None \
        else _param_names(groups, entries, prefix)
    by_name = _by_name(indices, prefix, keys, names if given is not None else None, given_by, path)
    label = "param_groups" if by_name is not None else given_by if given is not None else "param_names"
    names = names if by_name is None else by_name
    by_group = unnamed.members(indices) if by_index and names is None and (len(indices) > 1 or by_index == "always") else \
        resolve_members(entries, [len(i) for i in indices], names, path, label)
    first, second, steps = {}, {}, {}
    for group, names_of_group in zip(indices, by_group):
        for i, name in zip(group, names_of_group):
            first[name], second[name], steps[name] = _moments(i, name, state.get(i), kind, path)
    own = [g.get("param_names") for g in groups]          # kept for the way back, used or not
    return Optimizer(kind, settings, by_group, sorted(tuples), first, second, steps, indices,
                     own if any(isinstance(n, list) for n in own) else None, kinds)


def _param_names(groups: list[dict], entries: list[Entry], prefix: str) -> list[list[str]] | None:
    """torch >= 2.6's ``param_names`` of every group, when they can be trusted: unique, and each
    a key of the state dict (after the prefix rule). torch keeps whatever the user's iterable
    gave, so names relative to a submodule or repeated across groups count as no names."""
    lists = [g.get("param_names") for g in groups]
    if not all(isinstance(n, list) and all(isinstance(x, str) for x in n) for n in lists):
        return None
    keys = {e.name for e in entries if e.alias_of is None}
    names = [[key_of(x, prefix, keys) for x in n] for n in lists]
    flat = [x for n in names for x in n]
    if len(set(flat)) != len(flat) or not set(flat) <= keys:
        return None
    return names


def _by_name(keyed: list[list[int | str]], prefix: str, keys: set[str], given: list[list[str]] | None,
             given_by: str, path: str) -> list[list[str]] | None:
    """Each group's parameter names where the optimizer's state is keyed by name
    (``torch.distributed.checkpoint.state_dict``'s form: state under each parameter's FQN, param
    groups listing FQNs): the names are the membership, after the prefix rule; None where the
    state is numbered. Names ``given`` beside them must be the same names."""
    if not any(isinstance(k, str) for group in keyed for k in group):
        return None
    names = [[key_of(n, prefix, keys) for n in group] for group in keyed]
    if given is not None and given != names:
        raise UnsupportedConversionError(path, f"{given_by} disagrees with the optimizer's param groups, which "
                                               "name their parameters themselves")
    return names


def _groups(groups: list[dict], path: str) -> tuple[list[dict[str, Any]], list[list[int | str]], set[str],
                                                    list[dict[str, str]]]:
    """Settings, ``params`` (indices, or the names of a state keyed by name), tuples, types by group."""
    settings, indices, tuples, kinds = [], [], set(), []
    keyed = {type(i) for group in groups if isinstance(group.get("params"), list) for i in group["params"]}
    if len(keyed) > 1:
        raise UnsupportedConversionError(path, "optimizer param_groups mix indices and parameter names")
    for n, group in enumerate(groups):
        params = group.get("params")
        if not isinstance(params, list) or not all(type(i) in (int, str) for i in params):
            raise UnsupportedConversionError(path, f"optimizer param group {n}: params is not a list of indices "
                                                   "or of parameter names")
        indices.append(list(params))
        row, said = {}, {}
        for key, value in group.items():
            if key in optim.NOT_SETTINGS:
                continue
            try:
                row[key], how = optim.setting(value, f"optimizer param group {n}: {key}")
            except UnsupportedSetupError as exc:
                raise UnsupportedConversionError(path, exc.problem) from None
            if how == "tuple":
                tuples.add(key)
            if how is not None:
                said[key] = how
        settings.append(row)
        kinds.append(said)
    return settings, indices, tuples, kinds


def _kind(groups: list[dict], path: str) -> str:
    """'AdamW' or 'Adam' from ``decoupled_weight_decay`` (every Adam/AdamW group since torch
    2.6), 'SGD' from its ``momentum``/``dampening``/``nesterov``; anything else is refused."""
    if all("betas" in g and "eps" in g for g in groups):
        if any(g.get("amsgrad") for g in groups):
            raise UnsupportedConversionError(path, "optimizer: amsgrad keeps a third moment the seed layout "
                                                   "cannot hold (supported: Adam, AdamW without amsgrad, SGD)")
        flags = {g.get("decoupled_weight_decay") for g in groups}
        if flags == {True}:
            return "AdamW"
        if flags == {False}:
            return "Adam"
        raise UnsupportedConversionError(path, "cannot tell Adam from AdamW: param_groups lack or disagree on "
                                               "decoupled_weight_decay (a torch older than 2.6 saved them)")
    if all("momentum" in g and "dampening" in g and "nesterov" in g for g in groups):
        return "SGD"
    raise UnsupportedConversionError(path, "optimizer param group 0 is not Adam/AdamW without amsgrad or SGD: "
                                           "only their exp_avg and exp_avg_sq, or momentum_buffer, map onto m and v")


def _moments(i: int | str, name: str, st: Any, kind: str, path: str) -> tuple[Entry | None, Entry | None, int | None]:
    if st is None:
        return None, None, None
    first, second = OPTIMIZERS[kind]
    allowed = {first, second, "step"} - {None}
    extra = sorted(set(st) - allowed) if isinstance(st, dict) else ["(not a dict)"]
    if not extra and st.get(first) is None and second is None:
        return None, None, None             # SGD before its first momentum step: a None buffer
    moments = [st.get(k) for k in (first, second) if k is not None]
    if extra or not all(isinstance(t, torch.Tensor) for t in moments):
        raise UnsupportedConversionError(path, f"optimizer state of parameter {i} ({name}) holds {extra or 'no moments'}: "
                                               f"only {kind}'s {', '.join(sorted(allowed))} map onto m and v")
    step = float(st.get("step", 0))
    if not step.is_integer() or step < 0:
        raise UnsupportedConversionError(path, f"optimizer state of parameter {i} ({name}): step {step} is not a count")
    return (_entry(f"{name}.{first}", st[first], path),
            _entry(f"{name}.{second}", st[second], path) if second else None, int(step))


# ---------------------------------------------------------------- the way back
def from_state(state: State, path: str) -> Any:
    """The object ``torch.save`` wrote, rebuilt from ``state``: tied aliases share a tensor,
    the entries beside the model come back (tensors included), and the optimizer's state is
    numbered as its param groups list it."""
    imported = state.imported
    prefix = imported.get("prefix") or ""
    tensors: dict[str, Any] = {}
    model = {}
    for e in state.model:
        tensors[e.name] = tensors[e.alias_of] if e.alias_of else _tensor(e)
        model[prefix + e.name] = tensors[e.name]
    keys = imported.get("keys") or {"model": "model", "optimizer": "optimizer"}
    if keys.get("model") is None and state.optimizer is None:
        return model
    other = join(imported.get("other") or {}, lambda key: state.extra[key])
    parts = {keys.get("model") or "model": model, **other}
    if state.optimizer is not None:
        key = keys.get("optimizer") or "optimizer"
        parts[key] = [_optimizer_sd(state.optimizer)] if key == LISTED else _optimizer_sd(state.optimizer)
    top = imported.get("top") or list(parts)
    return {k: parts[k] for k in top + [k for k in parts if k not in top] if k in parts}


def _tensor(e: Entry) -> Any:
    if e.dtype == "bfloat16":
        flat = torch.from_numpy(np.array(e.data, dtype="<u2").view("<i2")).view(torch.bfloat16)
    else:
        flat = torch.from_numpy(np.array(e.data))
    return flat.reshape(e.shape)


def _optimizer_sd(opt: Optimizer) -> dict[str, Any]:
    """torch's optimizer state dict: each member's state under its index (Adam's step as a
    float32 tensor, SGD's momentum buffer), each group's settings in the types they had (NumPy
    scalars as Python numbers: ``torch.load(weights_only=True)`` refuses NumPy objects)."""
    first_key, second_key = OPTIMIZERS[opt.kind]
    state: dict[int | str, Any] = {}
    indices = opt.indices or []
    for group, numbers in zip(opt.members, indices):
        for name, i in zip(group, numbers):
            first, second, step = opt.first.get(name), opt.second.get(name), opt.steps.get(name)
            if step is None or first is None:
                continue
            state[i] = {first_key: _tensor(first)} if second_key is None else \
                {"step": torch.tensor(float(step), dtype=torch.float32),
                 first_key: _tensor(first), second_key: _tensor(second) if second is not None else None}
    groups = []
    for g, (settings, numbers) in enumerate(zip(opt.groups, indices)):
        kinds = opt.types[g] if g < len(opt.types) else {}
        row = {k: _exported(v, "tuple" if k in opt.tuples else kinds.get(k)) for k, v in settings.items()}
        row["params"] = list(numbers)
        if opt.param_names is not None and g < len(opt.param_names) and opt.param_names[g] is not None:
            row["param_names"] = list(opt.param_names[g])
        groups.append(row)
    return {"state": state, "param_groups": groups}


def _exported(value: Any, how: str | None) -> Any:
    """A setting as a ``torch.save`` file holds it: tuples and one-element tensors as they were,
    NumPy scalars as Python numbers."""
    if how is not None and how.startswith("numpy:"):
        how = None
    return optim.setting_like(None, value, how)


def difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where ``a`` and ``b`` first differ (tensors by dtype, shape and bytes), None if nowhere."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))
        return None if same else where or "(top)"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):          # as dict equality: the order of keys is not data (the manifest sorts them)
            return f"{where or '(top)'}: keys {sorted(map(str, set(a) ^ set(b)))[:5]} are not in both"
        return next((d for k in a if (d := difference(a[k], b[k], f"{where}/{k}")) is not None), None)
    if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return next((d for n, (x, y) in enumerate(zip(a, b)) if (d := difference(x, y, f"{where}/{n}")) is not None), None)
    return None if type(a) is type(b) and a == b else where or "(top)"


def _bytes(t: Any) -> Any:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
