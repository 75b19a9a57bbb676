"""Diff of two checkpoints (spec §9): header fields and, per region, how and where they differ.

Both files are streamed through their maps in chunks, so memory stays bounded by a few chunks
whatever the file size. Identical chunks are skipped with one memcmp.
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import format as fmt
from .. import kinds, reader
from ..errors import GenerationNotFoundError, UnsupportedSetupError
from ..fsio import is_url
from ..run import ReadLease
from ..run.storerun import open_run
from .anyfile import open_source
from .convert.source import Source

__all__ = ["DiffResult", "RegionDiff", "diff", "diff_regions", "diff_sources", "leased", "locate", "max_ulp",
           "ordered_bits", "per_tensor"]

CHUNK = 1 << 18   # elements per comparison pass (temporaries stay in cache)


@dataclass
class RegionDiff:
    """How one region (weights, m or v) of two checkpoints differs.

    Attributes:
        n_diff: elements whose bits differ (0: the region is bit-identical).
        max_abs: the largest absolute difference (inf where a NaN or inf differs).
        max_rel: the largest difference relative to B's value.
        max_ulp: the largest distance in units in the last place (``max_ulp``).
        within_tol: every element within ``atol + rtol * |b|`` of the other.
        first_index: the flat index of the first element that differs (None: none does).
        first_param: the parameter that element belongs to, where a layout names it.
        first_param_index: its index inside that parameter.

    Examples:
        >>> import numpy as np
        >>> from ckptfmt.tools.diff import diff_regions
        >>> layout = [{"name": "a", "shape": [2], "offset": 0}, {"name": "b", "shape": [2], "offset": 2}]
        >>> region = diff_regions(np.float32([0, 1, 2, 3]), np.float32([0, 1, 2, 4]), layout=layout)
        >>> region.n_diff, region.max_abs, region.first_index, region.first_param, region.first_param_index
        (1, 1.0, 3, 'b', 1)
    """

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
        """The differences of one region as JSON-able fields."""
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out["rel_l2"] = math.sqrt(self._sq_diff / self._sq_a) if self._sq_a else (
            0.0 if self._sq_diff == 0 else math.inf)
        denom = math.sqrt(self._sq_a * self._sq_b)
        out["cosine"] = self._dot / denom if denom else (1.0 if self._sq_a == self._sq_b else 0.0)
        out["identical"] = self.n_diff == 0
        return out


@dataclass
class DiffResult:
    """A comparison of two checkpoints (``diff``): the header, each region, the companion.

    Attributes:
        a: the first checkpoint's path or URL.
        b: the second's.
        header: ``step`` and ``n_params``, each as ``[A's, B's]``.
        regions: ``weights``, ``m`` and ``v``, each a ``RegionDiff``.
        comparable: False when the two cannot be compared element by element (other
            parameter counts or layouts); ``why_not`` says why and ``regions`` is empty.
        companion: the companion tensors (buffers, state tensors) that differ or are in one only.
        kinds: the kind of each (``bin``, ``shards``, ``safetensors``, ...).
        why_not: why the two are not comparable (None when they are).
        per_tensor: parameter -> region -> how many of its elements differ, where
            ``diff_sources`` compared two sources with a layout (``per_tensor`` for two files).

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.diff import diff
        >>> w = np.arange(4, dtype=np.float32)
        >>> _ = ckptfmt.save("step_000001.bin", 1, w, w, w)
        >>> _ = ckptfmt.save("step_000002.bin", 2, w + 1, w, w)
        >>> result = diff("step_000001.bin", "step_000002.bin")
        >>> result.verdict, result.header, result.regions["weights"].n_diff, result.regions["m"].n_diff
        ('different', {'step': [1, 2], 'n_params': [4, 4]}, 4, 0)
    """

    a: str
    b: str
    header: dict[str, Any] = field(default_factory=dict)
    regions: dict[str, RegionDiff] = field(default_factory=dict)
    comparable: bool = True
    companion: list[str] = field(default_factory=list)   # companion tensors that differ (or are in one only)
    kinds: list[str] = field(default_factory=lambda: ["bin", "bin"])
    why_not: str | None = None                           # why the two are not comparable
    per_tensor: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        """Same header and every byte of every region equal."""
        return self.comparable and self.header["step"][0] == self.header["step"][1] and all(
            r.n_diff == 0 for r in self.regions.values()) and not self.companion

    @property
    def within_tolerance(self) -> bool:
        """Every region within the --atol / --rtol given."""
        return self.comparable and all(r.within_tol for r in self.regions.values()) and not self.companion

    @property
    def verdict(self) -> str:
        """'identical', 'within tolerance', 'different' or 'not comparable'."""
        if self.identical:
            return "bit-identical"
        return "equal within tolerance" if self.within_tolerance else "different"

    def to_dict(self) -> dict[str, Any]:
        """The whole comparison as JSON-able fields (``--json``)."""
        return {"a": self.a, "b": self.b, "kinds": self.kinds, "header": self.header, "comparable": self.comparable,
                "why_not": self.why_not,
                "identical": self.identical, "within_tolerance": self.within_tolerance,
                "verdict": self.verdict, "companion_differs": self.companion,
                "regions": {k: v.to_dict() for k, v in self.regions.items()}}


def ordered_bits(x: np.ndarray) -> np.ndarray:
    """Map float32 bit patterns to int32 values that order like the floats (for ULP distance):
    negative floats become INT32_MIN - bits, so -0.0 and +0.0 both map to 0.

    Examples:
        >>> import numpy as np
        >>> from ckptfmt.tools.diff import ordered_bits
        >>> ordered_bits(np.float32([-1.0, -0.0, 0.0, 1.0])).tolist()
        [-1065353216, 0, 0, 1065353216]
    """
    i = x.view(np.int32)
    return np.where(i < 0, np.int32(-2**31) - i, i)


def max_ulp(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in units in the last place between equal-index float32 values.

    Examples:
        >>> import numpy as np
        >>> from ckptfmt.tools.diff import max_ulp
        >>> one = np.float32([1.0])
        >>> max_ulp(one, np.nextafter(one, np.float32(2))), max_ulp(np.float32([-0.0]), np.float32([0.0]))
        (1, 0)
    """
    d = np.subtract(ordered_bits(a), ordered_bits(b), dtype=np.int64)
    return int(np.abs(d, out=d).max())


def _compare_chunk(out: RegionDiff, a: np.ndarray, b: np.ndarray, start: int,
                   atol: float, rtol: float) -> None:
    differs = a.view(np.uint32) != b.view(np.uint32)
    if not differs.any():          # the common case: one compare and one dot, nothing else
        sq = _finite_dot(a, a)
        out._sq_a += sq
        out._sq_b += sq
        out._dot += sq
        return
    out.n_diff += int(np.count_nonzero(differs))
    if out.first_index is None:
        out.first_index = start + int(np.argmax(differs))
    out.max_ulp = max(out.max_ulp, max_ulp(a, b))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    dots = (float(np.dot(a64, a64)), float(np.dot(b64, b64)), float(np.dot(a64, b64)))
    if not all(map(math.isfinite, dots)):
        _compare_non_finite(out, a64, b64, differs, atol, rtol)
        return
    out._sq_a, out._sq_b, out._dot = out._sq_a + dots[0], out._sq_b + dots[1], out._dot + dots[2]
    delta = np.abs(np.subtract(a64, b64, out=a64), out=a64)       # whole-chunk passes, no gathers
    scale = np.abs(b64, out=b64)
    out._sq_diff += float(np.dot(delta, delta))
    out.max_abs = max(out.max_abs, float(delta.max()))
    if (delta > (atol + rtol * scale if rtol else atol)).any():
        out.within_tol = False
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.divide(delta, scale, out=scale)       # x/0 -> inf, 0/0 -> nan (equal elements)
    out.max_rel = max(out.max_rel, float(np.fmax.reduce(rel, initial=0.0)))


def _compare_non_finite(out: RegionDiff, a64: np.ndarray, b64: np.ndarray, differs: np.ndarray,
                        atol: float, rtol: float) -> None:
    """Chunks holding NaN/inf: norms over finite pairs; a NaN or inf that differs is beyond
    every tolerance (two identical NaN bit patterns do not differ)."""
    ok = np.isfinite(a64) & np.isfinite(b64)
    out._sq_a += float(np.dot(a64[ok], a64[ok]))
    out._sq_b += float(np.dot(b64[ok], b64[ok]))
    out._dot += float(np.dot(a64[ok], b64[ok]))
    both = ok & differs
    if (differs & ~ok).any():
        out.within_tol = False
        out.max_abs = math.inf
    if both.any():
        delta = np.abs(a64[both] - b64[both])
        scale = np.abs(b64[both])
        out._sq_diff += float(np.dot(delta, delta))
        out.max_abs = max(out.max_abs, float(delta.max()))
        rel = np.divide(delta, scale, out=np.where(delta > 0, np.inf, 0.0), where=scale > 0)
        out.max_rel = max(out.max_rel, float(rel.max()))
        if (delta > atol + rtol * scale).any():
            out.within_tol = False


def _finite_dot(a: np.ndarray, b: np.ndarray) -> float:
    """Dot product for the norms (float32 BLAS, summed in float64 across chunks); a chunk
    holding NaN/inf falls back to float64 over its finite values."""
    d = float(np.dot(a, b))
    if math.isfinite(d):
        return d
    a64 = a.astype(np.float64)
    ok = np.isfinite(a64)
    return float(np.dot(a64[ok], b.astype(np.float64)[ok]))


def locate(layout: list[dict[str, Any]] | None, index: int) -> tuple[str | None, int | None]:
    """Map a flat index to (parameter name, index inside that parameter).

    Examples:
        >>> from ckptfmt.tools.diff import locate
        >>> layout = [{"name": "a", "shape": [2], "offset": 0}, {"name": "b", "shape": [2, 2], "offset": 2}]
        >>> locate(layout, 3), locate(None, 3)
        (('b', 1), (None, None))
    """
    for entry in layout or []:
        count = math.prod(entry["shape"])
        if entry["offset"] <= index < entry["offset"] + count:
            return entry["name"], index - entry["offset"]
    return None, None


def diff_regions(a: np.ndarray, b: np.ndarray, *, atol: float = 0.0, rtol: float = 0.0,
                 layout: list[dict[str, Any]] | None = None, release=None) -> RegionDiff:
    """``release(start, count)`` is called after each chunk (to drop mapped pages).

    Examples:
        >>> import numpy as np
        >>> from ckptfmt.tools.diff import diff_regions
        >>> diff_regions(np.float32([1, 2]), np.float32([1, 2.5]), atol=0.1).within_tol
        False
    """
    out = RegionDiff()
    for start in range(0, a.size, CHUNK):
        with np.errstate(all="ignore"):      # NaN/inf are data here; they are handled explicitly
            _compare_chunk(out, a[start:start + CHUNK], b[start:start + CHUNK], start, atol, rtol)
        if release is not None:
            release(start, min(CHUNK, a.size - start))
    if out.first_index is not None:
        out.first_param, out.first_param_index = locate(layout, out.first_index)
    return out


def diff(path_a: "str | os.PathLike[str]", path_b: "str | os.PathLike[str]", *,
         atol: float = 0.0, rtol: float = 0.0, progress=None) -> DiffResult:
    """Compare two checkpoints of any kinds that hold the same parameters (``ckptfmt.kinds``);
    raises ``CheckpointError`` if either cannot be read. A generation of a run is read under a
    read lease, so a live run's retention keeps it while it is compared. A Lightning checkpoint
    directory is compared as its generation (``kinds.resolve``). A URL names a generation of a
    run on object storage (``URL/step_NNNNNN.bin``), read into memory with every part verified.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.diff import diff
        >>> w = np.float32([1.0, 2.0])
        >>> _ = ckptfmt.save("step_000003.bin", 3, w, w, w)
        >>> _ = ckptfmt.save("step_000004.bin", 4, w + 1e-6, w, w)
        >>> diff("step_000003.bin", "step_000004.bin").verdict
        'different'
        >>> diff("step_000003.bin", "step_000004.bin", atol=1e-5).verdict
        'equal within tolerance'
    """
    if is_url(path_a) or is_url(path_b):
        return _diff_bins(path_a, path_b, atol, rtol, progress)
    path_a, path_b = kinds.resolve(path_a), kinds.resolve(path_b)
    with leased(path_a, path_b):
        ka, kb = (kinds.require(kinds.sniff(p), "diff", p) for p in (path_a, path_b))
        if ka.name == kb.name == "bin":
            return _diff_bins(path_a, path_b, atol, rtol, progress)
        a, b = open_source(os.fspath(path_a), ka), open_source(os.fspath(path_b), kb)
    result = diff_sources(a, b, atol=atol, rtol=rtol)
    result.kinds = [ka.name, kb.name]
    return result


@contextlib.contextmanager
def leased(*paths: "str | os.PathLike[str]"):
    """Read leases (spec/RUN.md §5.3) on the generations among ``paths`` (``step_N.bin`` names
    in a run directory), one per run, for as long as the block runs.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.run import active_leases
        >>> from ckptfmt.tools.diff import leased
        >>> os.makedirs("read-run", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("read-run", 10, z, z, z)
        >>> with leased("read-run/step_000010.bin"):
        ...     [lease["steps"] for lease in active_leases("read-run")]    # retention keeps step 10 meanwhile
        [[10]]
    """
    runs: dict[str, list[int]] = {}
    for p in paths:
        parsed = fmt.parse_name(os.path.basename(os.fspath(p)))
        if parsed is not None and not is_url(p):       # a store's: read whole at once, not leased
            runs.setdefault(os.path.dirname(os.path.abspath(p)), []).append(parsed[0])
    with contextlib.ExitStack() as stack:
        for run, steps in runs.items():
            if os.path.isdir(run):
                stack.enter_context(ReadLease(run, purpose="diff")).narrow(steps)
        yield


def diff_sources(a: Source, b: Source, *, atol: float = 0.0, rtol: float = 0.0) -> DiffResult:
    """Compare two ``Source``s region by region; B is put in A's parameter order when both
    have layouts of the same names (a foreign file and its conversion may order them apart).

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.convert import load
        >>> from ckptfmt.tools.diff import diff_sources
        >>> w = np.float32([1.0, 2.0])
        >>> _ = ckptfmt.save("step_000005.bin", 5, w, w, w)
        >>> diff_sources(load("step_000005.bin"), load("step_000005.bin")).identical
        True
    """
    result = DiffResult(a.path, b.path)
    result.header = {"step": [a.step, b.step], "n_params": [a.n_params, b.n_params]}
    why = _moments_apart(a, b)                    # before B is put in A's order: they have none
    b, why = (b, why) if why else _aligned(a, b)
    if why is not None:
        result.comparable, result.why_not = False, why
        return result
    layout = a.layout or b.layout
    named = ("weights",) if a.extra.get("moments") else fmt.REGIONS    # optimizer-order moments: no names
    for name in fmt.REGIONS:
        ra, rb = getattr(a, name), getattr(b, name)
        if ra is None or rb is None:
            continue
        result.regions[name] = diff_regions(np.ascontiguousarray(ra, fmt.DTYPE), np.ascontiguousarray(rb, fmt.DTYPE),
                                            atol=atol, rtol=rtol, layout=layout if name in named else None)
    result.per_tensor = _per_tensor_sources(a, b, layout, named)
    return result


def _aligned(a: Source, b: Source) -> tuple[Source, str | None]:
    """(B in A's parameter order, None) or (B, why the two hold different parameters)."""
    if a.n_params != b.n_params:
        return b, "n_params differ: regions are not comparable"
    if not (a.layout and b.layout):
        return b, None
    names_a, names_b = [r["name"] for r in a.layout], [r["name"] for r in b.layout]
    if names_a == names_b:
        return b, None
    if sorted(names_a) != sorted(names_b):
        first = sorted(set(names_a) ^ set(names_b))[0]
        return b, f"they hold different parameters ({first!r} is in one only)"
    rows = {r["name"]: r for r in b.layout}
    parts = {r: [getattr(b, r)[_span(rows[n])] for n in names_a] for r in fmt.REGIONS if getattr(b, r) is not None}
    regions = {r: np.concatenate(p) if p else None for r, p in parts.items()}
    return Source(b.path, b.step, regions["weights"], regions.get("m"), regions.get("v"), a.layout,
                  b.blake3, b.extra), None


def _moments_apart(a: Source, b: Source) -> str | None:
    """Why moments in an optimizer's own order (``ckptfmt.unnamed``) cannot be compared with
    ``b``'s, or None: they compare only with moments of the same order, parameter for parameter."""
    apart = [s.path for s in (a, b) if s.extra.get("moments")]
    if not apart or (len(apart) == 2 and [r["name"] for r in a.layout or []] == [r["name"] for r in b.layout or []]
                     and a.extra["moment_structure"] == b.extra["moment_structure"]):
        return None
    return (f"{apart[0]}: its optimizer's param groups do not name their parameters, so its moments compare only "
            "with another such file of the same parameters in the same order and the same groups (convert it with "
            "--groups to compare by name)")


def _span(row: dict[str, Any]) -> slice:
    return slice(row["offset"], row["offset"] + math.prod(row["shape"]))


def _per_tensor_sources(a: Source, b: Source, layout: list[dict[str, Any]] | None,
                        named: tuple[str, ...] = fmt.REGIONS) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for row in layout or []:
        for region in named:
            ra, rb = getattr(a, region), getattr(b, region)
            if ra is None or rb is None:
                continue
            x, y = ra[_span(row)].view(np.uint32), rb[_span(row)].view(np.uint32)
            n = int(np.count_nonzero(x != y))
            if n:
                out.setdefault(row["name"], {})[region] = n
    return out


def _diff_bins(path_a: "str | os.PathLike[str]", path_b: "str | os.PathLike[str]", atol: float, rtol: float,
               progress=None) -> DiffResult:
    """Two seed ``.bin`` files, streamed through their maps (``_open_bin``)."""
    a, b = _open_bin(path_a), _open_bin(path_b)
    with a, b:
        result = DiffResult(os.fspath(path_a), os.fspath(path_b))
        result.header = {"step": [a.step, b.step], "n_params": [a.n_params, b.n_params]}
        if a.n_params != b.n_params:
            result.comparable = False
            return result
        layout = a.layout or b.layout
        for name in fmt.REGIONS:
            base = fmt.region_offset(name, a.n_params)

            def release(start: int, count: int, base: int = base) -> None:
                for ck in (a, b):
                    ck.release(base + start * fmt.ITEM, count * fmt.ITEM)
                if progress is not None:
                    progress(2 * count * fmt.ITEM)
            result.regions[name] = diff_regions(getattr(a, name), getattr(b, name),
                                                atol=atol, rtol=rtol, layout=layout, release=release)
        result.companion = _companion_diff(a, b)
    return result


def _open_bin(path: "str | os.PathLike[str]") -> reader.Checkpoint:
    """A seed ``.bin``, mapped; a URL's (``URL/step_NNNNNN.bin`` of a run on object storage) read
    into memory, every part hashed against its manifest as it arrives (``Generation.open``)."""
    if not is_url(path):
        return reader.open(path, manifest="auto", check_name=False)
    base, _, name = path.rstrip("/").rpartition("/")
    parsed = fmt.parse_name(name)
    if parsed is None or parsed[1] != "bin":
        raise UnsupportedSetupError(path, "diff of a URL takes a generation's .bin (URL/step_NNNNNN.bin)")
    try:
        gen = open_run(base).generation_at(path)
    except GenerationNotFoundError:
        gen = None
    if gen is None or gen.bin is None or not gen.committed:     # as a local file that is not there: exit 2
        raise FileNotFoundError(errno.ENOENT, "no committed generation of that name at the URL", path)
    return gen.open()


def _companion_diff(a: reader.Checkpoint, b: reader.Checkpoint) -> list[str]:
    """Names of the companion tensors (buffers, loop state) that differ between two generations,
    or are in one only; exact comparison of the bytes."""
    fa, fb = a.companion(), b.companion()
    names_a = set(fa.names()) if fa else set()
    names_b = set(fb.names()) if fb else set()
    out = sorted(names_a ^ names_b)
    for name in sorted(names_a & names_b):
        ta, tb = fa.tensor(name), fb.tensor(name)
        if ta.dtype != tb.dtype or ta.shape != tb.shape or ta.tobytes() != tb.tobytes():
            out.append(name)
    return sorted(out)


def per_tensor(path_a: "str | os.PathLike[str]", path_b: "str | os.PathLike[str]") -> dict[str, dict[str, int]]:
    """Differing element counts per parameter and region (only parameters that differ).

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.diff import per_tensor
        >>> layout = [{"name": "a", "shape": [2], "offset": 0}, {"name": "b", "shape": [2], "offset": 2}]
        >>> w = np.arange(4, dtype=np.float32)
        >>> _ = ckptfmt.save("step_000006.bin", 6, w, w, w, manifest={"layout": layout})
        >>> _ = ckptfmt.save("step_000007.bin", 7, w + np.float32([0, 0, 0, 1]), w, w, manifest={"layout": layout})
        >>> per_tensor("step_000006.bin", "step_000007.bin")
        {'b': {'weights': 1}}
    """
    a, b = _open_bin(path_a), _open_bin(path_b)
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
