"""torch.distributed helpers any training loop may use (imports torch): process-group setup
under torchrun; flags every rank agrees on, a decision rank 0 takes for all, a JSON gather and a
mean over the ranks (each the single-process answer outside a process group); and sharded save
and resharded load.

Every rank durably writes its contiguous range of the flat weights/m/v arrays as its own
seed-layout file; the ranks exchange their shard rows (JSON in uint8 tensors: nothing pickled);
only when every rank reports its shard durable does rank 0 commit the manifest; a final barrier
keeps any rank from running ahead of the commit. A rank that dies mid-save leaves shards but no
manifest: the generation is not committed and latest-valid skips it.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from .. import format as fmt
from .. import shards
from ..errors import CheckpointError, LayoutMismatchError, RankDisagreementError
from ..run import Run
from ..run.storerun import StoreRun, open_run
from . import adapter as ct
from . import staging


def exit_worker(code: int) -> NoReturn:
    """End a torchrun worker after ``destroy_process_group`` without Python's finalization.

    Seen here in 2 of about 230 two-rank gloo runs (0 of 200 since this exit): a rank aborted
    (SIGABRT, "terminate called without an active exception") after both ranks had returned
    from ``destroy_process_group``, i.e. while the interpreter finalised, and torchrun then
    failed a job whose checkpoints were all durable. By this point every file of ours is closed and fsynced, so skipping
    finalization loses nothing; the streams are flushed here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launched_by_torchrun() -> bool:
    """True in a worker of a torchrun job of more than one process (torchrun's WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def backend_for(device: str, cuda_available: bool) -> str:
    """The process-group backend for a job on ``device`` ('auto', 'cpu', 'cuda'): on GPUs
    "cpu:gloo,cuda:nccl" (NCCL for CUDA tensors, gloo for CPU tensors, so a collective on a CPU
    tensor, the user's or a library's, works too), on the CPU "gloo".

    >>> backend_for("auto", True), backend_for("auto", False), backend_for("cpu", True)
    ('cpu:gloo,cuda:nccl', 'gloo', 'gloo')
    """
    return "cpu:gloo,cuda:nccl" if device != "cpu" and cuda_available else "gloo"


@contextlib.contextmanager
def process_group(device: str = "auto", timeout_s: float = 120) -> Iterator[int]:
    """The process group of a torchrun worker (``backend_for``: NCCL and gloo on GPUs, gloo on
    the CPU), with ``timeout_s`` for every collective; yields this rank and destroys the group
    on exit."""
    backend = backend_for(device, torch.cuda.is_available())
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield dist.get_rank()
    finally:
        dist.destroy_process_group()


def rank_world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def collective_device() -> torch.device:
    """Where the tensors of this library's collectives live: the CPU when the process group has
    a backend for CPU tensors (gloo, or a map such as "cpu:gloo,cuda:nccl"), else the current
    device of the group's device type (a user's own group may be NCCL only: no CPU tensors)."""
    kind = collective_device_type(str(dist.get_backend()))
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def collective_device_type(backend: str) -> str:
    """The device type a group's collectives can take, from ``dist.get_backend()``: a plain name
    ("gloo", "nccl") or, for a group made with a device map, that map lowercased as given
    ("cpu:gloo,cuda:nccl"); "cpu" whenever the CPU has a backend.

    >>> [collective_device_type(b) for b in ("gloo", "nccl", "cpu:gloo,cuda:nccl", "cuda:nccl")]
    ['cpu', 'cuda', 'cpu', 'cuda']
    """
    if ":" not in backend:
        return "cuda" if backend == "nccl" else "cpu"
    devices = [pair.split(":", 1)[0].strip() for pair in backend.split(",")]
    return "cpu" if "cpu" in devices else devices[0]


def any_rank(*flags: bool) -> tuple[bool, ...]:
    """Each flag as every rank sees it: true if true on any rank (a MAX all-reduce), so a signal
    delivered to one rank becomes every rank's decision. One process: the flags unchanged."""
    if rank_world()[1] == 1:
        return flags
    agreed = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=collective_device())
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return tuple(bool(f) for f in agreed.cpu())


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar tensor over the ranks (a collective); one process: its value."""
    world = rank_world()[1]
    if world == 1:
        return float(value.item())
    total = value.detach().clone()
    dist.all_reduce(total)
    return float(total.item()) / world


def decided_by_rank0(decide: Callable[[], Any]) -> Any:
    """Rank 0's answer on every rank: only rank 0 calls ``decide`` (which returns JSON-able data),
    so the ranks cannot disagree; a ``CheckpointError`` there is raised on every rank as
    ``RankDisagreementError``, so no rank goes on alone. One process: ``decide()``."""
    rank, world = rank_world()
    if world == 1:
        return decide()
    answer, error = None, None
    if rank == 0:
        try:
            answer = decide()
        except CheckpointError as exc:
            error = str(exc)
    choice = gather_json({"answer": answer, "error": error})[0]
    if choice["error"]:
        raise RankDisagreementError(None, choice["error"])
    return choice["answer"]


def gather_json(obj: Any) -> list[Any]:
    """all_gather of JSON-able objects through byte tensors (every rank gets every object)."""
    rank, world = rank_world()
    if world == 1:
        return [obj]
    device = collective_device()
    data = json.dumps(obj).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size)
    width = int(max(s.item() for s in sizes))
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(everyone, mine.to(device))
    return [json.loads(bytes(t[:int(s.item())].cpu().tolist())) for t, s in zip(everyone, sizes)]


def _range_views(tensors: list[torch.Tensor], start: int, stop: int, stager: staging.Stager) -> Iterator[Any]:
    """Byte views of the global flat range [start, stop) of ``tensors`` laid end to end, device
    tensors through the save's one staging pair."""
    pieces, offset = [], 0
    for t in tensors:
        k = t.numel()
        lo, hi = max(start, offset), min(stop, offset + k)
        if lo < hi:
            pieces.append(t.detach().reshape(-1)[lo - offset:hi - offset])
        offset += k
    return ct.chunks(pieces, stager)


def is_sharded_model(model: torch.nn.Module) -> bool:
    """True for FSDP2 models (parameters are DTensors sharded across ranks)."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor  # lazy: absent from torch builds without distributed
    return any(isinstance(p, DTensor) for p in model.parameters())


def reshard(model: torch.nn.Module) -> None:
    """Put an FSDP2 model's parameters back into their sharded form. After a forward without a
    backward (a greedy sample, an evaluation) FSDP2 leaves the root module's parameters
    unsharded: the tensors ``model.parameters()`` then yields are not the optimizer's, so their
    state (and their param group) would not be found by identity. A no-op for other models."""
    if not dist.is_available():
        return
    from torch.distributed.fsdp import FSDPModule  # lazy: absent from torch builds without distributed
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _range_from_dtensors(tensors: list[torch.Tensor], start: int, stop: int) -> Any:
    """This rank's global range [start, stop), gathered one parameter at a time: every rank
    all-gathers each parameter in the same order (a collective) and keeps only its slice, so
    at most one full parameter, never the whole model, exists on a rank."""
    out = np.empty(stop - start, dtype=fmt.DTYPE)
    offset = 0
    for t in tensors:
        full = t.full_tensor().detach().reshape(-1) if hasattr(t, "full_tensor") else t.detach().reshape(-1)
        k = full.numel()
        lo, hi = max(start, offset), min(stop, offset + k)
        if lo < hi:
            out[lo - start:hi - start] = full[lo - offset:hi - offset].cpu().numpy()
        offset += k
        del full
    return out


def save_sharded(run: "Run | str | Path", step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 manifest: dict[str, Any] | None = None,
                 before_commit: Callable[[dict[str, Any]], None] | None = None,
                 extra_tensors: dict[str, Any] | None = None) -> dict[str, Any]:
    """Collective: every rank writes its shard into ``run`` (a ``Run``, on a store too, or a run
    directory's path); rank 0 commits once every rank's shard is durable (``Run.commit_shards``:
    ``extra_tensors`` its companion, ``before_commit`` as ``shards.commit``). This rank's row."""
    rank, world = rank_world()
    run = run if isinstance(run, Run) else open_run(run, create=True)
    if isinstance(run, StoreRun):       # written create-only there: what is there of the step goes first
        if rank == 0:
            run.make_room(step)
        if world > 1:
            dist.barrier()
    row = own_shard(run, step, model, optimizer)
    rows = gather_json(row)              # returns only when every rank's shard is durable
    if rank == 0:
        run.commit_shards(step, rows, manifest, before_commit, extra_tensors)
    if world > 1:
        dist.barrier()
    return row


def own_shard(run: "Run | str | Path", step: int, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Write this rank's shard of generation ``step`` (weights, m and v over its contiguous
    range) into ``run`` (a ``Run``: ``Run.write_shard``; a directory's path); its manifest row.
    Collective for FSDP2 models only."""
    rank, world = rank_world()
    params = list(model.parameters())
    ms, vs, _ = ct.moments(model, optimizer)
    n = sum(p.numel() for p in params)
    start, stop = shards.partition(n, world, rank)
    stager = staging.Stager()   # this save's pair, shared by its three regions (FORMAT §5.7.2)
    collect = _range_from_dtensors if is_sharded_model(model) else partial(_range_views, stager=stager)
    write = run.write_shard if isinstance(run, Run) else partial(shards.save_shard, run)
    return write(step, rank, world, start, stop, collect(params, start, stop), collect(ms, start, stop),
                 collect(vs, start, stop))


def load_range(manifest_path: "str | Path", region: str, start: int, stop: int, *, verify: bool = True):
    """The global range [start, stop) of one region, read only from the shards that hold it."""
    with shards.ShardedCheckpoint(manifest_path, verify=verify) as sc:
        return sc.read(region, start, stop)


def load_sharded(manifest_path: "str | Path", model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, *, verify: bool = True) -> dict[str, Any]:
    """Load a sharded generation, saved by any number of ranks, into this rank's model: a full
    replica (DDP, one process) or this rank's FSDP2 shards."""
    sc = shards.ShardedCheckpoint(manifest_path, verify=verify)
    try:
        load_into(sc, model, optimizer)
        return sc.manifest
    finally:
        sc.close()


def load_into(source: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """``ct.load`` for replicas; for FSDP2 each rank reads only the global ranges of its local rows."""
    if not is_sharded_model(model):
        ct.load(source, model, optimizer)
        return
    layout = {e["name"]: e for e in source.layout}
    read = source.read if hasattr(source, "read") else (lambda region, a, b: getattr(source, region)[a:b].copy())
    ranges: dict[int, tuple[int, int]] = {}

    def fill(local: torch.Tensor, region: str, a: int, b: int) -> None:
        local.copy_(torch.from_numpy(read(region, a, b)).view(local.shape))
    with torch.no_grad():
        for name, p in model.named_parameters():
            entry = layout[name]
            if list(p.shape) != entry["shape"]:
                raise LayoutMismatchError(source.path, f"{name}: shape {entry['shape']} in the file, {list(p.shape)} in the model")
            ranges[id(p)] = _local_flat_range(p, entry["offset"])
            fill(p.to_local(), "weights", *ranges[id(p)])
        if optimizer is None:
            return
        states = ct.prepare_optimizer(source, model, optimizer)   # DTensor state like the params
        for p, st in zip(ct.in_layout_order(source.layout, model), states):     # the file's order
            if st is None:                  # no optimizer state (frozen, or not updated yet)
                continue
            fill(st["exp_avg"].to_local(), "m", *ranges[id(p)])
            fill(st["exp_avg_sq"].to_local(), "v", *ranges[id(p)])


def _local_flat_range(p: torch.Tensor, offset: int) -> tuple[int, int]:
    """Global flat range [a, b) of this rank's dim-0 shard of a DTensor parameter."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # lazy: private, FSDP2 only
    local_shape, global_offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    row = 1
    for d in p.shape[1:]:
        row *= d
    if any(global_offset[1:]):
        raise ValueError("only dim-0 sharding (FSDP2's default) is supported")
    start = offset + global_offset[0] * row
    return start, start + (local_shape[0] if local_shape else 1) * row
