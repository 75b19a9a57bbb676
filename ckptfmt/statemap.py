"""The mapping between a training state and a generation, as the manifest holds it (spec
FORMAT.md §10.8), without torch: a model state dict and an optimizer state as plain arrays
(``State``), the one optimizer table, which tensors are parameters and which are buffers, which
parameter is in which param group (by name, never by position alone), tied aliases, and the
manifest fields that record them. ``ckptfmt.torch.optim`` (a live model and optimizer) and
``ckptfmt.torch.torchsave`` (a ``torch.save`` file) are the only places torch objects are turned
into these values and back.

>>> e = Entry("bn.weight", "bfloat16", [2], np.array([0x3F80, 0xC000], dtype="<u2"))
>>> widen(e).tolist(), narrow(widen(e), "bfloat16").tolist() == e.data.tolist()
([1.0, -2.0], True)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import format as fmt
from . import manifest as mf
from . import reader, writer
from .errors import UnsupportedConversionError
from .statestep import header_step

# The one optimizer table: the state keys that map onto the m and v regions (None: v stays zero).
OPTIMIZERS = {"Adam": ("exp_avg", "exp_avg_sq"), "AdamW": ("exp_avg", "exp_avg_sq"),
              "SGD": ("momentum_buffer", None)}
SUPPORTED = "Adam, AdamW (without amsgrad) and SGD (momentum or none)"
BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked")
FLOATING = ("float32", "float16", "bfloat16")        # the float types float32 holds exactly
BUFFERS = "buffers"          # manifest field and companion key prefix, as CheckpointManager writes them
EXTRAS = "imported"          # companion key prefix of a foreign file's tensors beside the model
GROUPS_HINT = ('pass --groups FILE, a JSON list with one list per param group of its parameters\' '
               'state-dict names, in the optimizer\'s order: [["wte.weight", "h.0.attn.weight"], '
               '["h.0.ln.bias", ...]]')


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
    """An optimizer's state by parameter name: each group's settings and members, and each
    member's moments (``first``: exp_avg or momentum_buffer, ``second``: exp_avg_sq or None)."""
    kind: str                                   # a key of OPTIMIZERS
    groups: list[dict[str, Any]]                # each group's settings, JSON (tuples as lists)
    members: list[list[str]]                    # each group's parameter names, in the group's order
    tuples: list[str]                           # settings that were tuples (betas)
    first: dict[str, Entry | None]              # None: the parameter has no state yet
    second: dict[str, Entry | None]
    steps: dict[str, int | None]
    indices: list[list[int | str]] | None = None    # the foreign file's own lists (its state's keys), for the way back
    param_names: list[list[str]] | None = None  # the foreign groups' own ``param_names``, for the way back
    types: list[dict[str, str]] = field(default_factory=list)   # per group: settings not plain numbers

    @property
    def order(self) -> list[str]:
        """Parameter names in param_groups order."""
        return [name for group in self.members for name in group]

    @property
    def counts_steps(self) -> bool:
        """It keeps a step count of its own (Adam, AdamW: a second moment); SGD keeps none."""
        return OPTIMIZERS[self.kind][1] is not None

    @property
    def step(self) -> int:
        """The largest step any parameter has taken."""
        return max((s for s in self.steps.values() if s is not None), default=0)


@dataclass
class State:
    """A checkpoint's model state dict (in its order, aliases included), the optimizer (None
    without one), what the foreign container held besides (``imported``, JSON with markers) and
    its tensors (``extra``, companion keys to arrays)."""
    model: list[Entry]
    optimizer: Optimizer | None = None
    imported: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)     # read_bin: the verified manifest it read


def is_buffer_name(name: str) -> bool:
    """True for names like a BatchNorm buffer (``bn1.running_mean``)."""
    return name.rsplit(".", 1)[-1] in BUFFER_NAMES


def candidates(model: list[Entry]) -> list[Entry]:
    """The tensors that look like parameters when nothing names them: floating, not an alias,
    not named like a BatchNorm buffer."""
    return [e for e in model if e.alias_of is None and (e.dtype in FLOATING or e.dtype == "float64")
            and not is_buffer_name(e.name)]


def resolve_members(model: list[Entry], counts: list[int], names: list[list[str]] | None, path: str,
            given_by: str = "param_names") -> list[list[str]]:
    """Each param group's parameter names. ``counts``: how many parameters each group lists;
    ``names``: the groups' names where something gave them (torch's ``param_names``, or the
    ``--groups`` file ``given_by`` names), checked to be unique state-dict keys of the right
    counts. Without names one group comes in, in state-dict order; several are refused: a shape
    match is never proof of which parameter is which."""
    if names is not None:
        _check_names(model, counts, names, path, given_by)
        return [list(group) for group in names]
    params = candidates(model)
    if len(counts) > 1:
        raise UnsupportedConversionError(path, f"the optimizer has {len(counts)} param groups and does not "
                                               "name their parameters (no usable param_names), so which "
                                               f"parameter is which cannot be known; {GROUPS_HINT}")
    if counts and counts[0] != len(params):
        first = ", ".join(e.name for e in params[counts[0]:][:3]) or "none left"
        raise UnsupportedConversionError(path, f"the model state dict has {len(params)} floating tensors "
                                               f"that look like parameters, the optimizer holds {counts[0]} "
                                               f"(first unmatched: {first}): cannot tell parameters from "
                                               f"buffers; {GROUPS_HINT}")
    return [[e.name for e in params]] if counts else []


def _check_names(model: list[Entry], counts: list[int], names: list[list[str]], path: str,
                 given_by: str) -> None:
    keys = {e.name: e for e in model}
    if len(names) != len(counts):
        raise UnsupportedConversionError(path, f"{given_by} lists {len(names)} groups, the optimizer has "
                                               f"{len(counts)}")
    flat = [n for group in names for n in group]
    for g, (group, count) in enumerate(zip(names, counts)):
        if len(group) != count:
            raise UnsupportedConversionError(path, f"{given_by}: group {g} lists {len(group)} names, the "
                                                   f"optimizer's group {g} holds {count} parameters")
    twice = sorted({n for n in flat if flat.count(n) > 1})
    unknown = [n for n in flat if n not in keys]
    if twice or unknown:
        said = f"names {twice[:3]} more than once" if twice else \
            f"{unknown[0]!r}, which is not a key of the model state dict"
        raise UnsupportedConversionError(path, f"{given_by} lists {said}")
    for n in flat:
        e = keys[n]
        if e.alias_of is not None:
            raise UnsupportedConversionError(path, f"{given_by} lists {n!r}, a tied alias of {e.alias_of!r}: "
                                                   f"name {e.alias_of!r} instead")
        if e.dtype not in FLOATING and e.dtype != "float64":
            raise UnsupportedConversionError(path, f"{given_by} lists {n!r}, a {e.dtype} tensor: not a parameter")


def split(state: State, path: str) -> tuple[list[Entry], list[Entry]]:
    """(parameters in state-dict order, buffers in order). With an optimizer, its members are
    the parameters and every other tensor is a buffer; without one, ``candidates`` are."""
    if state.optimizer is not None:
        named = set(state.optimizer.order)
        params = [e for e in state.model if e.alias_of is None and e.name in named]
    else:
        params = candidates(state.model)
    chosen = {e.name for e in params}
    buffers = [e for e in state.model if e.alias_of is None and e.name not in chosen]
    if not params:
        kinds = sorted({e.dtype for e in buffers})
        raise UnsupportedConversionError(path, f"no floating-point parameter tensor (it holds {', '.join(kinds) or 'none'}"
                                               "): nothing to put in the weights")
    for e in params:
        if e.dtype == "float64":
            raise UnsupportedConversionError(path, f"{e.name}: a float64 parameter does not fit the float32 "
                                                   "layout without rounding; cast the model to float32 first")
    if state.optimizer is not None:
        _check_moments(params, state.optimizer, path)
    return params, buffers


def _check_moments(params: list[Entry], opt: Optimizer, path: str) -> None:
    for e in params:
        for moment in (opt.first.get(e.name), opt.second.get(e.name)):
            if moment is not None and list(moment.shape) != list(e.shape):
                raise UnsupportedConversionError(path, f"{e.name}: shape {list(e.shape)} in the model, its "
                                                       f"optimizer state has {list(moment.shape)}")


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
    """(weights, m, v) as float32 pieces in parameter order, each moment found by its
    parameter's name; zeros where there is no state."""
    weights = [widen(e) for e in params]
    first, second = (opt.first, opt.second) if opt is not None else ({}, {})

    def moment(table: dict[str, Entry | None], e: Entry, w: np.ndarray) -> np.ndarray:
        found = table.get(e.name)
        return widen(found) if found is not None else np.zeros(w.size, "<f4")
    return weights, [moment(first, e, w) for e, w in zip(params, weights)], \
        [moment(second, e, w) for e, w in zip(params, weights)]


# ---------------------------------------------------------------- the manifest's fields
def group_members(doc: dict[str, Any], path: str) -> list[list[str]]:
    """Each param group's parameter names, as the manifest records them: ``optimizer.members``;
    for files written before it, a foreign import's ``imported.param_groups`` (index lists in
    layout order) or, with one group, every parameter; several groups without either are refused."""
    opt = doc.get("optimizer") or {}
    names = [row["name"] for row in doc.get("layout") or []]
    if isinstance(opt.get("members"), list):
        return [list(group) for group in opt["members"]]
    groups = opt.get("hyperparams") or []
    if not groups:
        raise UnsupportedConversionError(path, "the manifest's optimizer records no param groups "
                                               "(hyperparams): it cannot be exported as an optimizer")
    imported = doc.get("imported") if isinstance(doc.get("imported"), dict) else {}
    indices = imported.get("param_groups")
    if isinstance(indices, list):
        order = [i for group in indices for i in group]
        position = {index: names[p] for p, index in enumerate(order) if p < len(names)}
        return [[position[i] for i in group] for group in indices]
    if len(groups) == 1:
        return [names]
    raise UnsupportedConversionError(path, f"the manifest does not say which parameters are in which of its "
                                           f"{len(groups)} param groups (a file written before ckptfmt "
                                           "recorded optimizer.members)")


def write_bin(state: State, dst: str, source: str, fields: dict[str, Any] | None = None) -> writer.SaveResult:
    """Map ``state`` by the rule (``mapped``) and write it as a committed ``.bin`` (+ companion)."""
    named = fmt.parse_name(os.path.basename(dst))
    step, arrays, how = mapped(state, source, named[0] if named is not None else None, fields)
    return writer.save(dst, step, *arrays, **how)


def mapped(state: State, source: str, step: int | None, fields: dict[str, Any] | None = None) -> tuple[int, Any, Any]:
    """(step, (weights, m, v), the manifest and extra tensors): ``writer.save``'s arguments (a store's
    ``writing.save``'s): layout, aliases, buffers, the optimizer by name, what the way back needs
    (``imported``) and the caller's ``fields`` (a Lightning checkpoint's ``rng``); ``step``: the name's."""
    params, buffers = split(state, source)
    weights, m, v = regions(params, state.optimizer)
    opt = state.optimizer
    manifest: dict[str, Any] = {"layout": layout(params), "converted_from": os.path.basename(source),
                                BUFFERS: {e.name: {"__tensor__": f"{BUFFERS}/{e.name}", "kind": "torch",
                                                   "dtype": e.dtype} for e in buffers}}
    aliases = {e.name: e.alias_of for e in state.model if e.alias_of is not None}
    if aliases:
        manifest["aliases"] = aliases
    imported = {**state.imported, "order": [e.name for e in state.model], "aliases": aliases}
    step = header_step(state, step)
    if opt is None:
        imported["optimizer_state"] = "absent"
    else:
        manifest["optimizer"] = {"type": opt.kind, "step": step, "hyperparams": opt.groups,
                                 "members": opt.members, "setting_types": opt.types,
                                 "param_steps": [opt.steps.get(e.name) for e in params]}
        # ``param_groups`` keeps its released meaning (index lists whose concatenation is the
        # layout order), written only where that holds; ``indices`` are the file's own lists
        # (parameter names where its state is keyed by name, as torch.distributed's state_dict keys it)
        in_order = [n for group in opt.members for n in group] == [e.name for e in params] \
            and not any(isinstance(i, str) for group in opt.indices or [] for i in group)
        imported.update(optimizer_state="present", indices=opt.indices,
                        param_groups=opt.indices if in_order else None, tuples=opt.tuples,
                        param_names=opt.param_names)
    manifest["imported"] = imported
    manifest.update(fields or {})
    extra = {f"{BUFFERS}/{e.name}": ("BF16", e.data) if e.dtype == "bfloat16" else e.data for e in buffers}
    extra.update(state.extra)
    return step, (weights, m, v), {"manifest": manifest, "extra_tensors": extra or None}


def read_bin(path: str, ck: reader.Checkpoint | None = None) -> State:
    """The ``State`` a committed ``.bin`` holds (a foreign import, any generation with a layout),
    verified (blake3 of file and companion) first; ``ck``: it opened and verified (from a store)."""
    ck = ck or reader.open(path, manifest="require", verify=True, check_name=False)
    doc = ck.manifest
    if not ck.layout:
        raise UnsupportedConversionError(path, "the manifest has no layout: tensor names are unknown")
    imported = doc.get("imported") if isinstance(doc.get("imported"), dict) else {}
    params = [_param(ck.weights, row) for row in ck.layout]
    named = {e.name: e for e in params + _buffers(ck, doc, path)}
    aliases = mf.aliases_of(doc)
    model = []
    for name in imported.get("order") or _order(list(named), aliases):
        target = named.get(aliases.get(name, name))
        if target is None:
            raise UnsupportedConversionError(path, f"the manifest names {name}, which the file does not hold")
        model.append(target if name not in aliases else Entry(name, target.dtype, target.shape, target.data, target.name))
    opt = None if imported.get("optimizer_state") == "absent" else _optimizer(ck, doc, imported, path)
    rest = {k: v for k, v in imported.items()
            if k not in ("order", "aliases", "optimizer_state", "param_groups", "indices", "tuples", "param_names")}
    extra = ck.companion()
    tensors = {key: extra.tensor(key) for key in extra.names() if key.startswith(EXTRAS + "/")} if extra else {}
    return State(model, opt, rest, tensors, doc)


def _order(names: list[str], aliases: dict[str, str]) -> list[str]:
    """A state dict's order for a generation that did not record one: each stored tensor, then
    its aliases."""
    out = []
    for name in names:
        out.append(name)
        out += [alias for alias, target in aliases.items() if target == name]
    return out


def _param(region: np.ndarray, row: dict[str, Any], label: str | None = None) -> Entry:
    count = math.prod(row["shape"])
    dtype = row.get("dtype", "float32")
    values = region[row["offset"]:row["offset"] + count]
    return Entry(label or row["name"], dtype, list(row["shape"]), narrow(values, dtype).reshape(row["shape"]))


def _buffers(ck: reader.Checkpoint, doc: dict[str, Any], path: str) -> list[Entry]:
    tree = doc.get(BUFFERS) or {}
    if not tree:
        return []
    if not isinstance(tree, dict):
        raise UnsupportedConversionError(path, f"the manifest's {BUFFERS} field is not an object of tensors")
    extra = ck.companion()
    out = []
    for name, marker in tree.items():
        if not (isinstance(marker, dict) and "__tensor__" in marker and extra is not None):
            raise UnsupportedConversionError(path, f"buffer {name}: the manifest's buffers entry is not "
                                                   "one tensor in the companion file")
        data = extra.tensor(marker["__tensor__"])
        out.append(Entry(name, marker.get("dtype", "float32"), list(data.shape), data))
    return out


def _optimizer(ck: reader.Checkpoint, doc: dict[str, Any], imported: dict[str, Any], path: str) -> Optimizer | None:
    """The optimizer state of the manifest's ``optimizer`` and m, v by parameter name; None when
    the manifest has none."""
    opt = doc.get("optimizer")
    if not isinstance(opt, dict) or opt.get("type") not in OPTIMIZERS:
        return None
    groups = group_members(doc, path)
    rows = {row["name"]: (p, row) for p, row in enumerate(ck.layout)}
    unknown = next((n for group in groups for n in group if n not in rows), None)
    if unknown is not None:
        raise UnsupportedConversionError(path, f"optimizer.members names {unknown!r}, which the layout does not hold")
    steps_list = opt.get("param_steps") or [opt.get("step", 0)] * len(ck.layout)
    steps = {row["name"]: steps_list[p] for p, row in enumerate(ck.layout) if p < len(steps_list)}
    second_key = OPTIMIZERS[opt["type"]][1]
    first = {n: _param(ck.m, rows[n][1]) if steps.get(n) is not None else None for n in rows}
    second = {n: _param(ck.v, rows[n][1]) if steps.get(n) is not None and second_key else None for n in rows}
    indices = imported.get("indices") or imported.get("param_groups") or _numbered(groups)
    tuples = imported.get("tuples", ["betas"] if opt["type"] != "SGD" else [])
    names = imported.get("param_names") if isinstance(imported.get("param_names"), list) else opt.get("param_names")
    return Optimizer(opt["type"], opt.get("hyperparams") or [], groups, tuples, first, second,
                     {n: steps.get(n) for g in groups for n in g}, indices,
                     names if isinstance(names, list) else None, opt.get("setting_types") or [])


def _numbered(groups: list[list[str]]) -> list[list[int]]:
    """torch's own numbering of a state dict: 0, 1, ... through the groups in order."""
    out, n = [], 0
    for group in groups:
        out.append(list(range(n, n + len(group))))
        n += len(group)
    return out
