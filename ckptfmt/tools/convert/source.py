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
from ...errors import ConvertError, UnsupportedFormatError


@dataclass
class Source:
    """What every format carries: step, three flat float32 regions, optional layout.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.convert import load
        >>> w = np.arange(2, dtype=np.float32)
        >>> _ = ckptfmt.save("step_000020.bin", 20, w, w, w)
        >>> source = load("step_000020.bin")
        >>> source.step, source.weights.tolist(), source.blake3 is not None
        (20, [0.0, 1.0], True)
    """
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


def meta_source(path: str, meta: Any, regions: dict[str, np.ndarray]) -> Source:
    """The ``Source`` a foreign file marked as ckptfmt's describes, every field checked first:
    metadata is untrusted input, so a bad step, layout or region is a ``ConvertError`` naming
    it, never a traceback or a silently cast value."""
    if not isinstance(meta, dict) or meta.get("format") != "ckptfmt":
        raise UnsupportedFormatError(path, "not written by ckptfmt: metadata lacks format=ckptfmt")
    weights_only = str(meta.get("weights_only", "")) in ("1", "True", "true")
    step = _meta_int(path, meta, "step", fmt.MAX_STEP)
    regions = _checked_regions(path, regions, weights_only)
    n = int(regions["weights"].size)
    if meta.get("n_params") not in (None, "") and _meta_int(path, meta, "n_params", fmt.MAX_N) != n:
        raise ConvertError(path, f"metadata says n_params {meta['n_params']}, the regions hold {n}",
                           expected=meta["n_params"], got=n)
    digest = meta.get("blake3") or None
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64
                                   and all(c in "0123456789abcdef" for c in digest)):
        raise ConvertError(path, f"metadata field 'blake3' is not a 64-digit hex digest: {digest!r}")
    return Source(path, step, regions["weights"], regions.get("m"), regions.get("v"),
                  _meta_layout(path, meta.get("layout"), n), digest)


def _meta_int(path: str, meta: dict[str, Any], key: str, high: int) -> int:
    """An integer metadata field (a decimal string in safetensors, a number elsewhere) in 0..high."""
    value = meta.get(key)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        number: Any = int(value)
    else:
        number = value if isinstance(value, int) and not isinstance(value, bool) else None
    if number is None or not 0 <= number <= high:
        raise ConvertError(path, f"metadata field '{key}': expected an integer in 0..{high}, got {value!r}")
    return number


def _checked_regions(path: str, regions: dict[str, np.ndarray], weights_only: bool) -> dict[str, np.ndarray]:
    """Flat little-endian float32 regions of one length (float16/bfloat16 weights are allowed in
    a weights-only file); anything else is refused by name rather than cast."""
    missing = [r for r in fmt.REGIONS if r not in regions]
    if "weights" not in regions or (missing and not weights_only):
        raise ConvertError(path, f"missing regions: {', '.join(missing)}")
    out = {}
    for name, arr in regions.items():
        arr = np.asarray(arr)
        half = weights_only and name == "weights" and arr.dtype.str in ("<f2", "<u2")
        if not half and not (arr.dtype.kind == "f" and arr.dtype.itemsize == fmt.ITEM):
            raise ConvertError(path, f"region {name}: expected float32, got {arr.dtype}")
        out[name] = arr.reshape(-1) if half else arr.reshape(-1).astype(fmt.DTYPE, copy=False)
    sizes = {name: int(a.size) for name, a in out.items()}
    if len(set(sizes.values())) != 1:
        raise ConvertError(path, f"regions differ in length: {sizes}")
    return out


def _meta_layout(path: str, layout: Any, n: int) -> list[dict[str, Any]] | None:
    """The layout (JSON text or a list), checked to tile 0..n like a manifest's (spec §4.2)."""
    if layout in (None, ""):
        return None
    if isinstance(layout, str):
        try:
            layout = json.loads(layout)
        except ValueError as exc:
            raise ConvertError(path, f"metadata field 'layout' is not JSON: {exc}") from None
    mf.check_layout(path, layout, n)
    return layout


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
    """(safetensors dtype code, array) for float32, float16 or bfloat16 (round to nearest even).

    Examples:
        >>> import numpy as np
        >>> from ckptfmt.tools.convert import cast
        >>> cast(np.float32([1.5]), "bfloat16")
        ('BF16', array([16320], dtype=uint16))
    """
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
    raise UnsupportedFormatError(None, f"unsupported dtype {dtype}: use float32, float16 or bfloat16")


def regions_of(src: Source, weights_only: bool) -> list[str]:
    return ["weights"] if weights_only else list(fmt.REGIONS)


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
    """What a conversion did and how it was proven (``convert``).

    Attributes:
        src: the source's path.
        dst: the destination written.
        src_format: the source's kind (``bin``, ``pt``, ``safetensors``, ``shards``, ...).
        dst_format: the destination's.
        step: the checkpoint's step.
        n_params: its parameter count.
        verified: the one word: ``round-trip`` or ``values`` (the source matched its own
            digest and the result converted back to the same bytes, or the same values),
            ``unverified-source`` (only the result checked) or ``skipped`` (no check asked).
        blake3: the source's digest, as its manifest or metadata records it (None: it records none).
        src_bytes: the source's size.
        dst_bytes: the destination's size.
        source_check: ``manifest`` (the source matched its own digest) or ``unverified: WHY``.
        round_trip: ``bytes`` (converting back gives the same bytes), ``values`` or ``skipped``.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.convert import convert
        >>> z = np.zeros(4, np.float32)
        >>> _ = ckptfmt.save("step_000010.bin", 10, z, z, z)
        >>> report = convert("step_000010.bin", "ten.safetensors")
        >>> report.src_format, report.dst_format, report.source_check, report.round_trip, report.verified
        ('bin', 'safetensors', 'manifest', 'bytes', 'round-trip')
    """

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
