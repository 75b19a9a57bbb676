"""A file of any kind (``ckptfmt.kinds``) as a ``Source``: step, weights, m, v, layout, read
through convert's readers, so inspect, validate and diff see every kind the way convert maps it.

ckptfmt's own forms come back with the blake3 they record; a foreign state dict (a torch.save
file, a safetensors file or a sharded safetensors index, an ``.npz`` of arrays) is mapped by
``ckptfmt.statemap`` exactly as ``convert`` maps it into a ``.bin`` (parameters by name, the
optimizer's moments by parameter, zeros where there are none), with ``extra["origin"]`` =
``"foreign"``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .. import kinds, statemap, unnamed
from .. import format as fmt
from .. import manifest as mf
from ..errors import UnsupportedKindError
from ..kinds import Kind
from ..shards import ShardedCheckpoint
from ..statemap import State
from ..statestep import header_step
from . import convert
from .convert import foreign, hf, safetensors
from .convert.shards import dcp_source
from .convert.source import Source
from .convert.torchside import dcp, torchsave

__all__ = ["open_source"]

def open_source(path: str, kind: Kind | None = None) -> Source:
    """``path`` (of ``kind``, sniffed when not given) as a ``Source``; ``extra`` holds
    ``origin`` ("ckptfmt" or "foreign"), ``n_tensors`` and ``dtypes`` where known."""
    kind = kind or kinds.sniff(path)
    if kind.name == "shards":
        return _sharded(path)
    if kind.name == "dcp":
        return _dcp(path)
    if kind.name in ("hf-model", "hf-checkpoint"):     # read as convert reads them (a record checked first)
        return foreign_source(path, hf.state_of(path))
    if kind.name == "safetensors-index":
        return foreign_source(path, foreign.index_state(path))
    if kind.convert is None:
        raise UnsupportedKindError(path, f"cannot read a {kind.label}")
    if kind.name == "npz" and not foreign.ckptfmt_npz(path):
        return foreign_source(path, foreign.npz_state(path))
    opened = convert.open_file(path, kind.convert)
    if isinstance(opened, Source):
        opened.extra.setdefault("origin", "ckptfmt")
        return opened
    state = torchsave(path).to_state(opened, path, by_index=True) if kind.convert == "pt" \
        else safetensors.foreign_state(path, opened)
    return foreign_source(path, state)


def foreign_source(path: str, state: State) -> Source:
    """A foreign state as convert maps it: parameters in order, m and v by parameter name (or,
    where its param groups name nothing, in the optimizer's order: ``ckptfmt.unnamed``)."""
    opt = state.optimizer
    in_order = unnamed.by_index(opt)
    params, buffers = statemap.split(dataclasses.replace(state, optimizer=None) if in_order else state, path)
    weights, m, v = statemap.regions(params, None if in_order else opt)
    flat = [np.concatenate(part) if part else np.zeros(0, fmt.DTYPE) for part in (weights, m, v)]
    if in_order:
        flat[1:] = unnamed.moments(opt, params, path)
    extra = {"origin": "foreign", "n_tensors": len(state.model), "parameters": len(params),
             "buffers": len(buffers), "dtypes": sorted({e.dtype for e in state.model}),
             "optimizer": opt.kind if opt is not None else None}
    if in_order:
        extra.update(moments=unnamed.ORDER, moment_structure=unnamed.structure(opt))
    return Source(path, header_step(state, None), *flat, statemap.layout(params), None, extra)


def manifest_of(path: str) -> str:
    """The manifest of a sharded generation given by its manifest or its ``.shards`` directory."""
    path = path.rstrip("/")
    return str(mf.path_for(path)) if path.endswith(".shards") else path


def _sharded(path: str) -> Source:
    with ShardedCheckpoint(manifest_of(path)) as sc:
        regions = [np.array(getattr(sc, r)) for r in fmt.REGIONS]
        doc = sc.manifest
    return Source(path, doc["step"], *regions, doc.get("layout"), doc.get("blake3"),
                  {"origin": "ckptfmt", "shards": len(doc["shards"]), "manifest": doc})


def _dcp(path: str) -> Source:
    """A DCP directory ckptfmt wrote as its arrays and the digest it records (``dcp_source``);
    any other as the foreign state dict it holds, mapped as a torch.save file's."""
    if not dcp(path).is_ours(path):
        return foreign_source(path, torchsave(path).to_state(dcp(path).read_foreign(path), path, by_index=True))
    return dcp_source(path)


def describe(source: Source) -> dict[str, Any]:
    """What inspect shows of a ``Source`` beside its statistics."""
    out = {k: source.extra[k] for k in ("origin", "n_tensors", "parameters", "buffers", "dtypes", "optimizer",
                                        "moments", "shards", "no_digest") if k in source.extra}
    if source.layout:
        out["layout_tensors"] = len(source.layout)
    if source.blake3:
        out["recorded_blake3"] = source.blake3
    return out

