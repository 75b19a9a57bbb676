"""Value facts (spec/FORMAT.md §5.9): what the values of each region are, recorded at save time
in the same pass that hashes the bytes, so a later check of the hash is also a check of them.

Per region: ``finite`` (every value is finite) and ``non_finite`` (how many are NaN or +-inf);
for ``v`` also ``non_negative`` and ``negative`` (finite values below zero; -0.0 is zero). The
manifest stays strict JSON: only booleans and counts are recorded, never a value, so a NaN can
never reach it. A generation whose facts count a non-finite value is *diverged*.

>>> import numpy as np
>>> facts = ValueFacts()
>>> facts.add("weights", np.array([1.0, np.nan], dtype="<f4"))
>>> facts.add("m", np.zeros(2, dtype="<f4"))
>>> facts.add("v", np.array([0.5, -0.0], dtype="<f4"))
>>> doc = facts.to_dict()
>>> doc["weights"], doc["v"]
({'finite': False, 'non_finite': 1}, {'finite': True, 'non_finite': 0, 'non_negative': True, 'negative': 0})
>>> diverged({"facts": doc})
{'weights': 1}
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from . import format as fmt

FIELD = "facts"            # the manifest field (spec §4.1)
PASS = 1 << 22            # elements folded in at a time (16 MiB of float32): bounded temporaries
INF_BITS = 0x7F800000      # a float32 bit pattern below this is +0.0, positive and finite


class ValueFacts:
    """Facts folded chunk by chunk; ``add`` is called in file order on the hashing thread."""

    def __init__(self) -> None:
        self.counts = {name: {"non_finite": 0, "negative": 0} for name in fmt.REGIONS}

    def add(self, region: str, values: np.ndarray) -> None:
        """Fold one chunk of ``region``'s float32 values in.

        One reduction proves a chunk clean, which is the common case: weights and m, a float32
        sum is finite only if every value is (a sum that overflows on huge finite values just
        sends the chunk to the exact count); v, every bit pattern below 0x7F800000 is exactly
        "finite and >= +0.0". Only a chunk that fails it is counted value by value.
        """
        if values.size == 0:
            return
        with np.errstate(over="ignore", invalid="ignore"):
            if region == "v":
                if int(np.maximum.reduce(values.view(np.uint32))) < INF_BITS:
                    return
            elif np.isfinite(np.einsum("i->", values)):   # a plain float32 sum: 2.7x faster
                return                                      # than add.reduce's pairwise one
        finite = np.isfinite(values)
        counts = self.counts[region]
        counts["non_finite"] += values.size - int(np.count_nonzero(finite))
        if region == "v":
            counts["negative"] += int(np.count_nonzero(values[finite] < 0))

    def add_bytes(self, region: str, chunk: memoryview) -> None:
        """``add`` over a writer's byte chunk (a whole number of float32, no copy)."""
        self.add(region, np.frombuffer(chunk, dtype=fmt.DTYPE))

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``facts``: booleans and counts only (strict JSON)."""
        out = {}
        for name, counts in self.counts.items():
            row = {"finite": counts["non_finite"] == 0, "non_finite": counts["non_finite"]}
            if name == "v":
                row.update(non_negative=counts["negative"] == 0, negative=counts["negative"])
            out[name] = row
        return out


def of_regions(regions: Iterable[tuple[str, np.ndarray]]) -> dict[str, Any]:
    """Facts of whole regions already in memory or mapped: ``[(name, values), ...]``."""
    facts = ValueFacts()
    for name, values in regions:
        for start in range(0, values.size, PASS):
            facts.add(name, values[start:start + PASS])
    return facts.to_dict()


def combine(parts: "list[dict[str, Any] | None]") -> dict[str, Any] | None:
    """The facts of a sharded generation from its shards' (counts add up); None when any
    shard has none (then nothing is known about the whole)."""
    if not parts or any(not valid(p) for p in parts):
        return None
    facts = ValueFacts()
    for part in parts:
        for name in fmt.REGIONS:
            facts.counts[name]["non_finite"] += part[name]["non_finite"]
            facts.counts[name]["negative"] += part[name].get("negative", 0)
    return facts.to_dict()


def valid(facts: Any) -> bool:
    """True when ``facts`` is a well-formed ``facts`` object (a reader trusts nothing else):
    counts are non-negative integers and every boolean agrees with its count."""
    if not isinstance(facts, dict):
        return False
    for name in fmt.REGIONS:
        row = facts.get(name)
        if not isinstance(row, dict) or not _count(row.get("non_finite")) \
                or row.get("finite") is not (row["non_finite"] == 0):
            return False
        if name == "v" and (not _count(row.get("negative"))
                            or row.get("non_negative") is not (row["negative"] == 0)):
            return False
    return True


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def recorded(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """The well-formed facts of a manifest, None when it has none (or they are malformed)."""
    facts = (doc or {}).get(FIELD)
    return facts if valid(facts) else None


def diverged(doc: dict[str, Any] | None) -> dict[str, int]:
    """{region: non-finite count} of every region the manifest's facts say holds a NaN or an
    infinity; empty when the generation is finite or nothing was recorded."""
    facts = recorded(doc)
    if facts is None:
        return {}
    return {name: facts[name]["non_finite"] for name in fmt.REGIONS if facts[name]["non_finite"]}


def describe(regions: dict[str, int]) -> str:
    """'m: 3, v: 1 non-finite values' for messages."""
    return ", ".join(f"{name}: {count}" for name, count in regions.items()) + " non-finite values"
