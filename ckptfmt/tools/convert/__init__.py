"""Conversion (spec §10) between the seed ``.bin`` and safetensors, torch ``.pt``, ``.npz`` and
a zstandard-compressed form. Conversions that can go back are verified by going back: the
round trip must reproduce the original ``.bin`` bytes (equal blake3) before success is reported.
"""
from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ... import atomic, fingerprint
from ... import format as fmt
from ... import reader, writer
from . import safetensors as safetensors_io
from ...errors import ConvertError, DestinationExistsError, MissingDependencyError

FORMATS = ("bin", "safetensors", "pt", "npz", "zst", "shards", "dcp")
ZST_MAGIC = b"CKPTZST\x01"
ZST_CHUNK = 1 << 20          # floats per byte-plane block
ZST_LEVEL = 1                # spec §10: chosen from benchmarks/README.md figures


@dataclass
class Source:
    """What every format carries: step, three flat float32 regions, optional layout."""
    path: str
    step: int
    weights: np.ndarray
    m: np.ndarray | None
    v: np.ndarray | None
    layout: list[dict[str, Any]] | None = None
    blake3: str | None = None           # fingerprint of the original .bin, when known
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_params(self) -> int:
        return int(self.weights.size)


def detect(path: "str | os.PathLike[str]") -> str:
    name = os.fspath(path).lower().rstrip("/")
    if name.endswith(".shards") or name.endswith(".json"):
        return "shards"
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata")):
        return "dcp"
    for suffix, kind in ((".safetensors", "safetensors"), (".pt", "pt"), (".pth", "pt"),
                         (".npz", "npz"), (".zst", "zst"), (".bin", "bin")):
        if name.endswith(suffix):
            return kind
    raise ConvertError(os.fspath(path), "unknown format: expected .bin, .safetensors, .pt, .npz "
                                        "or .zst (or pass --to)")


# ---------------------------------------------------------------- reading

def load(path: str, kind: str | None = None) -> Source:
    kind = kind or detect(path)
    return {"bin": _load_bin, "safetensors": _load_safetensors, "pt": _load_pt,
            "npz": _load_npz, "zst": _load_zst}[kind](path)


def _load_bin(path: str) -> Source:
    ck = reader.open(path, check_name=False)
    doc = ck.manifest or {}
    return Source(path, ck.step, ck.weights, ck.m, ck.v, ck.layout, doc.get("blake3"))


def _meta_source(path: str, meta: dict[str, Any], regions: dict[str, np.ndarray]) -> Source:
    if meta.get("format") != "ckptfmt":
        raise ConvertError(path, "not written by ckptfmt: metadata lacks format=ckptfmt")
    layout = meta.get("layout")
    layout = json.loads(layout) if isinstance(layout, str) else layout
    missing = [r for r in fmt.REGIONS if r not in regions]
    if missing and not meta.get("weights_only"):
        raise ConvertError(path, f"missing regions: {', '.join(missing)}")
    return Source(path, int(meta["step"]), regions["weights"], regions.get("m"), regions.get("v"),
                  layout, meta.get("blake3") or None)


def _load_safetensors(path: str) -> Source:
    sf = safetensors_io.SafeFile(path)
    regions = {}
    for region in fmt.REGIONS:
        if region in sf.header:
            regions[region] = sf.tensor(region)
        else:
            parts = [sf.tensor(n) for n in sf.names() if n.startswith(region + "/")]
            if parts:
                regions[region] = np.concatenate(parts)
    return _meta_source(path, sf.metadata, regions)


def _load_npz(path: str) -> Source:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            regions = {r: np.ascontiguousarray(z[r], dtype=fmt.DTYPE) for r in fmt.REGIONS if r in z}
    except (KeyError, ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise ConvertError(path, f"not a ckptfmt .npz: {exc}") from None
    return _meta_source(path, meta, regions)


def _load_pt(path: str) -> Source:
    torch = _torch(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for a bad file
        raise ConvertError(path, f"cannot load with torch.load(weights_only=True): {exc}") from None
    if not isinstance(state, dict):
        raise ConvertError(path, "not a ckptfmt .pt: expected a dict")
    regions = {r: state[r].contiguous().numpy() for r in fmt.REGIONS if r in state}
    meta = {k: v for k, v in state.items() if k not in fmt.REGIONS}
    return _meta_source(path, meta, regions)


def _torch(path: str):
    try:
        import torch
    except ImportError:
        raise MissingDependencyError(path, ".pt needs torch: pip install 'ckptfmt[torch]'") from None
    return torch


# ---------------------------------------------------------------- writing

def _meta(src: Source, weights_only: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"format": "ckptfmt", "step": str(src.step), "n_params": str(src.n_params),
                            "blake3": src.blake3 or ""}
    if src.layout:
        meta["layout"] = json.dumps(src.layout)
    if weights_only:
        meta["weights_only"] = "1"
    return meta


def _named(src: Source, region: str, arr: np.ndarray) -> Iterator[tuple[str, list[int], np.ndarray]]:
    if not src.layout:
        yield region, [arr.size], arr
        return
    for entry in src.layout:
        count = math.prod(entry["shape"])
        yield f"{region}/{entry['name']}", entry["shape"], arr[entry["offset"]:entry["offset"] + count]


def cast(arr: np.ndarray, dtype: str | None) -> tuple[str, np.ndarray]:
    """(safetensors dtype code, array) for float32, float16 or bfloat16 (round to nearest even)."""
    if dtype in (None, "float32"):
        return "F32", arr
    if dtype == "float16":
        return "F16", arr.astype("<f2")
    if dtype == "bfloat16":
        bits = arr.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = np.isnan(arr)
        out = rounded.astype("<u2")
        out[nan] = ((bits[nan] >> 16) | 0x40).astype("<u2")
        return "BF16", out
    raise ConvertError(None, f"unsupported dtype {dtype}: use float32, float16 or bfloat16")


def _regions(src: Source, weights_only: bool) -> list[str]:
    return ["weights"] if weights_only else list(fmt.REGIONS)


def _write_safetensors(src: Source, dst: str, weights_only: bool, dtype: str | None, progress=None) -> None:
    tensors = []
    for region in _regions(src, weights_only):
        for name, shape, arr in _named(src, region, getattr(src, region)):
            code, data = cast(arr, dtype)
            tensors.append((name, code, shape, data))
    safetensors_io.write(dst, tensors, _meta(src, weights_only), progress)


def _write_npz(src: Source, dst: str, weights_only: bool, dtype: str | None, progress=None) -> None:
    if dtype == "bfloat16":
        raise ConvertError(dst, "numpy has no bfloat16: use .safetensors or .pt for bfloat16")
    arrays = {r: getattr(src, r).astype(dtype or fmt.DTYPE, copy=False) for r in _regions(src, weights_only)}
    meta = _meta(src, weights_only)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with atomic.AtomicWriter(dst) as out:
        with out.fileobj() as f:
            np.savez(f, **arrays)
        out.commit()


def _write_pt(src: Source, dst: str, weights_only: bool, dtype: str | None, progress=None) -> None:
    torch = _torch(dst)
    state: dict[str, Any] = dict(_meta(src, weights_only))
    for region in _regions(src, weights_only):
        t = torch.from_numpy(np.array(getattr(src, region), copy=True))
        state[region] = t.to(getattr(torch, dtype)) if dtype else t
    with atomic.AtomicWriter(dst) as out:
        with out.fileobj() as f:
            torch.save(state, f)
        out.commit()


def _write_bin(src: Source, dst: str, weights_only: bool, dtype: str | None, progress=None) -> None:
    if weights_only or dtype:
        raise ConvertError(dst, "the .bin layout holds float32 weights, m and v; --weights-only "
                                "and --dtype apply to the other formats")
    if src.m is None or src.v is None:
        raise ConvertError(src.path, "weights-only file: cannot rebuild m and v for a .bin")
    extra = {"layout": src.layout} if src.layout else {}
    extra["converted_from"] = os.path.basename(src.path)
    writer.save(dst, src.step, src.weights, src.m, src.v, manifest=extra)


def planes(chunk: np.ndarray) -> bytes:
    """Split float32 values into 4 byte planes (exponents together compress better)."""
    return chunk.view(np.uint8).reshape(-1, 4).T.tobytes()


def unplanes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).reshape(4, -1).T.copy().view(fmt.DTYPE).ravel()


def _write_zst(src: Source, dst: str, weights_only: bool, dtype: str | None, progress=None,
               level: int = ZST_LEVEL, use_planes: bool = True) -> None:
    import zstandard
    if weights_only or dtype:
        raise ConvertError(dst, "the .zst form is a compressed .bin: it holds all three regions")
    head = {"format": "ckptfmt", "step": src.step, "n_params": src.n_params, "blake3": src.blake3,
            "planes": use_planes, "chunk": ZST_CHUNK, "layout": src.layout}
    blob = json.dumps(head).encode()
    with atomic.AtomicWriter(dst) as out:
        with out.fileobj() as f:
            f.write(ZST_MAGIC + struct.pack("<I", len(blob)) + blob)
            cctx = zstandard.ZstdCompressor(level=level, threads=-1)
            with cctx.stream_writer(f, closefd=False) as z:
                z.write(fmt.pack_header(src.step, src.n_params))
                for region in fmt.REGIONS:
                    arr = getattr(src, region)
                    for start in range(0, arr.size, ZST_CHUNK):
                        piece = arr[start:start + ZST_CHUNK]
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


def _load_zst(path: str) -> Source:
    import zstandard
    with open(path, "rb") as f:
        if f.read(8) != ZST_MAGIC:
            raise ConvertError(path, "not a ckptfmt .zst (bad magic)")
        (hlen,) = struct.unpack("<I", f.read(4))
        if hlen > 16 << 20:
            raise ConvertError(path, f"header length {hlen} is impossible")
        head = json.loads(f.read(hlen))
        try:
            with zstandard.ZstdDecompressor().stream_reader(f) as z:
                step, n = fmt.unpack_header(_read_exact(z, fmt.HEADER_SIZE, path))
                regions = {}
                for region in fmt.REGIONS:
                    arr = np.empty(n, dtype=fmt.DTYPE)
                    for start in range(0, n, head["chunk"]):
                        count = min(head["chunk"], n - start)
                        data = _read_exact(z, count * 4, path)
                        arr[start:start + count] = unplanes(data) if head["planes"] else \
                            np.frombuffer(data, dtype=fmt.DTYPE)
                    regions[region] = arr
        except zstandard.ZstdError as exc:
            raise ConvertError(path, f"corrupt compressed data: {exc}") from None
    return Source(path, step, regions["weights"], regions["m"], regions["v"], head.get("layout"),
                  head.get("blake3"))


WRITERS = {"bin": _write_bin, "safetensors": _write_safetensors, "pt": _write_pt,
           "npz": _write_npz, "zst": _write_zst}


# ---------------------------------------------------------------- conversion

@dataclass
class ConvertReport:
    src: str
    dst: str
    src_format: str
    dst_format: str
    step: int
    n_params: int
    verified: str            # 'round-trip', 'values', or 'skipped'
    blake3: str | None
    src_bytes: int
    dst_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def convert(src: str, dst: str, *, to: str | None = None, weights_only: bool = False,
            dtype: str | None = None, verify: bool = True, overwrite: bool = False,
            progress=None, shards: int = 2) -> ConvertReport:
    """Convert ``src`` into ``dst``; with ``verify`` prove the result by converting back.
    ``progress`` gets byte counts: the write (about the source size), then the verification."""
    src_kind, dst_kind = detect(src), to or detect(dst)
    if dst_kind not in FORMATS:
        raise ConvertError(dst, f"unknown format {dst_kind}: choose one of {', '.join(FORMATS)}")
    if dst_kind != "shards" and os.path.lexists(dst) and not overwrite:
        raise DestinationExistsError(dst, "exists already; refusing to overwrite")
    if "shards" in (src_kind, dst_kind) or "dcp" in (src_kind, dst_kind):
        from .shards import convert_distributed
        return convert_distributed(src, dst, src_kind, dst_kind, shards=shards, verify=verify)
    source = load(src, src_kind)
    original = fingerprint.of_file(src) if src_kind == "bin" else source.blake3
    source.blake3 = original
    size = os.path.getsize(src)
    written = [0]

    def wrote(n: int) -> None:
        written[0] += n
        if progress is not None:
            progress(n)
    WRITERS[dst_kind](source, dst, weights_only, dtype, wrote)
    if progress is not None and written[0] < size:
        progress(size - written[0])            # writers without chunk progress report at the end
    how = "skipped"
    if verify:
        how = _verify(source, dst, dst_kind, weights_only, dtype, original)
        if progress is not None:
            progress(size)
    return ConvertReport(src, dst, src_kind, dst_kind, source.step, source.n_params, how, original,
                         os.path.getsize(src), os.path.getsize(dst))


def _verify(source: Source, dst: str, kind: str, weights_only: bool, dtype: str | None,
            original: str | None) -> str:
    if weights_only or kind == "bin" or original is None:
        back = load(dst, kind)
        for region in _regions(source, weights_only):
            want = cast(getattr(source, region), dtype)[1]
            got = getattr(back, region)
            if not np.array_equal(np.asarray(want).view(np.uint8), np.asarray(got).view(np.uint8)):
                _discard(dst)
                raise ConvertError(dst, f"verification failed: region {region} differs after "
                                        "reading the result back")
        if kind == "bin" and original and fingerprint.of_file(dst) != original:
            _discard(dst)
            raise ConvertError(dst, "verification failed: blake3 differs from the source's")
        return "values"
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(dst))) as tmp:
        back_path = os.path.join(tmp, f"step_{source.step:06d}.bin")
        _write_bin(load(dst, kind), back_path, False, None)
        got = fingerprint.of_file(back_path)
    if got != original:
        _discard(dst)
        raise ConvertError(dst, f"round trip failed: converting back gives blake3 {got}, "
                                f"the source is {original}")
    return "round-trip"


def _discard(path: str) -> None:
    """A result that failed verification must not be mistaken for a good one."""
    try:
        os.unlink(path)
        bin_manifest = Path(path).with_suffix(".json")
        if path.endswith(".bin") and bin_manifest.exists():
            os.unlink(bin_manifest)
    except OSError:
        pass
