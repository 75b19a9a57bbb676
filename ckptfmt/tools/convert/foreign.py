"""Foreign weight files that are not torch's, as a ``statemap.State`` of weights (no optimizer):
a sharded safetensors (``model.safetensors.index.json`` and the shard files beside it) and an
``.npz`` of arrays that ckptfmt did not write (never unpickled). ``inspect``, ``validate`` and
``diff`` read them through ``anyfile``; ``convert`` takes them into a ``.bin`` (m and v zero)
and proves it by reading every tensor back.
"""
from __future__ import annotations

import os
import zipfile

import numpy as np

from ... import kinds
from ...errors import ConvertError, TensorFileError, UnsupportedKindError
from ...statemap import Entry, State
from ...tensorfile import TensorFile
from . import npz, safetensors

__all__ = ["index_state", "npz_state", "ckptfmt_npz"]

NPZ_DTYPES = {"<f4": "float32", "<f2": "float16", "<f8": "float64"}


def index_state(path: str) -> State:
    """The tensors of a sharded safetensors (``model.safetensors.index.json`` and its shard
    files), in the index's shard order; a tensor the weight map names but its shard lacks, or a
    shard that is missing, is a ``TensorFileError``."""
    doc = kinds.Probe(path).document or {}
    weight_map = doc.get("weight_map") or {}
    files = list(dict.fromkeys(str(f) for f in weight_map.values()))
    where = os.path.dirname(os.path.abspath(path))
    entries: list[Entry] = []
    for name in files:
        shard = os.path.join(where, name)
        if os.path.basename(name) != name or not os.path.isfile(shard):
            raise TensorFileError(path, f"weight map names shard {name!r}, which is not a file beside it")
        part = safetensors.foreign_state(shard, TensorFile(shard)).model
        entries += part
    missing = sorted(set(weight_map) - {e.name for e in entries})
    if missing:
        raise TensorFileError(path, f"weight map names {len(missing)} tensors its shards lack, first {missing[0]!r}")
    return State(entries, None, {"from": "safetensors-index", "file": os.path.basename(path),
                                 "shards": files, "metadata": doc.get("metadata")})


def ckptfmt_npz(path: str) -> bool:
    """An ``.npz`` of ckptfmt's own form (its ``meta`` array); a torn zip counts as ours, so that
    convert's reader names the damage."""
    try:
        with zipfile.ZipFile(path) as z:
            return "meta.npy" in z.namelist()
    except (zipfile.BadZipFile, OSError):
        return True            # let convert's reader name the damage


def npz_state(path: str) -> State:
    """The arrays of a foreign ``.npz`` (never unpickled) as a state dict of tensors."""
    try:
        with np.load(path, allow_pickle=False) as z:
            entries = [_npz_entry(path, name, np.asarray(z[name])) for name in z.files]
    except npz.READ_ERRORS as exc:
        raise ConvertError(path, f"not a readable .npz: {exc}") from None
    return State(entries, None, {"from": "npz", "file": os.path.basename(path)})


def _npz_entry(path: str, name: str, arr: np.ndarray) -> Entry:
    dtype = NPZ_DTYPES.get(arr.dtype.str) or (arr.dtype.name if arr.dtype.kind in "iub" else None)
    if dtype is None:
        raise UnsupportedKindError(path, f"array {name!r}: dtype {arr.dtype} is no tensor type ckptfmt maps")
    return Entry(name, dtype, list(arr.shape), np.ascontiguousarray(arr).reshape(-1))
