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

A framework's directory of checkpoints is compared as far as its checkpoints are generations: a
Lightning ModelCheckpoint directory by the generation in each checkpoint directory, a Trainer's
output directory not at all (``of_run``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import companion, hfdirs, kinds, shards
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


HF_OUTPUT = ("a Hugging Face Trainer's output directory: its checkpoint-N hold the Trainer's own files "
             "(weights, a torch.save of the optimizer and of the RNG states), not generations whose content "
             "ckptfmt compares")


def of_run(run: Run) -> tuple[dict[int, Recorded], str | None]:
    """What ``bisect`` compares of a run's generations: step -> committed generation, and why
    none is compared (None: they are). A Lightning ModelCheckpoint directory (spec/RUN.md §11.1)
    holds a generation in each checkpoint directory: those, one per step (``last*``, a copy or a
    link of a step another name holds, the other name's); a Trainer's output directory
    (§12) none comparable (``HF_OUTPUT``), so the histories alone say where two runs part."""
    if run.path is None:                       # a run on a store: its own generations
        return committed(run), None
    if hfdirs.is_output(str(run.path)):
        return {}, HF_OUTPUT
    try:
        lightning = kinds.sniff(run.path).name == "lightning-dir"
    except (CheckpointError, OSError):
        lightning = False
    if not lightning:
        return committed(run), None
    out: dict[int, Recorded] = {}
    for entry in sorted(run.path.iterdir(), key=lambda e: (e.name.startswith("last"), e.name)):
        if not entry.name.startswith(".") and kinds.generation_in(entry) is not None:
            for step, found in committed(Run(entry)).items():
                out.setdefault(step, found)
    return out, None


def same(a: Recorded, b: Recorded) -> bool:
    """Whether the two hold the same content (step, weights, m, v, companion). Generations of
    different shapes are read; a shard that does not match its row raises ``CheckpointError``."""
    if a.companion != b.companion or a.n_params != b.n_params:
        return False
    if a.ranges == b.ranges:                 # one shape: the recorded digests are comparable
        return a.blake3 == b.blake3
    return a.bin_digest() == b.bin_digest()
