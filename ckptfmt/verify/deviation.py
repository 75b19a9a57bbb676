"""How far a resumed run's values are from the continuous run's (seed 001's comparison).

Two JSON trees are walked together: numbers compared by ``|a - b| <= atol + rtol |b|``, anything
else equal; a difference in structure (keys, lengths, types) or a non-finite value fails a check
whatever its deviation, since a run that writes an unusable output has not resumed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Deviation:
    """How far a resumed run's values are from the continuous run's, and what differs in kind.

    Examples:
        >>> from ckptfmt.verify import Deviation, compare
        >>> dev = Deviation()
        >>> _ = compare({"loss": [1.0, 2.0], "phase": "warmup"}, {"loss": [1.0, 2.5], "phase": "decay"}, "final", dev, 0.0, 0.0)
        >>> dev.max_abs, dev.structural, dev.non_finite
        (0.5, ["final.phase: 'warmup' != 'decay'"], [])
    """
    max_abs: float = 0.0
    structural: list[str] = field(default_factory=list)
    non_finite: list[str] = field(default_factory=list)

    def ok(self, atol: float, rtol_hit: bool) -> bool:
        """Within tolerance and nothing differs in structure or finiteness."""
        return not self.structural and not self.non_finite and not rtol_hit and self.max_abs <= atol


def compare(a: Any, b: Any, path: str, dev: Deviation, atol: float, rtol: float) -> bool:
    """Walk two JSON trees; numbers by |a-b| <= atol + rtol|b|; anything else must be equal.
    Returns True when some element exceeds the tolerance.

    Examples:
        >>> from ckptfmt.verify import Deviation, compare
        >>> dev = Deviation()
        >>> compare([1.0, 2.0], [1.0, 2.5], "losses", dev, atol=0.0, rtol=0.0)     # 2.0 vs 2.5 is beyond it
        True
        >>> compare([1.0, 2.0], [1.0, 2.5], "losses", Deviation(), atol=0.0, rtol=0.5)
        False
    """
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or a is None:
        if a != b:
            dev.structural.append(f"{path}: {a!r} != {b!r}")
        return False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if not (math.isfinite(a) and math.isfinite(b)):
            dev.non_finite.append(path)
            return True
        d = abs(a - b)
        dev.max_abs = max(dev.max_abs, d)
        return d > atol + rtol * abs(b)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            dev.structural.append(f"{path}: length {len(a)} != {len(b)}")
            return False
        return any([compare(x, y, f"{path}[{i}]", dev, atol, rtol) for i, (x, y) in enumerate(zip(a, b))])
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            dev.structural.append(f"{path}: keys differ: {sorted(set(a) ^ set(b))}")
        return any([compare(a[k], b[k], f"{path}.{k}", dev, atol, rtol) for k in sorted(set(a) & set(b))])
    dev.structural.append(f"{path}: {type(a).__name__} vs {type(b).__name__}")
    return False
