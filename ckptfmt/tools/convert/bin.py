"""The seed ``.bin`` (with its manifest) as a conversion source and target."""
from __future__ import annotations

import os

from ... import reader, writer
from ...errors import ConvertError, UnsupportedFormatError
from .source import Source


def load(path: str) -> Source:
    ck = reader.open(path, check_name=False)
    doc = ck.manifest or {}
    return Source(path, ck.step, ck.weights, ck.m, ck.v, ck.layout, doc.get("blake3"))


def write(src: Source, dst: str, weights_only: bool, dtype: str | None, progress=None) -> None:
    if weights_only or dtype:
        raise UnsupportedFormatError(dst, "the .bin layout holds float32 weights, m and v; --weights-only "
                                "and --dtype apply to the other formats")
    if src.m is None or src.v is None:
        raise UnsupportedFormatError(src.path, "weights-only file: cannot rebuild m and v for a .bin")
    extra = {"layout": src.layout} if src.layout else {}
    extra["converted_from"] = os.path.basename(src.path)
    writer.save(dst, src.step, src.weights, src.m, src.v, manifest=extra)


