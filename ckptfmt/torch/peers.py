"""The RAM tier under torchrun (spec/RUN.md §13.2): a sharded RAM generation whose shards are
also copied to a partner rank on the next node, and the restore that fetches what a node lacks
from its peers (the pairing and the choice: ``ckptfmt.run.replicas``).

Every step of a save and of a fetch ends in an agreement of all ranks, so a rank whose tier is
full (ENOSPC) or whose copy arrives damaged makes every rank skip that RAM save together: no
rank is ever left waiting alone in a collective. Files travel in 64 MiB pieces through the
process group (gloo: TCP; NCCL: the GPUs), hashed on arrival and renamed into place only when
their blake3 is the one the sender's row (or the manifest) names.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .. import atomic, companion, fingerprint, shards
from .. import format as fmt
from .. import manifest as mf
from ..errors import CheckpointError, FingerprintMismatchError, NoValidGenerationError, SaveError, UnsupportedSetupError
from ..run import Run, replicas, tiers
from .distributed import any_rank, collective_device, decided_by_rank0, gather_json, own_shard, rank_world

CHUNK = 64 << 20


@dataclass(frozen=True)
class Topology:
    """This start's ranks by node: ``local`` ranks per node, numbered node by node."""

    rank: int
    world: int
    local: int
    local_rank: int

    @property
    def nodes(self) -> int:
        return self.world // self.local

    @property
    def leader(self) -> bool:
        """The node's first rank: it writes the node's manifests, lists and prunes its tier."""
        return self.local_rank == 0


def topology() -> Topology:
    """The ranks by node from torchrun's ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK`` (one process:
    one node); nodes of different sizes are refused (the pairing needs equal nodes)."""
    rank, world = rank_world()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if world > 1 else 1
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if world > 1 else 0
    if local < 1 or world % local or rank % local != local_rank:
        raise UnsupportedSetupError(None, f"the RAM tier needs nodes of equal size numbered node by node; "
                                          f"rank {rank} of {world} is local rank {local_rank} of {local}")
    return Topology(rank, world, local, local_rank)


# ------------------------------------------------------------------------------ save
def save(where: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         manifest: dict[str, Any], extra: dict[str, Any] | None) -> None:
    """Collective: commit RAM generation ``step`` into each node's tier ``where`` (this node's
    path): every rank's shard, its partner's copy, rank 0's companion, the manifest by each
    node's first rank. A failure on any rank is a ``SaveError`` on every rank."""
    topo = topology()
    row = _agreed(lambda: _own(where, step, model, optimizer, extra), "could not write its shard")
    rows = gather_json(row)
    if topo.nodes > 1:
        _agreed(lambda: _exchange(where, step, rows, topo), "could not copy a shard to its partner")
    doc = _agreed(lambda: _manifest(where, step, rows, manifest) if topo.rank == 0 else None,
                  "could not build the manifest")     # rank 0's (its RNGs, its loop state), for every node
    if topo.nodes > 1:
        doc = gather_json(doc)[0]
    path = where / fmt.manifest_name(step)
    _agreed(lambda: mf.write(path, doc) if topo.leader else None, "could not commit")


def _own(where: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any] | None) -> dict[str, Any]:
    row = own_shard(where, step, model, optimizer)
    if rank_world()[0] == 0 and extra:           # rank 0's companion (buffers, state tensors)
        row[companion.FIELD] = companion.write(shards.shards_dir(where, step), step, extra)
    return row


def _manifest(where: Path, step: int, rows: list[dict[str, Any]], manifest: dict[str, Any]) -> dict[str, Any]:
    if companion.FIELD in rows[0]:
        manifest = {**manifest, companion.FIELD: rows[0][companion.FIELD]}
    return shards.manifest_for(where, step, [{k: v for k, v in r.items() if k != companion.FIELD} for r in rows],
                               manifest)


def _agreed(action: Any, what: str) -> Any:
    """``action()`` on every rank; if it failed on any, a ``SaveError`` on every rank (this
    rank's own error when it was one of them)."""
    error: BaseException | None = None
    try:
        result = action()
    except (CheckpointError, OSError) as exc:
        error, result = exc, None
    if any_rank(error is not None)[0]:
        if error is not None:
            raise error if isinstance(error, CheckpointError) else SaveError(None, f"{what}: {error}")
        raise SaveError(None, f"another rank {what}")
    return result


def _exchange(where: Path, step: int, rows: list[dict[str, Any]], topo: Topology) -> None:
    """Send this rank's files to its partner while receiving its sender's (both at once, so a
    ring of any length cannot wait on itself); each received file verified, then renamed in."""
    to = replicas.partner(topo.rank, topo.local, topo.world)
    frm = replicas.sender(topo.rank, topo.local, topo.world)
    outgoing, incoming = _files(where, step, rows[topo.rank]), _files(where, step, rows[frm])
    for i in range(max(len(outgoing), len(incoming))):
        send = outgoing[i] if i < len(outgoing) else None
        recv = incoming[i] if i < len(incoming) else None
        _swap(send, to, recv, frm)


def _files(where: Path, step: int, row: dict[str, Any]) -> list[tuple[Path, int, str]]:
    """(path, size, blake3) of what a rank's row says it wrote: its shard, rank 0's companion."""
    out = [(shards.shards_dir(where, step) / row["file"], row["size"], row["blake3"])]
    entry = row.get(companion.FIELD)
    if entry:
        out.append((where / entry["file"], entry["size"], entry["blake3"]))
    return out


def _swap(send: tuple[Path, int, str] | None, to: int, recv: tuple[Path, int, str] | None, frm: int) -> None:
    if recv is None:
        for piece in _pieces(send[0]):
            dist.send(piece, to)
        return
    sending = _pieces(send[0]) if send is not None else iter(())

    def arriving() -> Iterator[torch.Tensor]:
        for size in _sizes(recv[1]):
            buf = torch.empty(size, dtype=torch.uint8, device=collective_device())
            waits = [dist.irecv(buf, frm)]
            out = next(sending, None)
            if out is not None:
                waits.append(dist.isend(out, to))
            for w in waits:
                w.wait()
            yield buf
        for rest in sending:                   # ours was longer than theirs
            dist.send(rest, to)
    _receive_into(recv[0], recv[2], arriving())


def _sizes(size: int) -> list[int]:
    return [min(CHUNK, size - at) for at in range(0, size, CHUNK)] or []


def _pieces(path: Path) -> Iterator[torch.Tensor]:
    """A file in ``CHUNK`` pieces as byte tensors on the collective's device."""
    with open(path, "rb") as f:
        while True:
            data = f.read(CHUNK)
            if not data:
                return
            yield torch.frombuffer(bytearray(data), dtype=torch.uint8).to(collective_device())


def _receive_into(final: Path, digest: str, pieces: Iterator[torch.Tensor]) -> None:
    """Write the arriving pieces to a temp file beside ``final``; rename it in only when their
    blake3 is ``digest`` (else the temp is removed and a ``FingerprintMismatchError`` raised)."""
    atomic.make_durable_dir(final.parent)
    hasher = fingerprint.hasher()

    def hashed() -> Iterator[bytes]:
        for piece in pieces:
            data = piece.cpu().numpy().tobytes()
            hasher.update(data)
            yield data
        got = hasher.hexdigest()
        if got != digest:
            raise FingerprintMismatchError(str(final), fingerprint.mismatch(digest, got, "copy", "sender"),
                                           expected=digest, got=got)
    try:
        atomic.write_bytes(final, hashed())
    except BaseException:
        for _ in pieces:                        # take the rest, so that the sender is not left waiting
            pass
        raise


# ------------------------------------------------------------------------------ restore
def agreed_source(run: Run, allow_nonfinite: bool = False) -> dict[str, Any]:
    """``ranks.agreed_source`` on more than one node: the durable choice (rank 0's), or a newer
    RAM generation every rank can reach once each node has fetched what it lacks from its peers
    (``tier``: ``memory``, or ``peer`` when some node fetched); ``path`` is this node's."""
    topo = topology()
    disk = decided_by_rank0(lambda: _durable(run, allow_nonfinite))
    where = tiers.memory_dir(run.path)
    mine = replicas.inventory(where) if topo.leader else {}
    nodes = [inv for r, inv in enumerate(gather_json(mine)) if r % topo.local == 0]
    reach = replicas.reachable(nodes, disk["step"], allow_nonfinite)
    notes = [f"{where}: skipping RAM generation {step}: {why}" for step, why in reach.skipped]
    if reach.step is not None:
        plan = replicas.transfers(reach, topo.nodes)
        try:
            _agreed(lambda: _fetch(where, reach, plan, topo), "could not fetch a RAM generation from its peers")
        except CheckpointError as exc:
            notes.append(f"{where}: RAM generation {reach.step} not restored, falling back: {exc}")
        else:
            return {"path": str(where / fmt.manifest_name(reach.step)), "why": None,
                    "tier": tiers.PEER if plan else tiers.MEMORY, "skipped": notes}
    if disk["error"]:
        raise NoValidGenerationError(str(run.path), disk["error"])
    return {"path": disk["path"], "why": disk["why"], "tier": tiers.DISK if disk["path"] else None,
            "skipped": notes}


def _durable(run: Run, allow_nonfinite: bool) -> dict[str, Any]:
    """The newest valid durable generation as JSON (rank 0 decides it for every rank)."""
    choice = run.choose(deep=True, allow_nonfinite=allow_nonfinite)
    why = choice.why() if choice.diverged else None
    try:
        gen = run.chosen(choice)
    except NoValidGenerationError as exc:
        return {"path": None, "step": None, "why": None, "error": exc.problem}
    if gen is None:
        return {"path": None, "step": None, "why": None, "error": None}
    path = gen.bin if gen.bin is not None else gen.manifest
    return {"path": str(path), "step": gen.step, "why": why, "error": None}


def _fetch(where: Path, reach: replicas.Reach, plan: list[tuple[str, int, int]], topo: Topology) -> None:
    """Every transfer of ``plan`` in order (node leaders send and receive, each file verified on
    arrival), then each node's first rank writes the manifest where it lacks it."""
    need = replicas.files_of(reach.doc)
    for name, frm, to in plan:
        src, dst = frm * topo.local, to * topo.local
        if topo.rank == src:
            for piece in _pieces(where / name):
                dist.send(piece, dst)
        elif topo.rank == dst:
            size, digest = need[name]
            _receive_into(where / name, digest, _arrivals(size, src))
    manifest = where / fmt.manifest_name(reach.step)
    if topo.leader and reach.doc is not None and not _same(manifest, reach.doc):
        mf.write(manifest, reach.doc)


def _arrivals(size: int, src: int) -> Iterator[torch.Tensor]:
    for n in _sizes(size):
        buf = torch.empty(n, dtype=torch.uint8, device=collective_device())
        dist.recv(buf, src)
        yield buf


def _same(path: Path, doc: dict[str, Any]) -> bool:
    try:
        return path.is_file() and mf.read(path) == doc
    except CheckpointError:
        return False
