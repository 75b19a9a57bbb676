"""Streaming statistics over float32 regions, chunk by chunk so memory stays bounded."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["RegionStats", "region_stats"]

CHUNK = 1 << 22   # elements per pass (16 MiB of float32)


@dataclass
class RegionStats:
    """Running statistics of one region, folded in chunk by chunk (``add``); ``to_dict`` adds
    the mean and standard deviation of the finite values.

    Attributes:
        count: elements seen.
        nan: how many are NaN.
        inf: how many are +inf or -inf.
        zeros: finite elements equal to zero.
        negative: finite elements below zero.
        min: the smallest finite value (None: no finite value yet).
        max: the largest finite value.
        max_abs: the largest magnitude of a finite value.

    Examples:
        >>> import numpy as np
        >>> from ckptfmt.tools.stats import region_stats
        >>> stats = region_stats(np.float32([1, -2, 0, np.nan]))
        >>> stats.count, stats.nan, stats.zeros, stats.negative, stats.min, stats.max, stats.finite
        (4, 1, 1, 1, -2.0, 1.0, 3)
    """

    count: int = 0
    nan: int = 0
    inf: int = 0
    zeros: int = 0
    negative: int = 0
    min: float | None = None
    max: float | None = None
    max_abs: float | None = None
    _sum: float = 0.0
    _sumsq: float = 0.0

    def add(self, chunk: np.ndarray) -> None:
        """Fold one chunk of values into the running statistics."""
        self.count += chunk.size
        finite_mask = np.isfinite(chunk)
        n_finite = int(np.count_nonzero(finite_mask))
        if n_finite != chunk.size:
            self.nan += int(np.count_nonzero(np.isnan(chunk)))
            self.inf += chunk.size - n_finite - int(np.count_nonzero(np.isnan(chunk)))
            chunk = chunk[finite_mask]
        if chunk.size == 0:
            return
        self.zeros += int(chunk.size - np.count_nonzero(chunk))
        self.negative += int(np.count_nonzero(chunk < 0))
        lo, hi = float(chunk.min()), float(chunk.max())
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)
        self.max_abs = max(abs(self.min), abs(self.max))
        c64 = chunk.astype(np.float64)
        self._sum += float(c64.sum())
        self._sumsq += float(np.dot(c64, c64))

    @property
    def finite(self) -> int:
        """Values that are neither NaN nor inf."""
        return self.count - self.nan - self.inf

    def to_dict(self) -> dict:
        """The statistics as JSON-able fields."""
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        n = self.finite
        out["mean"] = self._sum / n if n else None
        out["std"] = math.sqrt(max(self._sumsq / n - (self._sum / n) ** 2, 0.0)) if n else None
        return out


def region_stats(values: np.ndarray, chunk: int = CHUNK) -> RegionStats:
    """Count, NaN, inf, zeros, negatives, min, max, mean of a region, in cache-sized chunks.

    Examples:
        >>> import numpy as np
        >>> from ckptfmt.tools.stats import region_stats
        >>> region_stats(np.float32([3, 4])).to_dict()["mean"]
        3.5
    """
    stats = RegionStats()
    for start in range(0, values.size, chunk):
        stats.add(values[start:start + chunk])
    return stats
