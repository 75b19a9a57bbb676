"""What the reference trainer does differently under torchrun (one process per rank).

The loop in loop.py is the single-process story; each function here is the single-process
answer when there is one process, so the loop calls them unconditionally:

- ``rank_device``: rank r uses GPU r mod count;
- ``wrap_model``: a DDP replica or FSDP2 shards, each rank with its own dropout RNG;
- ``agreed_latest``: rank 0 picks the generation to resume, every rank takes the same one;
- ``rank_state`` / ``add_rank_states``: per-rank RNG, data and bandit state in the manifest,
  and what a resume at another world size keeps of it;
- ``train_distributed``: process group, rank 0's writer lock, per-rank log lines.

Generic torch.distributed helpers (flag agreement, JSON gather, sharded save/load) are in
``ckptfmt.torch.distributed``.
"""
from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Callable, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from ..run import Generation, Run, RunLock
from ..torch.distributed import decided_by_rank0, gather_json, process_group, rank_world


class _Trainer(Protocol):
    """What ``train_distributed`` needs of loop.Trainer (which imports this module)."""

    run: Run

    def build(self) -> None: ...

    def fit(self, target: int) -> int: ...


def rank_device(device: torch.device) -> torch.device:
    """Under torchrun on GPUs, rank r uses GPU r mod the device count."""
    rank, world = rank_world()
    if world > 1 and device.type == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


def wrap_model(model: torch.nn.Module, parallel: str, seed: int) -> torch.nn.Module:
    """The module the training step calls. One process: ``model``. Under torchrun the initial
    weights (drawn before) are the same everywhere; each rank is then reseeded for its own
    dropout, and ``model`` becomes a DDP replica or is sharded in place by FSDP2."""
    rank, world = rank_world()
    if world == 1:
        return model
    torch.manual_seed(seed * 1000 + rank)
    random.seed(seed * 1000 + rank)
    if parallel != "fsdp":
        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard  # lazy: FSDP2 only; 0.5 s to import, absent without distributed
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def agreed_latest(run: Run) -> Generation | None:
    """The newest valid generation, its hash checked (a damaged newest one is skipped with a
    warning, not fatal). Under torchrun rank 0 picks it and every rank takes the same one."""
    if rank_world()[1] == 1:
        return run.latest(deep=True)
    step = decided_by_rank0(lambda: _step_of(run.latest(deep=True)))
    if step is None:
        return None
    return next(g for g in run.generations() if g.step == step)


def _step_of(gen: Generation | None) -> int | None:
    return gen.step if gen else None


def add_rank_states(doc: dict[str, Any]) -> None:
    """Under torchrun, every rank's RNG, data and bandit state as ``doc["ranks"]`` (a
    collective: every rank calls it); a single process's manifest is left as it is."""
    if rank_world()[1] > 1:
        doc["ranks"] = gather_json({"rng": doc["rng"], "data": doc["data"], "bandit": doc["bandit"]})


def rank_state(doc: dict[str, Any], run: Run, log: Callable[[str], None]) -> dict[str, Any]:
    """This rank's RNG, data and bandit state in manifest ``doc``: its own entry when the world
    size matches, rank 0's top-level state for a single process, fresh (with a report in the log
    and the history) otherwise."""
    rank, world = rank_world()
    ranks = doc.get("ranks")
    saved_world = len(ranks) if ranks else 1
    if saved_world == world:
        return {**doc, **(ranks[rank] if ranks else {})}
    log(f"world size changed from {saved_world} to {world}: weights, m, v, optimizer and "
        f"scheduler resume exactly; per-rank RNG, data positions and bandits "
        + ("of ranks < %d resume, the others start fresh" % saved_world if world > saved_world
           else "of the dropped ranks are discarded"))
    if rank == 0:
        run.history.event("world_size_change", doc["step"], saved=saved_world, now=world,
                          identical=["weights", "m", "v", "optimizer", "scheduler", "history"],
                          per_rank_state_resumed=list(range(min(saved_world, world))),
                          per_rank_state_fresh=[r for r in range(world) if r >= saved_world],
                          per_rank_state_dropped=list(range(world, saved_world)))
    if ranks and rank < saved_world:
        return {**doc, **ranks[rank]}
    if rank == 0:
        return doc
    return {**doc, "fresh_rank": True}


def train_distributed(run_dir: str, steps: int, make_trainer: Callable[[Callable[[str], None]], _Trainer], *,
                      device: str = "auto", timeout_s: float = 120) -> int:
    """A torchrun worker: joins the process group (gloo on the CPU, NCCL on GPUs, ``timeout_s``
    per collective), rank 0 holds the run's writer lock, every rank trains. ``make_trainer``
    builds this rank's Trainer from its log function."""
    with process_group(device, timeout_s) as rank:
        lock = RunLock(run_dir, purpose="trainer rank 0") if rank == 0 else contextlib.nullcontext()
        Run(run_dir, create=True)
        with lock:
            trainer = make_trainer(rank_log(rank))
            trainer.build()
            try:
                return trainer.fit(steps)
            finally:
                trainer.run.history.close()


def rank_log(rank: int) -> Callable[[str], None]:
    """Log lines to stderr tagged with the rank: ``[train rank 1] ...``."""
    return lambda msg: print(f"[train rank {rank}] {msg}", file=sys.stderr, flush=True)
