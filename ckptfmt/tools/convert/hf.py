"""Hugging Face directories into a ``.bin`` (spec §10.7, RUN.md §12.5): a Trainer's
``checkpoint-N`` (weights from ``model.safetensors`` or its shards, Adam/AdamW moments from
``optimizer.pt`` through the mapping, the group names from the callback's record or
``--groups``) and a ``save_pretrained`` directory of ``model-0000x-of-0000y.safetensors`` shards
with their ``model.safetensors.index.json``, of one ``model.safetensors`` or of one
``pytorch_model.bin`` (read with ``torch.load(weights_only=True)``; weights only).

A sharded model converts whole or not at all: a shard the index names that is missing or does
not hold what the index says, or a tensor no index entry names, is refused in one line before
anything is written. ``optimizer.pt`` is read with ``torch.load(weights_only=True)``;
``training_args.bin`` (a pickle of TrainingArguments) is never opened. A checkpoint with its
commit record is checked against it (every file's blake3) before anything is read.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ...errors import FingerprintMismatchError, UnsupportedConversionError
from ...hfcheckpoint import RECORD, HFCheckpoint
from ...statemap import Entry, State
from ...tensorfile import TensorFile
from ...wrappers import strip
from .. import hfdir
from .safetensors import TORCH_NAMES
from .torchside import torchsave

VERIFIED_RECORD = f"verified: every file against {RECORD}"
OPTIMIZER = "optimizer.pt"


def load(src: str) -> tuple[dict[str, Any], str, list[list[str]] | None]:
    """(the directory as the object ``torchsave.to_state`` maps: ``{"model": ..., "optimizer":
    ...}``, how the source was checked, each group's parameter names from the record or None)."""
    directory = Path(src)
    record = _record(src)
    ts = torchsave(src)
    entries = in_model_order(_torch_weights(directory, ts) or weight_entries(directory), (record or {}).get("parameters"))
    obj = ts.from_state(State(entries, None, {"keys": {"model": "model", "optimizer": None}}), src)
    if (directory / OPTIMIZER).is_file():
        obj["optimizer"] = ts.read(str(directory / OPTIMIZER))
    groups = record.get("param_groups") if record is not None else None
    checked = VERIFIED_RECORD if record is not None else "unverified: no ckptfmt commit record"
    return obj, checked, groups if isinstance(groups, list) else None


def state_of(src: str) -> State:
    """The directory as a ``State`` for the readers (inspect, validate, diff): without torch
    where no torch file must be read (a ``save_pretrained`` directory of safetensors, no
    ``optimizer.pt``); else through ``load`` and torch, as ``convert`` reads it."""
    directory = Path(src)
    if (directory / OPTIMIZER).is_file() or _torch_weights(directory, None) is not None:
        loaded, _, groups = load(src)               # no record: the file's order is not the model's
        return torchsave(src).to_state(loaded, src, groups, by_index=True if groups else "always")
    record = _record(src)
    entries = in_model_order(weight_entries(directory), (record or {}).get("parameters"))
    named, _ = strip({e.name: e for e in entries})        # DDP's and compile's prefixes, as torch's reader does
    return State([dataclasses.replace(e, name=n) for n, e in named.items()], None,
                 {"keys": {"model": "model", "optimizer": None}})


def _record(src: str) -> dict[str, Any] | None:
    """The directory's commit record, every file checked against it first (None: it has none,
    unverified); ``FingerprintMismatchError`` for the first file that differs."""
    gen = HFCheckpoint.at(src)
    record = gen.read_manifest()
    if record is not None and (found := gen.problems()):
        raise FingerprintMismatchError(src, f"does not match its {RECORD}: {found[0]}")
    return record


def _torch_weights(directory: Path, ts: Any) -> list[Entry] | None:
    """The tensors of ``pytorch_model.bin`` (``save_pretrained(safe_serialization=False)``, a
    Trainer's ``save_safetensors=False``) where there is no safetensors weight file, in its order;
    None where there is one, or no ``pytorch_model.bin`` either."""
    path = directory / hfdir.TORCH_WEIGHTS
    if (directory / hfdir.WEIGHTS).is_file() or (directory / hfdir.INDEX).is_file() or not path.is_file():
        return None
    if ts is None:                 # only asked whether there is one to read
        return []
    model = ts.read(str(path))
    ts.require_dict(model, str(path))
    return ts.to_state(model, str(path)).model       # a bare state dict, or {"model": ..., ...}


def in_model_order(entries: list[Entry], order: Any) -> list[Entry]:
    """The parameters in the model's order (the record's ``parameters``: ``named_parameters()``
    when it was saved), so the ``.bin`` loads into the model as it is; the other tensors
    (buffers) after them in file order. Without that list: file order."""
    if not isinstance(order, list):
        return entries
    rank = {name: i for i, name in enumerate(order) if isinstance(name, str)}
    return sorted(entries, key=lambda e: rank.get(e.name, len(rank)))


def weight_entries(directory: Path) -> list[Entry]:
    """Every tensor of the model's safetensors files, in file order (the shards in their index's
    order of first mention); refused whole where the index and the shards disagree."""
    index = directory / hfdir.INDEX
    if not index.is_file():
        if not (directory / hfdir.WEIGHTS).is_file():
            raise UnsupportedConversionError(str(directory), f"no {hfdir.WEIGHTS} nor {hfdir.INDEX}: no weights "
                                                             "to convert")
        return _entries(directory / hfdir.WEIGHTS, None)
    weight_map = hfdir.weight_map(index, UnsupportedConversionError)
    shards = list(dict.fromkeys(weight_map.values()))
    out: list[Entry] = []
    for shard in shards:
        path = directory / shard
        if not path.is_file():
            raise UnsupportedConversionError(str(path), f"missing: {hfdir.INDEX} names it for "
                                                        f"{sum(v == shard for v in weight_map.values())} tensors; "
                                                        "refusing half a model")
        out += _entries(path, {n for n, s in weight_map.items() if s == shard})
    return out


def _entries(path: Path, expected: set[str] | None) -> list[Entry]:
    sf = TensorFile(str(path))
    names = set(sf.names())
    if expected is not None and names != expected:
        extra, lacking = sorted(names - expected), sorted(expected - names)
        said = f"holds {extra[0]}, which the index does not name there" if extra else \
            f"lacks {lacking[0]}, which the index names there"
        raise UnsupportedConversionError(str(path), f"{said}; refusing half a model")
    out = []
    for name, info in sorted(sf.header.items(), key=lambda item: item[1]["data_offsets"][0]):
        dtype = TORCH_NAMES.get(info["dtype"])
        if dtype is None:
            raise UnsupportedConversionError(str(path), f"{name}: safetensors dtype {info['dtype']} cannot be mapped")
        out.append(Entry(name, dtype, list(info["shape"]), sf.tensor(name)))
    return out
