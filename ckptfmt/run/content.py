"""Whether two committed generations hold the same content, whatever their shapes (spec/RUN.md §6.4).

A generation's content is its step, weights, m and v, and its companion file (buffers, state
tensors). The digest its manifest records depends on its shape: a ``.bin``'s is the blake3 of the
file (header, then weights, m, v), a sharded generation's a root over its shards' digests in rank
order, so one generation written both ways records two digests. Two generations of one shape
(both a ``.bin``, or both shards over the same ranges) are compared by their recorded digests,
reading nothing; two of different shapes by the digest of the ``.bin`` each would be: a ``.bin``'s
recorded one, a sharded generation's computed from its shards (``shards.bin_digest``, read once
and checked against their rows). The manifest's other fields (config, code, RNG and bandit state,
scheduler, metrics, provenance, times) are not content: a fork or a conversion changes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import companion, shards
from ..errors import CheckpointError
from ..generation import Generation
from .directory import Run


@dataclass
class Recorded:
    """What a committed generation's manifest records of its content: the digest of its
    payload, the companion's (None without one), n_params, and the shard ranges (None: a ``.bin``)."""
    gen: Generation
    blake3: str
    companion: str | None
    n_params: int
    ranges: tuple[tuple[int, int], ...] | None
    _bin_digest: str | None = field(default=None, repr=False)

    @classmethod
    def of(cls, gen: Generation) -> "Recorded":
        """Read from the generation's manifest (``CheckpointError`` when it cannot be read)."""
        doc: dict[str, Any] = gen.read_manifest()
        ranges = tuple((r["start"], r["stop"]) for r in doc["shards"]) if shards.is_sharded(doc) else None
        return cls(gen, doc["blake3"], (doc.get(companion.FIELD) or {}).get("blake3"),
                   doc["n_params"], ranges)

    def bin_digest(self) -> str:
        """The blake3 of the ``.bin`` holding this content: the recorded one for a ``.bin``,
        computed from the shards (once) for a sharded generation (one on a store: read into
        memory, every shard hashed against its row as it arrives)."""
        if self.ranges is None:
            return self.blake3
        if self._bin_digest is None:
            self._bin_digest = shards.bin_digest(self.gen.manifest if self.gen.local else self.gen.open())
        return self._bin_digest


def committed(run: Run) -> dict[int, Recorded]:
    """step -> what the run's committed generation records; one whose manifest cannot be read
    is left out."""
    out = {}
    for gen in run.generations():
        if gen.committed:
            try:
                out[gen.step] = Recorded.of(gen)
            except CheckpointError:
                continue
    return out


def same(a: Recorded, b: Recorded) -> bool:
    """Whether the two hold the same content (step, weights, m, v, companion). Generations of
    different shapes are read; a shard that does not match its row raises ``CheckpointError``."""
    if a.companion != b.companion or a.n_params != b.n_params:
        return False
    if a.ranges == b.ranges:                 # one shape: the recorded digests are comparable
        return a.blake3 == b.blake3
    return a.bin_digest() == b.bin_digest()
