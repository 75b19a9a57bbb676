"""Validation (spec §8.3): every check the library has, returned as data, never printed.

Deep mode hashes the file on a second thread while this thread scans the values, so a full
validation costs about one pass over the bytes. A bare file is valid but 'unverified'.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import format as fmt
from . import manifest as mf
from . import reader
from .errors import CheckpointError
from .stats import region_stats

DEFECT, WARNING = "defect", "warning"


@dataclass
class Finding:
    level: str       # 'defect' (exit 1) or 'warning' (reported, still valid)
    code: str        # stable machine name, e.g. 'truncated', 'fingerprint_mismatch'
    message: str     # one line naming the file and the problem


@dataclass
class Report:
    path: str
    kind: str = "file"
    status: str = "unverified"   # verified | unverified | committed | damaged
    step: int | None = None
    n_params: int | None = None
    findings: list[Finding] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(f.level == DEFECT for f in self.findings)

    def defect(self, code: str, message: str) -> None:
        self.findings.append(Finding(DEFECT, code, message))
        self.status = "damaged"

    def warn(self, code: str, message: str) -> None:
        self.findings.append(Finding(WARNING, code, message))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def error_code(exc: CheckpointError) -> str:
    """'TruncatedError' -> 'truncated' (stable codes for --json consumers)."""
    name = type(exc).__name__.removesuffix("Error")
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def validate_file(path: "str | os.PathLike[str]", *, deep: bool = True, progress=None) -> Report:
    path = os.fspath(path)
    report = Report(path)
    try:
        ckpt = reader.open(path, manifest="ignore")
    except CheckpointError as exc:
        report.defect(error_code(exc), str(exc))
        return report
    with ckpt:
        report.step, report.n_params = ckpt.step, ckpt.n_params
        doc = _check_manifest(report, ckpt)
        if report.ok:
            _check_contents(report, ckpt, doc, deep, progress)
    return report


def _check_manifest(report: Report, ckpt: reader.Checkpoint) -> dict[str, Any] | None:
    mpath = str(mf.path_for(ckpt.path))
    parsed = fmt.parse_name(os.path.basename(ckpt.path))
    if parsed is not None and parsed[0] != ckpt.step:
        report.defect("bad_name", f"{ckpt.path}: name says step {parsed[0]}, header says {ckpt.step}")
    if not os.path.exists(mpath):
        report.warn("unverified", f"{ckpt.path}: no manifest, contents cannot be verified")
        return None
    try:
        doc = mf.read(mpath)
        mf.check_matches(mpath, doc, ckpt.path, size=ckpt.size, step=ckpt.step, n_params=ckpt.n_params)
    except CheckpointError as exc:
        report.defect(error_code(exc), str(exc))
        return None
    except OSError as exc:
        report.defect("manifest_unreadable", f"{mpath}: {exc.strerror or exc}")
        return None
    report.status = "committed"
    return doc


def _check_contents(report: Report, ckpt: reader.Checkpoint, doc: dict | None, deep: bool,
                    progress=None) -> None:
    if not deep:
        return
    behind = reader.ReleaseBehind(ckpt)      # pages go once the scan and the hash have passed
    scan = behind.lane()
    hashing = behind.lane() if doc is not None else None
    with ThreadPoolExecutor(1, "ckptfmt-validate") as pool:
        digest = pool.submit(ckpt.fingerprint, progress, behind, hashing) if doc is not None else None
        try:
            _check_values(report, ckpt, lambda offset: behind.advance(scan, offset))
        finally:
            behind.advance(scan, ckpt.size)     # never leave the hashing thread waiting
        if digest is not None:
            got = digest.result()
            report.details["blake3"] = got
            if got != doc["blake3"]:
                report.defect("fingerprint_mismatch", f"{ckpt.path}: blake3 mismatch: manifest says "
                                                      f"{doc['blake3']}, file hashes to {got}")
            elif report.ok:
                report.status = "verified"


SCAN = 1 << 22   # elements per reduction pass


INF_BITS = 0x7F800000


def values_plausible(values: "np.ndarray", non_negative: bool, scanned=None) -> bool:
    """One reduction pass per chunk, so deep validation costs little beyond the hash.

    weights, m: a float32 sum is NaN/inf whenever an element is (a sum that overflows on huge
    finite values only sends us to the exact pass). v: finite and >= +0.0 is exactly "bit
    pattern below 0x7F800000" (-0.0 goes to the exact pass, which accepts it).
    True proves the region clean; False means "count exactly". ``scanned(k)``: called with the
    number of elements done after each chunk.
    """
    bits = values.view(np.uint32)
    with np.errstate(over="ignore", invalid="ignore"):     # inf - inf is the signal, not an error
        for start in range(0, values.size, SCAN):
            if non_negative:
                if np.maximum.reduce(bits[start:start + SCAN], initial=0) >= INF_BITS:
                    return False
            elif not np.isfinite(np.add.reduce(values[start:start + SCAN])):
                return False
            if scanned is not None:
                scanned(min(start + SCAN, values.size))
    return True


def _check_values(report: Report, ckpt: reader.Checkpoint, done=None) -> None:
    """``done(offset)``: every byte below ``offset`` has been scanned (pages may go)."""
    for name in fmt.REGIONS:
        values = getattr(ckpt, name)
        base = fmt.region_offset(name, ckpt.n_params)
        scanned = None if done is None else (lambda k, base=base: done(base + k * fmt.ITEM))
        if values_plausible(values, non_negative=name == "v", scanned=scanned):
            continue
        stats = region_stats(values)
        if stats.nan or stats.inf:
            report.defect("non_finite", f"{ckpt.path}: region {name} holds {stats.nan} NaN and "
                                        f"{stats.inf} inf values")
        if name == "v" and stats.negative:
            report.defect("negative_v", f"{ckpt.path}: region v holds {stats.negative} negative "
                                        "values (Adam's second moment cannot be negative)")


def validate_path(path: "str | os.PathLike[str]", *, deep: bool = True, progress=None) -> Report:
    """A file or a run directory (the run check lives in ``ckptfmt.runops``)."""
    if os.path.isdir(path):
        from .runops import validate_run
        return validate_run(path, deep=deep, progress=progress)
    return validate_file(path, deep=deep, progress=progress)
