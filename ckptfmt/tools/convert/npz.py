"""NumPy ``.npz``: one array per region plus the metadata as JSON bytes; never unpickled."""
from __future__ import annotations

import json
import tokenize
import zipfile
import zlib

import numpy as np

from ... import atomic
from ... import format as fmt
from ...errors import ConvertError, UnsupportedFormatError
from . import source


# What reading a damaged .npz raises: zipfile for a damaged archive (bad offsets, unknown versions,
# encryption), numpy for a damaged .npy header (its tokenizer and literal parser: TokenError,
# SyntaxError), zlib for a damaged deflate stream
READ_ERRORS = (KeyError, ValueError, OSError, EOFError, NotImplementedError, RuntimeError, zlib.error,
               zipfile.BadZipFile, tokenize.TokenError, SyntaxError)


def load(path: str) -> source.Source:
    try:
        with np.load(path, allow_pickle=False) as z:
            if "meta" not in z:
                raise UnsupportedFormatError(path, "not written by ckptfmt: no 'meta' array")
            meta = json.loads(z["meta"].tobytes().decode())
            regions = {r: np.ascontiguousarray(z[r]) for r in fmt.REGIONS if r in z}  # dtypes checked by meta_source
    except READ_ERRORS as exc:
        if isinstance(exc, ConvertError):
            raise
        raise ConvertError(path, f"not a ckptfmt .npz: {exc}") from None
    return source.meta_source(path, meta, regions)


def write(src: source.Source, dst: str, weights_only: bool, dtype: str | None, progress=None) -> None:
    if dtype == "bfloat16":
        raise UnsupportedFormatError(dst, "numpy has no bfloat16: use .safetensors or .pt for bfloat16")
    arrays = {r: getattr(src, r).astype(dtype or fmt.DTYPE, copy=False) for r in source.regions_of(src, weights_only)}
    meta = source.meta(src, weights_only)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with atomic.AtomicWriter(dst) as out:
        with out.fileobj() as f:
            np.savez(f, **arrays)
        out.commit()


