"""The RAM tier under torchrun (spec/RUN.md §13.9): a sharded RAM generation whose shards are
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
from ..errors import (CheckpointError, FingerprintMismatchError, NoValidGenerationError, SaveError,
                      UnsupportedSetupError)
from ..run import Run, ramdirs, replicas, tiers
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
    """The ranks by node from torchrun's ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK``; without them
    (one process, another launcher) one node. Never raises: ``checked`` refuses what is off."""
    rank, world = rank_world()
    if world == 1 or "LOCAL_RANK" not in os.environ:
        return Topology(rank, world, world, rank)
    return Topology(rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), int(os.environ["LOCAL_RANK"]))


def checked() -> Topology:
    """``topology()``, refused on every rank (a collective) when the nodes are not of equal size
    and numbered node by node, as the pairing needs."""
    topo = topology()
    regular = topo.local >= 1 and topo.world % topo.local == 0 and topo.rank % topo.local == topo.local_rank
    if any_rank(not regular)[0]:
        raise UnsupportedSetupError(None, "the RAM tier needs nodes of equal size numbered node by node; rank "
                                          f"{topo.rank} of {topo.world} is local rank {topo.local_rank} of {topo.local}"
                                          + ("" if not regular else " here, another rank's layout is off"))
    return topo


def across_nodes(run: Run) -> bool:
    """Collective: the run has a RAM tier (an ID) and this start spans more than one node."""
    if rank_world()[1] == 1 or not decided_by_rank0(lambda: tiers.run_id(run) is not None):
        return False
    return checked().nodes > 1


# ------------------------------------------------------------------------------ save
def save(where: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         manifest: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any] | None:
    """Collective: commit RAM generation ``step`` into each node's tier ``where`` (this node's
    path, made here): every rank's shard, its partner's copy, rank 0's companion, the manifest
    by each node's first rank; the manifest (rank 0 and, on several nodes, every rank). A
    failure on any rank is a ``SaveError`` on every rank."""
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
    return doc


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
    ring of any length cannot wait on itself); each received file verified, then renamed in.
    Every piece agreed on is sent and received even after a failure (the first is raised at the
    end), so no partner is left waiting."""
    to = replicas.partner(topo.rank, topo.local, topo.world)
    frm = replicas.sender(topo.rank, topo.local, topo.world)
    outgoing, incoming = _files(where, step, rows[topo.rank]), _files(where, step, rows[frm])
    errors = Errors()
    for i in range(max(len(outgoing), len(incoming))):
        send = outgoing[i] if i < len(outgoing) else None
        recv = incoming[i] if i < len(incoming) else None
        _swap(send, to, recv, frm, errors)
    errors.raise_first()


def _files(where: Path, step: int, row: dict[str, Any]) -> list[tuple[Path, int, str]]:
    """(path, size, blake3) of what a rank's row says it wrote: its shard, rank 0's companion."""
    out = [(shards.shards_dir(where, step) / row["file"], row["size"], row["blake3"])]
    entry = row.get(companion.FIELD)
    if entry:
        out.append((where / entry["file"], entry["size"], entry["blake3"]))
    return out


class Errors:
    """The first failure of a transfer that goes on to its agreed end."""

    def __init__(self) -> None:
        self.first: BaseException | None = None

    def note(self, exc: BaseException) -> None:
        self.first = self.first or exc

    def raise_first(self) -> None:
        if self.first is not None:
            raise self.first


def _swap(send: tuple[Path, int, str] | None, to: int, recv: tuple[Path, int, str] | None, frm: int,
          errors: Errors) -> None:
    """One file out to ``to`` and one in from ``frm``, piece by piece, each pair posted together."""
    sending = _pieces(send[0], send[1], errors) if send is not None else iter(())
    if recv is None:
        for piece in sending:
            dist.send(piece, to)
        return

    def arriving() -> Iterator[torch.Tensor]:
        for size in _sizes(recv[1]):
            buf = torch.empty(size, dtype=torch.uint8, device=collective_device())
            ops = [dist.P2POp(dist.irecv, buf, frm)]
            out = next(sending, None)
            if out is not None:
                ops.append(dist.P2POp(dist.isend, out, to))
            for work in dist.batch_isend_irecv(ops):   # one group: NCCL pairs the two directions
                work.wait()
            yield buf
        for rest in sending:                   # ours was longer than theirs
            dist.send(rest, to)
    _receive_into(recv[0], recv[2], arriving(), errors)


def _sizes(size: int) -> list[int]:
    return [min(CHUNK, size - at) for at in range(0, size, CHUNK)]


def _pieces(path: Path, size: int, errors: Errors) -> Iterator[torch.Tensor]:
    """``size`` bytes of a file in ``CHUNK`` pieces as byte tensors on the collective's device;
    a file that cannot be read sends zeros of the agreed sizes (its receiver's blake3 fails)."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        errors.note(SaveError(str(path), f"cannot read it to send: {exc.strerror or exc}"))
        f = None
    with f if f is not None else open(os.devnull, "rb") as src:
        for n in _sizes(size):
            data = src.read(n) if f is not None else b""
            if len(data) != n:
                if f is not None:
                    errors.note(SaveError(str(path), f"shorter than the {size} bytes its row names"))
                data = data + bytes(n - len(data))
            yield torch.frombuffer(bytearray(data), dtype=torch.uint8).to(collective_device())


def _receive_into(final: Path, digest: str, pieces: Iterator[torch.Tensor], errors: Errors) -> None:
    """Write the arriving pieces to a temp file beside ``final``; rename it in only when their
    blake3 is ``digest``. Any failure (a full tier, a damaged arrival) is noted, and the rest of
    the pieces is still taken, so that the sender is never left waiting."""
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
        atomic.make_durable_dir(final.parent)
        atomic.write_bytes(final, hashed())
    except (CheckpointError, OSError) as exc:
        for _ in pieces:                        # take the rest, so that the sender is not left waiting
            pass
        errors.note(exc)


# ------------------------------------------------------------------------------ restore
def agreed_source(run: Run, allow_nonfinite: bool = False) -> dict[str, Any]:
    """``ranks.agreed_source`` on more than one node: the durable choice (rank 0's), or a newer
    RAM generation every rank can reach once each node has fetched what it lacks from its peers
    (``tier``: ``memory``, or ``peer`` when some node fetched); ``path`` is this node's."""
    topo = topology()
    disk = decided_by_rank0(lambda: _durable(run, allow_nonfinite))
    where = tiers.memory_dir(run)
    if where is not None and topo.leader:
        ramdirs.keep(where, wait=True)       # no `ckptfmt ram` removes it while it is chosen and read
    mine, notes = _inventory(where, disk["step"]) if topo.leader else ({}, [])
    nodes = [inv for r, inv in enumerate(gather_json(mine)) if r % topo.local == 0]
    reach = replicas.reachable(nodes, disk["step"], allow_nonfinite, timeline=disk["timeline"])
    notes += [f"{where}: skipping RAM generation {step}: {why}" for step, why in reach.skipped]
    if reach.step is not None:
        plan = replicas.transfers(reach, topo.nodes)
        try:
            _agreed(lambda: _fetch(where, reach, plan, topo), "could not fetch a RAM generation from its peers")
        except CheckpointError as exc:
            notes.append(f"{where}: RAM generation {reach.step} not restored, falling back: {exc}")
        else:
            return {"path": str(where / fmt.manifest_name(reach.step)), "why": None,
                    "tier": tiers.PEER if plan else tiers.MEMORY, "skipped": notes}
    if disk["error"] or (disk["path"] is None and reach.skipped):
        raise NoValidGenerationError(str(run.path), "no valid generation in any tier: " + "; ".join(
            ([disk["error"]] if disk["error"] else []) + [f"RAM step {s}: {why}" for s, why in reach.skipped]))
    return {"path": disk["path"], "why": disk["why"], "tier": tiers.DISK if disk["path"] else None,
            "skipped": notes}


def _inventory(where: Path | None, above: int | None) -> tuple[dict[str, Any], list[str]]:
    """This node's inventory (its first rank), empty with a note when the tier cannot be read."""
    try:
        return replicas.inventory(where, above), []
    except (CheckpointError, OSError) as exc:
        return {}, [f"{where}: the RAM tier cannot be read, taken as empty: {exc}"]


def _durable(run: Run, allow_nonfinite: bool) -> dict[str, Any]:
    """The newest valid durable generation as JSON, and the run's current timeline (rank 0
    decides them for every rank)."""
    choice = run.choose(deep=True, allow_nonfinite=allow_nonfinite)
    why = choice.why() if choice.diverged else None
    out = {"path": None, "step": None, "why": None, "error": None, "timeline": replicas.timeline(run)}
    try:
        gen = run.chosen(choice)
    except NoValidGenerationError as exc:
        return {**out, "error": exc.problem}
    if gen is None:
        return out
    path = gen.path
    return {**out, "path": str(path), "step": gen.step, "why": why}


def _fetch(where: Path, reach: replicas.Reach, plan: list[tuple[str, int, int]], topo: Topology) -> None:
    """Every transfer of ``plan`` in order (node leaders send and receive, each file verified on
    arrival; after a failure the rest of the plan still runs, so nobody is left waiting), then
    each node's first rank writes the manifest where it lacks it."""
    need, errors = replicas.files_of(reach.doc), Errors()
    for name, frm, to in plan:
        src, dst = frm * topo.local, to * topo.local
        size, digest = need[name]
        if topo.rank == src:
            for piece in _pieces(where / name, size, errors):
                dist.send(piece, dst)
        elif topo.rank == dst:
            _receive_into(where / name, digest, _arrivals(size, src), errors)
    errors.raise_first()
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
        return path.is_file() and mf.read(path) == mf.sealed(doc)
    except CheckpointError:
        return False
