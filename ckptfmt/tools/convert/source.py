"""What every conversion carries (a ``Source``) and the helpers every format shares: the
metadata written into foreign files, names per tensor from the layout, dtype casts."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ... import companion
from ... import format as fmt
from ... import manifest as mf
from ...errors import ConvertError, MissingDependencyError


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
        """Parameters per region."""
        return int(self.weights.size)


def meta_source(path: str, meta: dict[str, Any], regions: dict[str, np.ndarray]) -> Source:
    if meta.get("format") != "ckptfmt":
        raise ConvertError(path, "not written by ckptfmt: metadata lacks format=ckptfmt")
    layout = meta.get("layout")
    layout = json.loads(layout) if isinstance(layout, str) else layout
    missing = [r for r in fmt.REGIONS if r not in regions]
    if missing and not meta.get("weights_only"):
        raise ConvertError(path, f"missing regions: {', '.join(missing)}")
    return Source(path, int(meta["step"]), regions["weights"], regions.get("m"), regions.get("v"),
                  layout, meta.get("blake3") or None)


def meta(src: Source, weights_only: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"format": "ckptfmt", "step": str(src.step), "n_params": str(src.n_params),
                            "blake3": src.blake3 or ""}
    if src.layout:
        meta["layout"] = json.dumps(src.layout)
    if weights_only:
        meta["weights_only"] = "1"
    return meta


def named(src: Source, region: str, arr: np.ndarray) -> Iterator[tuple[str, list[int], np.ndarray]]:
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


def regions_of(src: Source, weights_only: bool) -> list[str]:
    return ["weights"] if weights_only else list(fmt.REGIONS)


def require_torch(path: str):
    """The torch module, or a could-not-run error naming the extra to install."""
    try:
        import torch  # lazy: torch is the optional extra (the .pt and DCP conversions only)
    except ImportError:
        raise MissingDependencyError(path, ".pt needs torch: pip install 'ckptfmt[torch]'") from None
    return torch




def discard(path: str) -> None:
    """A result that failed verification must not be mistaken for a good one: remove it (and
    the manifest and companion beside a .bin)."""
    beside = (mf.path_for(path), companion.path_for(path)) if path.endswith(".bin") else ()
    for p in (Path(path), *beside):
        try:
            p.unlink()
        except OSError:
            pass


def verdict(source_check: str, round_trip: str) -> str:
    """The one word a report gives: "round-trip" or "values" only when the source matched its
    own digest *and* the result checked; "unverified-source" when only the result did.

    >>> verdict("manifest", "bytes"), verdict("unverified: a bare .bin", "bytes"), verdict("manifest", "skipped")
    ('round-trip', 'unverified-source', 'skipped')
    """
    if round_trip == "skipped":
        return "skipped"
    if source_check != "manifest":
        return "unverified-source"
    return "round-trip" if round_trip == "bytes" else "values"


@dataclass
class ConvertReport:
    src: str
    dst: str
    src_format: str
    dst_format: str
    step: int
    n_params: int
    verified: str            # 'round-trip', 'values', 'unverified-source' or 'skipped' (``verdict``)
    blake3: str | None
    src_bytes: int
    dst_bytes: int
    source_check: str = "unverified"   # 'manifest' (matched its own digest) or 'unverified: <why>'
    round_trip: str = "skipped"        # 'bytes' (converting back gives the same bytes), 'values', 'skipped'

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able fields (``--json``)."""
        return dict(self.__dict__)
