"""safetensors as a conversion source and target, read and written with the core's own
``tensorfile`` (no dependency on the safetensors library).

ckptfmt's form (``--to safetensors``): one tensor per parameter and region (``weights/<name>``,
``m/<name>``, ``v/<name>``) and the ckptfmt metadata. A file without ``format=ckptfmt`` in its
metadata is a foreign state dict of weights (what ``safetensors.torch.save_file`` writes): it
comes in as a ``statemap.State`` without optimizer (``foreign_state``) and goes back out with
``--to weights`` (``write_weights``): the same names, dtypes, shapes, bytes and metadata.
"""
from __future__ import annotations

import os

import numpy as np

from ... import format as fmt
from ...errors import UnsupportedConversionError
from ...tensorfile import TensorFile, write
from ...statemap import Entry, State
from .source import Source, cast, meta, meta_source, named, regions_of

# safetensors dtype codes and torch's names for them
TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
               "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
               "U8": "uint8", "BOOL": "bool"}
CODES = {name: code for code, name in TORCH_NAMES.items()}


def is_ckptfmt(sf: TensorFile) -> bool:
    """True for ckptfmt's own safetensors form; False for a foreign file of weights."""
    return sf.metadata.get("format") == "ckptfmt"


def load(path: str, sf: TensorFile | None = None) -> Source:
    """ckptfmt's safetensors form as a ``Source``."""
    sf = TensorFile(path) if sf is None else sf
    regions = {}
    for region in fmt.REGIONS:
        if region in sf.header:
            regions[region] = sf.tensor(region).reshape(-1)
        else:
            parts = [sf.tensor(n).reshape(-1) for n in sf.names() if n.startswith(region + "/")]
            if parts:
                regions[region] = np.concatenate(parts)
    return meta_source(path, sf.metadata, regions)


def write_source(src: Source, dst: str, weights_only: bool, dtype: str | None, progress=None) -> None:
    tensors = []
    for region in regions_of(src, weights_only):
        for name, shape, arr in named(src, region, getattr(src, region)):
            code, data = cast(arr, dtype)
            tensors.append((name, code, shape, data))
    write(dst, tensors, meta(src, weights_only), progress)


def foreign_state(path: str, sf: TensorFile) -> State:
    """A foreign safetensors file as a ``State``: its tensors in the order of their data in the
    file (the order the writer chose), no optimizer."""
    if sf.metadata.get("format") == "ckptfmt-companion":
        raise UnsupportedConversionError(path, "a generation's companion file, not a checkpoint: convert "
                                               "its step_NNNNNN.bin")
    entries = []
    for name, info in sorted(sf.header.items(), key=lambda item: item[1]["data_offsets"][0]):
        dtype = TORCH_NAMES.get(info["dtype"])
        if dtype is None:
            raise UnsupportedConversionError(path, f"{name}: safetensors dtype {info['dtype']} cannot be mapped")
        entries.append(Entry(name, dtype, list(info["shape"]), sf.tensor(name)))
    return State(entries, None, {"from": "safetensors", "file": os.path.basename(path),
                                 "metadata": sf.metadata or None})


def tensors_of(state: State) -> list[tuple[str, str, list[int], np.ndarray]]:
    """(name, code, shape, bytes) of every tensor of the state dict, tied aliases as copies of
    their tensor (safetensors has no shared tensors), so a strict ``load_state_dict`` of the
    file's tensors works."""
    return [(e.name, CODES[e.dtype], list(e.shape), e.data) for e in state.model]


def write_weights(state: State, dst: str) -> None:
    """``--to weights``: the model state dict as a plain safetensors file."""
    write(dst, tensors_of(state), state.imported.get("metadata") or {})
