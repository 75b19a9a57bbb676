"""Peer copies of RAM generations across nodes (spec/RUN.md §13.9): the pairing of ranks, what a
node's RAM tier holds, and which generation every rank can still reach after a node is lost.

torchrun numbers the ranks node by node: with L ranks per node, node k holds ranks kL..kL+L-1.
A RAM generation on more than one node is sharded like a durable one. Each rank writes its shard
into its own node's RAM tier and sends it to its **partner**, the same local rank on the next
node, ``(rank + L) mod W``, which keeps the copy in its node's tier under the shard's name
(``step_N.shards/KKKKK-of-WWWWW.bin``: keyed by shard, not by rank); rank 0 sends the companion
file too. Each node's first rank then writes the manifest into its node's tier. So every shard
lives on two nodes, and on two nodes each node's tier holds the whole generation.

After a restart the ranks may sit on other nodes (a replacement node joins the new rendezvous
and may get any ranks), so the pairing is recomputed from the ranks of each start and nothing is
looked up by rank: the first rank of each node lists what its tier holds (``inventory``: each
manifest and the blake3 of each file), every rank receives every list and computes the same
answer (``reachable``): the newest step, newer than the newest durable generation, whose manifest
some node has and whose every file some node holds intact. Each node then fetches what it lacks
from a node that holds it (``transfers``), verified by blake3 on arrival.

>>> [partner(r, 2, 6) for r in range(6)], [sender(r, 2, 6) for r in range(6)]
([2, 3, 4, 5, 0, 1], [4, 5, 0, 1, 2, 3])
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import fingerprint, shards
from .. import facts as valfacts
from .. import format as fmt
from .. import manifest as mf
from ..errors import CheckpointError, ManifestMismatchError
from ..facts import describe
from .directory import Run
from ..generation import list_dir, recorded_parts


def partner(rank: int, local: int, world: int) -> int:
    """The rank that keeps a copy of ``rank``'s shard: the same local rank on the next node."""
    return (rank + local) % world


def sender(rank: int, local: int, world: int) -> int:
    """The rank whose shard ``rank`` keeps a copy of (the one whose partner it is)."""
    return (rank - local) % world


def files_of(doc: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """Every file a sharded generation's manifest lists, relative to its run directory:
    ``{file: (size, blake3)}``; a list that does not add up is a ``ManifestError``."""
    where = fmt.stem(doc["step"]) + shards.SUFFIX
    rows = doc["shards"]
    shards.check_rows(where, rows)
    if rows[-1]["stop"] != doc["n_params"] or shards.root_digest(rows) != doc["blake3"]:
        raise ManifestMismatchError(where, "shard list does not add up to the manifest")
    if sum(r["size"] for r in rows) != doc["size"]:
        raise ManifestMismatchError(where, "shard sizes do not add up to the manifest's size")
    return {part.name: (part.size, part.blake3) for part in recorded_parts(doc, doc["step"])}


def inventory(where: "Path | None", above: int | None = None) -> dict[str, dict[str, Any]]:
    """What one node's RAM tier holds: ``{step: {"manifest": doc or None, "digests": {file:
    blake3}}}`` for each generation there newer than ``above`` (its shard files and companion,
    hashed now)."""
    if where is None or not where.is_dir():
        return {}
    out = {}
    for gen in list_dir(where).generations:
        if above is not None and gen.step <= above:
            continue
        doc = None
        if gen.manifest is not None:
            try:
                doc = mf.read(gen.manifest)
            except CheckpointError:
                doc = None                       # a damaged manifest: another node's may serve
        digests = {}
        for entry in gen.present():
            if entry != gen.bin and not entry.name.startswith("."):    # what nodes hold: shards, companion
                with contextlib.suppress(FileNotFoundError):            # one removed meanwhile: not held
                    digests[str(entry.relative_to(where))] = fingerprint.of_file(entry)
        out[str(gen.step)] = {"manifest": doc if doc is not None and shards.is_sharded(doc) else None,
                              "digests": digests}
    return out


@dataclass
class Reach:
    """The newest RAM generation every rank can reach: ``step`` and its manifest ``doc`` (None:
    none newer than the durable one), ``holders`` (file -> the nodes holding it intact) and the
    newer generations passed over with why (``skipped``: (step, reason))."""

    step: int | None = None
    doc: dict[str, Any] | None = None
    holders: dict[str, list[int]] = field(default_factory=dict)
    skipped: list[tuple[int, str]] = field(default_factory=list)


def timeline(run: Run) -> dict[str, Any]:
    """The run's current timeline as its history says it: ``since``, the step of its newest start
    (``start``, ``resume`` or ``fork`` event), and ``saved``, the root blake3 of each RAM generation
    committed since (its ``checkpoint`` event). A RAM generation newer than ``since`` that is not
    one of those is a lost timeline's: a node that was away when the run went back kept it."""
    since, saved = None, {}
    try:
        events = run.history.read().events()
    except CheckpointError:
        return {"since": None, "saved": {}}      # no history to go by: no guard
    for event in events:
        if event.get("event") in ("start", "resume", "fork"):
            since, saved = event.get("step"), {}
        elif event.get("event") == "checkpoint" and event.get("tier") and "blake3" in event:
            saved[str(event.get("step"))] = event["blake3"]
    return {"since": since, "saved": saved}


def reachable(nodes: list[dict[str, Any]], newer_than: int | None, allow_nonfinite: bool = False,
              timeline: dict[str, Any] | None = None) -> Reach:
    """The newest step above ``newer_than`` (the durable choice; at the same step the durable
    generation wins) that some node's manifest commits, that is of the run's current ``timeline``
    (when given), and whose every file some node holds intact, from every node's ``inventory``;
    the same answer on every rank."""
    out = Reach()
    for step in sorted({int(s) for inv in nodes for s in inv}, reverse=True):
        if newer_than is not None and step <= newer_than:
            break
        entries = [inv.get(str(step), {}) for inv in nodes]
        reason, holders = _reason(step, entries, allow_nonfinite, timeline or {})
        if reason is not None:
            out.skipped.append((step, reason))
            continue
        out.step, out.holders = step, holders
        out.doc = next(e["manifest"] for e in entries if e.get("manifest"))
        return out
    return out


def _reason(step: int, entries: list[dict[str, Any]], allow_nonfinite: bool,
            timeline: dict[str, Any]) -> tuple[str | None, dict[str, list[int]]]:
    """Why generation ``step`` cannot be restored from the nodes' RAM tiers (None: it can), and
    which nodes hold each of its files intact."""
    docs = [e["manifest"] for e in entries if e.get("manifest")]
    if not docs:
        return "no node holds its manifest (a save interrupted before its commit)", {}
    if any(d != docs[0] for d in docs):
        return "the nodes' manifests of it differ", {}
    since = timeline.get("since")
    if since is not None and step > since and timeline.get("saved", {}).get(str(step)) != docs[0].get("blake3"):
        return f"a lost timeline's: the run went back to step {since} and has not saved this one since", {}
    try:
        need = files_of(docs[0])
    except (CheckpointError, KeyError, TypeError) as exc:
        return f"its manifest is damaged: {getattr(exc, 'problem', exc)}", {}
    holders = {name: [i for i, e in enumerate(entries) if e.get("digests", {}).get(name) == digest]
               for name, (_, digest) in need.items()}
    lost = sorted(name for name, held in holders.items() if not held)
    if lost:
        damaged = [n for n in lost if any(n in e.get("digests", {}) for e in entries)]
        what = f"{lost[0]} fails blake3 on every node that holds it" if damaged else f"{lost[0]} is on no node"
        return what + (f" ({len(lost)} files lost)" if len(lost) > 1 else ""), holders
    bad = {} if allow_nonfinite else valfacts.diverged(docs[0])
    if bad:
        return f"diverged: {describe(bad)}", holders
    return None, holders


def transfers(reach: Reach, nodes: int) -> list[tuple[str, int, int]]:
    """``(file, from node, to node)`` for each node that lacks an intact copy of a file of the
    chosen generation, the holders taken in turn; the same list, in the same order, on every rank."""
    out = []
    for name in sorted(reach.holders):
        held = reach.holders[name]
        out += [(name, held[node % len(held)], node) for node in range(nodes) if node not in held]
    return out
