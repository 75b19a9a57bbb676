"""The byte-plane form (``.ckz``, ``--to planes``; spec §10.5): a small JSON head, then the
``.bin`` bytes with each float32 split into four byte planes (exponents together compress
better), zstd level 1. It is ckptfmt's own container, not a zstd file: ``zstd -d`` cannot read
it (the standard form is ``.zst``, module ``zst``). Releases before issue 18 wrote this form
under the name ``.zst``; ``zst.load`` recognises it by its magic and reads it here."""
from __future__ import annotations

import json
import struct

import numpy as np
import zstandard

from ... import atomic, kinds
from ... import format as fmt
from ...errors import ConvertError, parse_json
from .source import Source

MAGIC = kinds.PLANES_MAGIC    # the registry of kinds sniffs it (ckptfmt.kinds)
CHUNK = 1 << 20          # floats per byte-plane block
LEVEL = 1                # spec §10: chosen from benchmarks/README.md figures


def planes(chunk: np.ndarray) -> bytes:
    """Split float32 values into 4 byte planes (exponents together compress better).

    Examples:
        >>> a = np.array([1.0, -2.5], dtype="<f4")
        >>> planes(a).hex(), unplanes(planes(a)).tolist()
        ('0000000080203fc0', [1.0, -2.5])
    """
    return chunk.view(np.uint8).reshape(-1, 4).T.tobytes()


def unplanes(data: bytes) -> np.ndarray:
    """The inverse of ``planes``: float32 values from 4 byte planes.

    Examples:
        >>> import numpy as np
        >>> from ckptfmt.tools.convert import planes_of, unplanes
        >>> unplanes(planes_of(np.float32([1.0, -2.5]))).tolist()
        [1.0, -2.5]
    """
    return np.frombuffer(data, dtype=np.uint8).reshape(4, -1).T.copy().view(fmt.DTYPE).ravel()


def write(src: Source, dst: str, weights_only: bool, dtype: str | None, progress=None,
               level: int = LEVEL, use_planes: bool = True) -> None:
    if weights_only or dtype:
        raise ConvertError(dst, "the byte-plane form is a compressed .bin: it holds all three regions")
    head = {"format": "ckptfmt", "step": src.step, "n_params": src.n_params, "blake3": src.blake3,
            "planes": use_planes, "chunk": CHUNK, "layout": src.layout}
    blob = json.dumps(head).encode()
    with atomic.AtomicWriter(dst) as out:
        with out.fileobj() as f:
            f.write(MAGIC + struct.pack("<I", len(blob)) + blob)
            cctx = zstandard.ZstdCompressor(level=level, threads=-1)
            with cctx.stream_writer(f, closefd=False) as z:
                z.write(fmt.pack_header(src.step, src.n_params))
                for region in fmt.REGIONS:
                    arr = getattr(src, region)
                    for start in range(0, arr.size, CHUNK):
                        piece = arr[start:start + CHUNK]
                        z.write(planes(piece) if use_planes else piece.tobytes())
                        if progress is not None:
                            progress(piece.nbytes)
        out.commit()


def _read_exact(stream, n: int, path: str) -> bytes:
    parts, got = [], 0
    while got < n:
        piece = stream.read(n - got)
        if not piece:
            raise ConvertError(path, f"compressed stream ends early: expected {n} more bytes, got {got}")
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


def _head(f, path: str) -> dict:
    """The JSON head after the magic, checked before any value of it is used."""
    if f.read(8) != MAGIC:
        raise ConvertError(path, "not a ckptfmt byte-plane file (bad magic)")
    raw = f.read(4)
    (hlen,) = struct.unpack("<I", raw) if len(raw) == 4 else (-1,)
    if not 0 <= hlen <= 16 << 20:
        raise ConvertError(path, f"byte-plane header length {hlen} is impossible")
    head = parse_json(f.read(hlen), ConvertError, path, "byte-plane header is not JSON")
    chunk = head.get("chunk") if isinstance(head, dict) else None
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise ConvertError(path, f"byte-plane header: chunk must be a positive integer, got {chunk!r}")
    return head


def load(path: str) -> Source:
    """Read a byte-plane file (today's ``.ckz``, or a ``.zst`` written before issue 18)."""
    with open(path, "rb") as f:
        head = _head(f, path)
        try:
            with zstandard.ZstdDecompressor().stream_reader(f) as z:
                step, n = fmt.unpack_header(_read_exact(z, fmt.HEADER_SIZE, path))
                if step < 0 or n < 0:
                    raise ConvertError(path, f"compressed .bin header is impossible: step {step}, n_params {n}")
                regions = {}
                for region in fmt.REGIONS:
                    arr = np.empty(n, dtype=fmt.DTYPE)
                    for start in range(0, n, head["chunk"]):
                        count = min(head["chunk"], n - start)
                        data = _read_exact(z, count * 4, path)
                        arr[start:start + count] = unplanes(data) if head.get("planes") else \
                            np.frombuffer(data, dtype=fmt.DTYPE)
                    regions[region] = arr
        except zstandard.ZstdError as exc:
            raise ConvertError(path, f"corrupt compressed data: {exc}") from None
    layout = head.get("layout")
    return Source(path, step, regions["weights"], regions["m"], regions["v"],
                  layout if isinstance(layout, list) else None,
                  head.get("blake3") if isinstance(head.get("blake3"), str) else None)
