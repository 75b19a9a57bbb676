"""Sharded save and resharded load under torch.distributed (imports torch).

Every rank durably writes its contiguous range of the flat weights/m/v arrays as its own
seed-layout file; the ranks exchange their shard rows (JSON in uint8 tensors: nothing pickled);
only when every rank reports its shard durable does rank 0 commit the manifest; a final barrier
keeps any rank from running ahead of the commit. A rank that dies mid-save leaves shards but no
manifest: the generation is not committed and latest-valid skips it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from . import shards
from . import torch as ct


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_json(obj: Any) -> list[Any]:
    """all_gather of JSON-able objects through byte tensors (every rank gets every object)."""
    rank, world = rank_world()
    if world == 1:
        return [obj]
    data = json.dumps(obj).encode()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size)
    width = int(max(s.item() for s in sizes))
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.zeros(width, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return [json.loads(bytes(t[:int(s.item())].tolist())) for t, s in zip(everyone, sizes)]


def _range_views(tensors: list[torch.Tensor], start: int, stop: int) -> Iterator[Any]:
    """Byte views of the global flat range [start, stop) of ``tensors`` laid end to end."""
    offset = 0
    for t in tensors:
        k = t.numel()
        lo, hi = max(start, offset), min(stop, offset + k)
        if lo < hi:
            yield from ct.chunks([t.detach().reshape(-1)[lo - offset:hi - offset]])
        offset += k


def save_sharded(run_dir: "str | Path", step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Collective: every rank writes its shard; rank 0 commits. Returns this rank's row."""
    rank, world = rank_world()
    params = list(model.parameters())
    ms, vs, _ = ct.moments(model, optimizer)
    n = sum(p.numel() for p in params)
    start, stop = shards.partition(n, world, rank)
    row = shards.save_shard(run_dir, step, rank, world, start, stop, _range_views(params, start, stop),
                            _range_views(ms, start, stop), _range_views(vs, start, stop))
    rows = gather_json(row)              # returns only when every rank's shard is durable
    if rank == 0:
        shards.commit(run_dir, step, rows, manifest)
    if world > 1:
        dist.barrier()
    return row


def load_range(manifest_path: "str | Path", region: str, start: int, stop: int, *, verify: bool = True):
    """The global range [start, stop) of one region, read only from the shards that hold it."""
    with shards.ShardedCheckpoint(manifest_path, verify=verify) as sc:
        return sc.read(region, start, stop)


def load_sharded(manifest_path: "str | Path", model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, *, verify: bool = True) -> dict[str, Any]:
    """Load a sharded generation, saved by any number of ranks, into a full replica (DDP)."""
    sc = shards.ShardedCheckpoint(manifest_path, verify=verify)
    try:
        ct.load(sc, model, optimizer)
        return sc.manifest
    finally:
        sc.close()
