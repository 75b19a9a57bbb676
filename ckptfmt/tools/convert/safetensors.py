"""A safetensors reader and writer of our own, so the core needs no extra dependency.

The format (safetensors README): 8-byte LE header length, a JSON header mapping tensor names
to dtype/shape/data_offsets (plus ``__metadata__``, str -> str), then the data with no holes.
Files written here load in the real ``safetensors`` library; tests check that.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from typing import Any, Iterable

import numpy as np

from ... import atomic
from ... import format as fmt
from ...errors import ConvertError
from .source import Source, cast, meta, meta_source, named, regions_of

MAX_HEADER = 100 << 20
DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
CHUNK = 8 << 20


def write(path: str, tensors: Iterable[tuple[str, str, list[int], np.ndarray]],
          metadata: dict[str, str], progress=None) -> None:
    """tensors: (name, dtype code, shape, flat array of that dtype's bytes) in file order."""
    tensors = list(tensors)
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, code, shape, arr in tensors:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with atomic.AtomicWriter(path) as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        for _, _, _, arr in tensors:
            view = memoryview(np.ascontiguousarray(arr)).cast("B")
            for start in range(0, view.nbytes, CHUNK):
                out.write(view[start:start + CHUNK])
                if progress is not None:
                    progress(min(CHUNK, view.nbytes - start))
        out.commit()


def _check_entry(path: str, name: str, info: object) -> None:
    ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str)
          and isinstance(info.get("shape"), list)
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in info["shape"])
          and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
          and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in info["data_offsets"]))
    if not ok:
        raise ConvertError(path, f"tensor {name!r}: needs dtype, shape and two data_offsets")


class SafeFile:
    """A parsed safetensors file: ``metadata`` and ``tensor(name)`` views over one mmap."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ConvertError(path, f"not a safetensors file: {size} bytes")
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > MAX_HEADER or 8 + hlen > size:
                raise ConvertError(path, f"safetensors header length {hlen} is impossible for a "
                                         f"{size}-byte file")
            try:
                self.header = json.loads(f.read(hlen))
            except ValueError as exc:
                raise ConvertError(path, f"safetensors header is not JSON: {exc}") from None
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data_start = 8 + hlen
        if not isinstance(self.header, dict):
            raise ConvertError(path, "safetensors header is not a JSON object")
        self.metadata = self.header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise ConvertError(path, "safetensors __metadata__ is not an object")
        for name, info in self.header.items():
            _check_entry(path, name, info)
        self._check_coverage(size)

    def _check_coverage(self, size: int) -> None:
        spans = sorted(tuple(t["data_offsets"]) for t in self.header.values())
        cursor = 0
        for start, end in spans:
            if start != cursor or end < start:
                raise ConvertError(self.path, f"safetensors data has a hole or overlap at {start}")
            cursor = end
        if self.data_start + cursor != size:
            raise ConvertError(self.path, f"safetensors data covers {cursor} bytes, file holds "
                                          f"{size - self.data_start}")

    def names(self) -> list[str]:
        return list(self.header)

    def tensor(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise ConvertError(self.path, f"tensor {name}: dtype {info['dtype']} is not supported")
        start, end = info["data_offsets"]
        count = math.prod(info["shape"])
        if (end - start) != count * dtype.itemsize:
            raise ConvertError(self.path, f"tensor {name}: shape and byte range disagree")
        return np.frombuffer(self._mm, dtype=dtype, count=count, offset=self.data_start + start)


def load(path: str) -> Source:
    sf = SafeFile(path)
    regions = {}
    for region in fmt.REGIONS:
        if region in sf.header:
            regions[region] = sf.tensor(region)
        else:
            parts = [sf.tensor(n) for n in sf.names() if n.startswith(region + "/")]
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


