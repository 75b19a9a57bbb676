"""safetensors as a conversion source and target: one tensor per parameter and region
(``weights/<name>``, ``m/<name>``, ``v/<name>``) and the ckptfmt metadata, read and written
with the core's own ``tensorfile`` (no dependency on the safetensors library)."""
from __future__ import annotations

import numpy as np

from ... import format as fmt
from ...tensorfile import TensorFile, write
from .source import Source, cast, meta, meta_source, named, regions_of


def load(path: str) -> Source:
    sf = TensorFile(path)
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


