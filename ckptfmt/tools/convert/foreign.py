"""Foreign checkpoints in and out of the seed layout (spec §10.7), without torch: a ``State``
(``mapping``) becomes a committed ``.bin`` with layout, optimizer and buffers (the buffers in
the generation's companion file, under the keys and manifest tree ``CheckpointManager`` uses,
so a manager can resume from it), and a committed ``.bin`` becomes a ``State`` again.

The manifest field ``imported`` records what the way back needs and the seed layout does not
hold: the source form and file, the container's keys, a stripped ``module.``/``_orig_mod.``
prefix, the state dict's order and tied aliases, the optimizer's param group index lists and
which settings were tuples, JSON values stored beside the model, safetensors metadata.
"""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from ... import reader, writer
from ...errors import UnsupportedConversionError
from .mapping import Entry, Optimizer, State, layout, narrow, regions, split

BUFFERS = "buffers"          # manifest field and companion key prefix, as CheckpointManager writes them


def write_bin(state: State, dst: str, source: str) -> writer.SaveResult:
    """Map ``state`` by the rule and write it as a committed ``.bin`` (+ companion)."""
    params, buffers = split(state, source)
    weights, m, v = regions(params, state.optimizer)
    opt = state.optimizer
    manifest: dict[str, Any] = {"layout": layout(params), "converted_from": os.path.basename(source),
                                BUFFERS: {e.name: {"__tensor__": f"{BUFFERS}/{e.name}", "kind": "torch",
                                                   "dtype": e.dtype} for e in buffers}}
    imported = {**state.imported, "order": [e.name for e in state.model],
                "aliases": {e.name: e.alias_of for e in state.model if e.alias_of is not None}}
    step = 0
    if opt is None:
        imported["optimizer_state"] = "absent"
    else:
        step = max((s for s in opt.steps if s is not None), default=0)
        manifest["optimizer"] = {"type": opt.kind, "step": step, "hyperparams": opt.groups,
                                 "param_steps": opt.steps}
        imported.update(optimizer_state="present", param_groups=opt.indices, tuples=opt.tuples)
    manifest["imported"] = imported
    extra = {f"{BUFFERS}/{e.name}": ("BF16", e.data) if e.dtype == "bfloat16" else e.data for e in buffers}
    return writer.save(dst, step, weights, m, v, manifest=manifest, extra_tensors=extra or None)


def read_bin(path: str) -> State:
    """The ``State`` a committed ``.bin`` holds, verified (blake3 of file and companion) first."""
    ck = reader.open(path, manifest="require", verify=True, check_name=False)
    doc = ck.manifest
    if not ck.layout:
        raise UnsupportedConversionError(path, "the manifest has no layout: tensor names are unknown")
    imported = doc.get("imported") if isinstance(doc.get("imported"), dict) else {}
    params = [_param(ck.weights, row) for row in ck.layout]
    named = {e.name: e for e in params + _buffers(ck, doc, path)}
    aliases = imported.get("aliases") or {}
    order = imported.get("order") or list(named)
    model = []
    for name in order:
        target = named.get(aliases.get(name, name))
        if target is None:
            raise UnsupportedConversionError(path, f"imported.order names {name}, which the file does not hold")
        model.append(target if name not in aliases else Entry(name, target.dtype, target.shape, target.data, target.name))
    opt = None if imported.get("optimizer_state") == "absent" else _optimizer(ck, doc, imported, path)
    rest = {k: v for k, v in imported.items()
            if k not in ("order", "aliases", "optimizer_state", "param_groups", "tuples")}
    return State(model, opt, rest)


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
    """The Adam/AdamW state of the manifest's ``optimizer`` and m, v (parameter i is index
    position i in param_groups order); None when the manifest has none."""
    opt = doc.get("optimizer")
    if not isinstance(opt, dict) or opt.get("type") not in ("Adam", "AdamW"):
        return None
    groups, k = opt.get("hyperparams") or [], len(ck.layout)
    indices = imported.get("param_groups") or ([list(range(k))] if len(groups) == 1 else None)
    if indices is None:
        raise UnsupportedConversionError(path, f"the manifest does not say which parameters are in which "
                                               f"of its {len(groups)} param groups")
    steps = opt.get("param_steps") or [opt.get("step", 0)] * k
    order = [i for group in indices for i in group]
    ms = [_param(ck.m, row, f"state.{i}.exp_avg") if s is not None else None
          for i, row, s in zip(order, ck.layout, steps)]
    vs = [_param(ck.v, row, f"state.{i}.exp_avg_sq") if s is not None else None
          for i, row, s in zip(order, ck.layout, steps)]
    return Optimizer(opt["type"], groups, indices, imported.get("tuples", ["betas"]), ms, vs, list(steps))
