"""The standard zstd form (``.zst``; spec §10.4): a zstd skippable frame holding ckptfmt's
metadata as JSON, then one ordinary zstd frame of the exact ``.bin`` bytes. ``zstd -d x.zst``
skips the metadata frame and gives the checkpoint, so ``b3sum`` of the result prints the
manifest's blake3. A plain ``zstd step_000100.bin`` output (no metadata frame) reads too, as
an unverified source; a ``.zst`` of the byte-plane form written before issue 18 is recognised
by its magic and read by ``planes``.

>>> import io, json
>>> frame = metadata_frame({"step": 3})
>>> frame[:4].hex(), int.from_bytes(frame[4:8], "little"), json.loads(frame[8:])
('5c2a4d18', 10, {'step': 3})
"""
from __future__ import annotations

import json
import struct
from typing import Any, BinaryIO

import numpy as np
import zstandard

from ... import atomic, kinds, reader
from ... import format as fmt
from ...errors import CheckpointError, ConvertError, parse_json
from . import planes
from .source import Source

SKIPPABLE = kinds.ZSTD_SKIPPABLE   # one of the 16 skippable-frame magics (RFC 8878 §3.1.2): "C" for ckptfmt
ZSTD_FRAME = kinds.ZSTD_FRAME      # an ordinary zstd frame (RFC 8878 §3.1.1)
LEVEL = 1                    # as good a ratio as 3 and 9, faster: benchmarks/README.md "Compression"
MAX_METADATA = 64 << 20      # the bound of a manifest (spec §4.1), checked before reading
CHUNK = 8 << 20


def metadata_frame(meta: dict[str, Any]) -> bytes:
    """A zstd skippable frame whose content is ``meta`` as UTF-8 JSON."""
    blob = json.dumps(meta, allow_nan=False, separators=(",", ":")).encode()
    return struct.pack("<II", SKIPPABLE, len(blob)) + blob


def write(src: Source, dst: str, weights_only: bool, dtype: str | None, progress=None,
          level: int = LEVEL) -> None:
    """The metadata frame, then the .bin bytes (header, weights, m, v) as one zstd frame with
    its content size and checksum, so ``zstd -d`` checks what it gives back."""
    if weights_only or dtype:
        raise ConvertError(dst, "the .zst form is a compressed .bin: it holds all three regions")
    size = fmt.file_size(src.n_params)
    meta = {"format": "ckptfmt", "form": "zst", "step": src.step, "n_params": src.n_params,
            "size": size, "blake3": src.blake3, "layout": src.layout}
    cctx = zstandard.ZstdCompressor(level=level, threads=-1, write_checksum=True, write_content_size=True)
    with atomic.AtomicWriter(dst) as out:
        with out.fileobj() as f:
            f.write(metadata_frame(meta))
            with cctx.stream_writer(f, size=size, closefd=False) as z:
                z.write(fmt.pack_header(src.step, src.n_params))
                for region in fmt.REGIONS:
                    view = memoryview(np.ascontiguousarray(getattr(src, region))).cast("B")
                    for start in range(0, view.nbytes, CHUNK):
                        z.write(view[start:start + CHUNK])
                        if progress is not None:
                            progress(min(CHUNK, view.nbytes - start))
        out.commit()


def _read_metadata(f: BinaryIO, path: str) -> dict[str, Any] | None:
    """The metadata frame's JSON (None for a plain zstd stream); leaves ``f`` at the data frame."""
    magic, = struct.unpack("<I", f.read(4).ljust(4, b"\0"))
    if magic == ZSTD_FRAME:
        f.seek(0)
        return None
    if magic != SKIPPABLE:
        raise ConvertError(path, "not a zstd file (neither a zstd frame nor ckptfmt's metadata frame)")
    raw = f.read(4)
    length = struct.unpack("<I", raw)[0] if len(raw) == 4 else -1
    if not 0 <= length <= MAX_METADATA:
        raise ConvertError(path, f"metadata frame length {length} is impossible")
    meta = parse_json(f.read(length), ConvertError, path, "metadata frame is not JSON")
    if not isinstance(meta, dict) or meta.get("format") != "ckptfmt":
        raise ConvertError(path, "metadata frame is not ckptfmt's (format != ckptfmt)")
    return meta


def _decompress(f: BinaryIO, path: str) -> bytearray:
    """Every byte of the remaining zstd frame(s), checksum checked by zstandard."""
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True) as z:
            while piece := z.read(CHUNK):
                out += piece
    except zstandard.ZstdError as exc:
        raise ConvertError(path, f"corrupt compressed data: {exc}") from None
    return out


def load(path: str) -> Source:
    """Read the standard form (or a plain zstd stream of a .bin, or the old byte-plane .zst)."""
    with open(path, "rb") as f:
        if f.read(len(planes.MAGIC)) == planes.MAGIC:
            return planes.load(path)
        f.seek(0)
        meta = _read_metadata(f, path)
        data = _decompress(f, path)
    if meta is not None and meta.get("size") != len(data):
        raise ConvertError(path, f"compressed stream ends early or runs on: expected {meta.get('size')} "
                                 f"bytes of .bin, got {len(data)}", expected=meta.get("size"), got=len(data))
    try:
        ck = reader.from_bytes(data, path)
    except CheckpointError as exc:
        raise ConvertError(path, f"the decompressed bytes are not a checkpoint: {exc.problem}") from None
    meta = meta or {}
    layout, digest = meta.get("layout"), meta.get("blake3")
    return Source(path, ck.step, ck.weights, ck.m, ck.v, layout if isinstance(layout, list) else None,
                  digest if isinstance(digest, str) else None)
