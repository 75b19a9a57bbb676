"""Value checks shared by every validation (spec §8.4, §5.9): finite values and v >= 0, by one
reduction pass per chunk or from the facts recorded at save, and the 'diverged' status."""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import facts as valfacts
from .. import format as fmt
from .. import reader
from ..shards import ShardedCheckpoint
from .report import DEFECT, Report
from .stats import region_stats

__all__ = ["INF_BITS", "SCAN", "check_shard_values", "check_values", "report_facts", "settle_diverged",
           "values_plausible"]


def settle_diverged(report: Report) -> None:
    """A file whose only defects are non-finite values is 'diverged', not 'damaged': its bytes
    are what was saved (or it has no digest), the training that produced them went wrong."""
    defects = [f.code for f in report.findings if f.level == DEFECT]
    if defects and all(code == "non_finite" for code in defects):
        report.status = "diverged"


def report_facts(report: Report, path: str, facts: dict[str, Any]) -> None:
    """Findings from value facts recorded at save, valid for bytes whose blake3 matched."""
    counts = {name: facts[name]["non_finite"] for name in fmt.REGIONS if facts[name]["non_finite"]}
    for name, count in counts.items():
        report.defect("non_finite", f"{path}: diverged: region {name} holds {count} non-finite "
                                    "values (recorded at save; the blake3 matches)")
    if counts:
        report.details["non_finite"] = counts
    if facts["v"]["negative"]:
        report.defect("negative_v", f"{path}: region v holds {facts['v']['negative']} negative values "
                                    "(Adam's second moment cannot be negative; recorded at save)")


SCAN = 1 << 22   # elements per reduction pass


INF_BITS = 0x7F800000


def values_plausible(values: "np.ndarray", non_negative: bool, scanned=None) -> bool:
    """One reduction pass per chunk, so deep validation costs little beyond the hash.

    weights, m: a float32 sum is NaN/inf whenever an element is (a sum that overflows on huge
    finite values only sends us to the exact pass). v: finite and >= +0.0 is exactly "bit
    pattern below 0x7F800000" (-0.0 goes to the exact pass, which accepts it).
    True proves the region clean; False means "count exactly". ``scanned(k)``: called with the
    number of elements done after each chunk.

    Examples:
        >>> import numpy as np
        >>> from ckptfmt.tools.values import values_plausible
        >>> values_plausible(np.float32([0.5, 2.0]), non_negative=True)      # clean: nothing to count
        True
        >>> values_plausible(np.float32([0.5, -2.0]), non_negative=True)     # a negative v: count exactly
        False
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


def check_values(report: Report, ckpt: "reader.Checkpoint | Any", done=None) -> None:
    """Findings for non-finite values and negative v in ``ckpt``'s regions (a ``Checkpoint`` or a
    convert ``Source``; a region that is None is skipped). ``done(offset)``: every byte below
    ``offset`` has been scanned (pages may go)."""
    for name in fmt.REGIONS:
        values = getattr(ckpt, name)
        if values is None:              # a weights-only file
            continue
        base = fmt.region_offset(name, ckpt.n_params)
        scanned = None if done is None else (lambda k, base=base: done(base + k * fmt.ITEM))
        if values_plausible(values, non_negative=name == "v", scanned=scanned):
            continue
        stats = region_stats(values)
        if stats.nan or stats.inf:
            report.defect("non_finite", f"{ckpt.path}: region {name} holds {stats.nan} NaN and "
                                        f"{stats.inf} inf values")
            counts = report.details.setdefault("non_finite", {})
            counts[name] = counts.get(name, 0) + stats.nan + stats.inf
        if name == "v" and stats.negative:
            report.defect("negative_v", f"{ckpt.path}: region v holds {stats.negative} negative "
                                        "values (Adam's second moment cannot be negative)")


def check_shard_values(report: Report, row: dict[str, Any], manifest, scan: bool) -> None:
    """Values of a sharded generation whose shards all hashed to their rows: from the combined
    facts of its manifest, or (none recorded, or ``scan``) by scanning every shard."""
    sub = Report(str(manifest))
    with ShardedCheckpoint(manifest) as sc:
        recorded = None if scan else valfacts.recorded(sc.manifest)
        if recorded is not None:
            report_facts(sub, str(manifest), recorded)
        else:
            for shard in sc.shards:
                check_values(sub, shard)
    report.findings.extend(sub.findings)
    if "non_finite" in sub.details:
        row["non_finite"] = sub.details["non_finite"]
    settle_diverged(sub)
    if not sub.ok:
        row["status"] = sub.status
