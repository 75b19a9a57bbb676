"""safetensors-format files: the companion file of a generation (tensors the seed layout cannot
hold: buffers, state tensors) and the safetensors converter both use this reader and writer, so
the core needs no extra dependency.

The format (safetensors README): 8-byte LE header length, a JSON header mapping tensor names
to dtype/shape/data_offsets (plus ``__metadata__``, str -> str), then the data with no holes.
Files written here load in the real ``safetensors`` library; tests check that.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
>>> digest = write(path, [("a", "I64", [2], np.array([1, 2], dtype="<i8"))], {"k": "v"})
>>> f = TensorFile(path)
>>> f.metadata, f.tensor("a").tolist(), digest == fingerprint.of_file(path)
({'k': 'v'}, [1, 2], True)
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from typing import Any, Iterable, Iterator

import numpy as np

from . import atomic, fingerprint
from .errors import TensorFileError, parse_json

MAX_HEADER = 100 << 20
DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
          "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U64": np.dtype("<u8"), "U32": np.dtype("<u4"),
          "U16": np.dtype("<u2"), "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
CODES = {dtype: code for code, dtype in DTYPES.items() if code != "BF16" and code != "U16"}
CODES[np.dtype("<u2")] = "U16"
CHUNK = 8 << 20


def write(path: str, tensors: Iterable[tuple[str, str, list[int], np.ndarray]],
          metadata: dict[str, str], progress=None) -> str:
    """Durably write ``tensors`` ((name, dtype code, shape, array holding that dtype's bytes),
    in file order); returns the blake3 of the file, hashed as it is written."""
    hasher = fingerprint.hasher(0)
    with atomic.AtomicWriter(path) as out:
        for piece, is_data in encode(tensors, metadata):
            hasher.update(piece)
            out.write(piece)
            if progress is not None and is_data:   # progress counts tensor bytes
                progress(len(piece))
        out.commit()
    return hasher.hexdigest()


def encode(tensors: Iterable[tuple[str, str, list[int], np.ndarray]],
           metadata: dict[str, str]) -> Iterator[tuple[memoryview, bool]]:
    """The file ``write`` makes, as (piece, whether it is tensor data) in file order: what a
    store's writer streams."""
    tensors = list(tensors)
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, code, shape, arr in tensors:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    head = struct.pack("<Q", len(blob)) + blob
    for piece in _pieces(head, tensors):
        yield piece, piece.obj is not head


def _pieces(head: bytes, tensors: list) -> Iterable[memoryview]:
    yield memoryview(head)
    for _, _, _, arr in tensors:
        if arr.nbytes == 0:
            continue
        view = memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B")
        for start in range(0, view.nbytes, CHUNK):
            yield view[start:start + CHUNK]


def _head(f: Any) -> bytes:
    """The 8-byte length and the JSON header it announces (no more than ``MAX_HEADER``)."""
    first = f.read(8)
    (hlen,) = struct.unpack("<Q", first)
    return first + f.read(min(hlen, MAX_HEADER))


def _check_entry(path: str, name: str, info: object) -> None:
    ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str)
          and isinstance(info.get("shape"), list)
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in info["shape"])
          and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
          and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in info["data_offsets"]))
    if not ok:
        raise TensorFileError(path, f"tensor {name!r}: needs dtype, shape and two data_offsets")


class TensorFile:
    """A parsed safetensors file: ``metadata`` and ``tensor(name)`` views over one mmap."""

    def __init__(self, path: str, data: "bytes | None" = None):
        """The file at ``path``, mapped; or ``data``, its bytes held in memory (read from a
        store), ``path`` then naming it in messages."""
        self.path = path
        if data is not None:
            self._parse(memoryview(data))
            self._mm: Any = data
            return
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self._parse(_head(f) if size >= 8 else b"", size)
            # mapped last, once the header is accepted: a refused file leaves no map behind
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def _parse(self, head: "bytes | memoryview", size: int | None = None) -> None:
        """The header from the file's first bytes (``size``: the file's, else ``len(head)``)."""
        path = self.path
        size = len(head) if size is None else size
        if size < 8:
            raise TensorFileError(path, f"not a safetensors file: {size} bytes")
        (hlen,) = struct.unpack("<Q", bytes(head[:8]))
        if hlen > MAX_HEADER or 8 + hlen > size:
            raise TensorFileError(path, f"safetensors header length {hlen} is impossible for a "
                                     f"{size}-byte file")
        self.header = parse_json(bytes(head[8:8 + hlen]), TensorFileError, path, "safetensors header is not JSON")
        self.data_start = 8 + hlen
        if not isinstance(self.header, dict):
            raise TensorFileError(path, "safetensors header is not a JSON object")
        self.metadata = self.header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise TensorFileError(path, "safetensors __metadata__ is not an object")
        for name, info in self.header.items():
            _check_entry(path, name, info)
        self._check_coverage(size)

    def _check_coverage(self, size: int) -> None:
        spans = sorted(tuple(t["data_offsets"]) for t in self.header.values())
        cursor = 0
        for start, end in spans:
            if start != cursor or end < start:
                raise TensorFileError(self.path, f"safetensors data has a hole or overlap at {start}")
            cursor = end
        if self.data_start + cursor != size:
            raise TensorFileError(self.path, f"safetensors data covers {cursor} bytes, file holds "
                                          f"{size - self.data_start}")

    def names(self) -> list[str]:
        """Tensor names in header order."""
        return list(self.header)

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view of one tensor, shaped (bfloat16 comes back as its uint16 bits)."""
        info = self.header[name]
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise TensorFileError(self.path, f"tensor {name}: dtype {info['dtype']} is not supported")
        start, end = info["data_offsets"]
        count = math.prod(info["shape"])
        if (end - start) != count * dtype.itemsize:
            raise TensorFileError(self.path, f"tensor {name}: shape and byte range disagree")
        flat = np.frombuffer(self._mm, dtype=dtype, count=count, offset=self.data_start + start)
        return flat.reshape(info["shape"])
