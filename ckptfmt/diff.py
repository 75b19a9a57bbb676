"""Diff of two checkpoints (spec §9): header fields and, per region, how and where they differ.

Both files are streamed through their maps in chunks, so memory stays bounded by a few chunks
whatever the file size. Identical chunks are skipped with one memcmp.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import format as fmt
from . import reader

CHUNK = 1 << 20   # elements per comparison pass


@dataclass
class RegionDiff:
    n_diff: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_ulp: int = 0
    within_tol: bool = True
    first_index: int | None = None
    first_param: str | None = None
    first_param_index: int | None = None
    _sq_diff: float = 0.0
    _sq_a: float = 0.0
    _sq_b: float = 0.0
    _dot: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out["rel_l2"] = math.sqrt(self._sq_diff / self._sq_a) if self._sq_a else (
            0.0 if self._sq_diff == 0 else math.inf)
        denom = math.sqrt(self._sq_a * self._sq_b)
        out["cosine"] = self._dot / denom if denom else (1.0 if self._sq_a == self._sq_b else 0.0)
        out["identical"] = self.n_diff == 0
        return out


@dataclass
class DiffResult:
    a: str
    b: str
    header: dict[str, Any] = field(default_factory=dict)
    regions: dict[str, RegionDiff] = field(default_factory=dict)
    comparable: bool = True

    @property
    def identical(self) -> bool:
        return self.comparable and self.header["step"][0] == self.header["step"][1] and all(
            r.n_diff == 0 for r in self.regions.values())

    @property
    def within_tolerance(self) -> bool:
        return self.comparable and all(r.within_tol for r in self.regions.values())

    @property
    def verdict(self) -> str:
        if self.identical:
            return "bit-identical"
        return "equal within tolerance" if self.within_tolerance else "different"

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "header": self.header, "comparable": self.comparable,
                "identical": self.identical, "within_tolerance": self.within_tolerance,
                "verdict": self.verdict,
                "regions": {k: v.to_dict() for k, v in self.regions.items()}}


def ordered_bits(x: np.ndarray) -> np.ndarray:
    """Map float32 bit patterns to integers that order like the floats (for ULP distance)."""
    u = x.view(np.uint32).astype(np.int64)
    return np.where(u >= 0x80000000, 0x80000000 - u, u)


def _compare_chunk(out: RegionDiff, a: np.ndarray, b: np.ndarray, start: int,
                   atol: float, rtol: float) -> None:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    out._sq_a += float(np.dot(a64, a64))
    out._sq_b += float(np.dot(b64, b64))
    out._dot += float(np.dot(a64, b64))
    if a.tobytes() == b.tobytes():
        return
    differs = a.view(np.uint32) != b.view(np.uint32)
    idx = np.flatnonzero(differs)
    out.n_diff += idx.size
    if out.first_index is None:
        out.first_index = start + int(idx[0])
    da, db = a64[idx], b64[idx]
    delta = np.abs(da - db)
    both_nan = np.isnan(da) & np.isnan(db)
    delta = np.where(both_nan, 0.0, delta)
    finite = np.isfinite(delta)
    if not finite.all():
        out.max_abs = math.inf
        out.within_tol = False
    if finite.any():
        out.max_abs = max(out.max_abs, float(delta[finite].max()))
        scale = np.abs(db[finite])
        rel = np.divide(delta[finite], scale, out=np.full(scale.shape, np.inf), where=scale > 0)
        rel = np.where(delta[finite] == 0, 0.0, rel)
        out.max_rel = max(out.max_rel, float(rel.max()))
    out.max_ulp = max(out.max_ulp, int(np.abs(ordered_bits(a[idx]) - ordered_bits(b[idx])).max()))
    diff_sq = np.where(finite, delta, 0.0)
    out._sq_diff += float(np.dot(diff_sq, diff_sq))
    if np.any(delta[finite] > atol + rtol * np.abs(db[finite])):
        out.within_tol = False


def locate(layout: list[dict[str, Any]] | None, index: int) -> tuple[str | None, int | None]:
    """Map a flat index to (parameter name, index inside that parameter)."""
    for entry in layout or []:
        count = math.prod(entry["shape"])
        if entry["offset"] <= index < entry["offset"] + count:
            return entry["name"], index - entry["offset"]
    return None, None


def diff_regions(a: np.ndarray, b: np.ndarray, *, atol: float = 0.0, rtol: float = 0.0,
                 layout: list[dict[str, Any]] | None = None) -> RegionDiff:
    out = RegionDiff()
    for start in range(0, a.size, CHUNK):
        _compare_chunk(out, a[start:start + CHUNK], b[start:start + CHUNK], start, atol, rtol)
    if out.first_index is not None:
        out.first_param, out.first_param_index = locate(layout, out.first_index)
    return out


def diff(path_a: "str | os.PathLike[str]", path_b: "str | os.PathLike[str]", *,
         atol: float = 0.0, rtol: float = 0.0) -> DiffResult:
    """Compare two checkpoint files; raises ``CheckpointError`` if either cannot be read."""
    a = reader.open(path_a, manifest="auto", check_name=False)
    b = reader.open(path_b, manifest="auto", check_name=False)
    with a, b:
        result = DiffResult(os.fspath(path_a), os.fspath(path_b))
        result.header = {"step": [a.step, b.step], "n_params": [a.n_params, b.n_params]}
        if a.n_params != b.n_params:
            result.comparable = False
            return result
        layout = a.layout or b.layout
        for name in fmt.REGIONS:
            result.regions[name] = diff_regions(getattr(a, name), getattr(b, name),
                                                atol=atol, rtol=rtol, layout=layout)
    return result


def per_tensor(path_a: "str | os.PathLike[str]", path_b: "str | os.PathLike[str]") -> dict[str, dict[str, int]]:
    """Differing element counts per parameter and region (only parameters that differ)."""
    a = reader.open(path_a, check_name=False)
    b = reader.open(path_b, check_name=False)
    out: dict[str, dict[str, int]] = {}
    with a, b:
        if a.n_params != b.n_params or not (a.layout or b.layout):
            return out
        a.manifest = a.manifest or b.manifest
        for name in a.names():
            for region in fmt.REGIONS:
                ta, tb = a.tensor(name, region), b.tensor(name, region)
                n = int(np.count_nonzero(ta.view(np.uint32) != tb.view(np.uint32)))
                if n:
                    out.setdefault(name, {})[region] = n
    return out
