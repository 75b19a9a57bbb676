"""Conversion (spec §10) between the seed ``.bin`` and safetensors, torch ``.pt``, ``.npz``, a
zstandard-compressed form, sharded generations and DCP directories: one module per format.
Conversions that can go back are verified by going back: the round trip must reproduce the
original ``.bin`` bytes (equal blake3) before success is reported.
"""
from __future__ import annotations

import errno
import os
import tempfile
import numpy as np

from ... import fingerprint
from ... import format as fmt
from ...errors import ConvertError, DestinationExistsError, UnsupportedFormatError
from . import bin, npz, pt, safetensors, zst
from .shards import convert_distributed
from .source import ConvertReport, Source, cast, discard, regions_of
from .zst import planes, unplanes

__all__ = ["FORMATS", "ConvertReport", "Source", "cast", "convert", "detect", "load", "planes",
           "unplanes"]

FORMATS = ("bin", "safetensors", "pt", "npz", "zst", "shards", "dcp")
READERS = {"bin": bin.load, "safetensors": safetensors.load, "pt": pt.load, "npz": npz.load,
           "zst": zst.load}
WRITERS = {"bin": bin.write, "safetensors": safetensors.write_source, "pt": pt.write,
           "npz": npz.write, "zst": zst.write}


def detect(path: "str | os.PathLike[str]") -> str:
    """The format of ``path`` from its name (or, for a directory, its DCP ``.metadata``).

    >>> detect("step_000100.safetensors"), detect("x.pth"), detect("step_000100.json")
    ('safetensors', 'pt', 'shards')
    """
    name = os.fspath(path).lower().rstrip("/")
    if name.endswith(".shards") or name.endswith(".json"):
        return "shards"
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata")):
        return "dcp"
    if os.path.isdir(path):
        raise UnsupportedFormatError(os.fspath(path), "a directory, expected a checkpoint file (or a "
                                                      "DCP directory with its .metadata)")
    for suffix, kind in ((".safetensors", "safetensors"), (".pt", "pt"), (".pth", "pt"),
                         (".npz", "npz"), (".zst", "zst"), (".bin", "bin")):
        if name.endswith(suffix):
            return kind
    raise UnsupportedFormatError(os.fspath(path), "unknown format: expected .bin, .safetensors, .pt, "
                                                  ".npz or .zst (or pass --to)")


def load(path: str, kind: str | None = None) -> Source:
    """Read any supported single-file format into a ``Source`` (step, regions, layout)."""
    kind = kind or detect(path)
    return READERS[kind](path)


def convert(src: str, dst: str, *, to: str | None = None, weights_only: bool = False,
            dtype: str | None = None, verify: bool = True, overwrite: bool = False,
            progress=None, shards: int = 2) -> ConvertReport:
    """Convert ``src`` into ``dst``; with ``verify`` prove the result by converting back.
    ``progress`` gets byte counts: the write (about the source size), then the verification."""
    if not os.path.exists(src):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", src)
    src_kind, dst_kind = detect(src), to or detect(dst)
    if dst_kind not in FORMATS:
        raise UnsupportedFormatError(dst, f"unknown format {dst_kind}: choose one of {', '.join(FORMATS)}")
    if dst_kind != "shards" and os.path.lexists(dst) and not overwrite:
        raise DestinationExistsError(dst, "exists already; refusing to overwrite")
    parent = os.path.dirname(os.path.abspath(dst))
    if dst_kind not in ("shards", "dcp") and not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, "destination directory does not exist", parent)
    if "shards" in (src_kind, dst_kind) or "dcp" in (src_kind, dst_kind):
        return convert_distributed(src, dst, src_kind, dst_kind, shards=shards, verify=verify)
    existed = os.path.lexists(dst)
    try:
        return _convert_file(src, dst, src_kind, dst_kind, weights_only, dtype, verify, progress)
    except BaseException:
        if not existed:
            discard(dst)       # a failed conversion leaves nothing behind (its manifest included)
        raise


def _convert_file(src: str, dst: str, src_kind: str, dst_kind: str, weights_only: bool,
                  dtype: str | None, verify: bool, progress) -> ConvertReport:
    """Write one file of ``dst_kind`` from ``src`` and, with ``verify``, prove it by going back."""
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
        for region in regions_of(source, weights_only):
            want = cast(getattr(source, region), dtype)[1]
            got = getattr(back, region)
            if not np.array_equal(np.asarray(want).view(np.uint8), np.asarray(got).view(np.uint8)):
                discard(dst)
                raise ConvertError(dst, f"verification failed: region {region} differs after "
                                        "reading the result back")
        if kind == "bin" and original and fingerprint.of_file(dst) != original:
            discard(dst)
            raise ConvertError(dst, "verification failed: blake3 differs from the source's")
        return "values"
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(dst))) as tmp:
        back_path = os.path.join(tmp, fmt.checkpoint_name(source.step))
        bin.write(load(dst, kind), back_path, False, None)
        got = fingerprint.of_file(back_path)
    if got != original:
        discard(dst)
        raise ConvertError(dst, f"round trip failed: converting back gives blake3 {got}, "
                                f"the source is {original}")
    return "round-trip"
