"""What the reference trainer does differently under torchrun (one process per rank).

The loop in loop.py is the single-process story; each function here is the single-process
answer when there is one process, so the loop calls them unconditionally:

- ``rank_device``: rank r uses GPU r mod count;
- ``wrap_model``: a DDP replica or FSDP2 shards, each rank with its own dropout RNG;
- ``train_distributed``: process group, rank 0's writer lock, per-rank log lines.

Generic torch.distributed helpers (flag agreement, JSON gather, sharded save/load) are in
``ckptfmt.torch.distributed``; the agreed choice of the generation to resume, per-rank RNG and
loop state, and a resume at another world size are the checkpoint manager's
(``ckptfmt.torch.ranks``).
"""
from __future__ import annotations

import random
import sys
from typing import Callable, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from ..errors import DeviceUnavailableError
from ..run import Run
from ..run.storerun import open_run
from ..torch.distributed import process_group, rank_world


class _Trainer(Protocol):
    """What ``train_distributed`` needs of loop.Trainer (which imports this module)."""

    run: Run

    def build(self) -> None: ...

    def fit(self, target: int) -> int: ...

    def close(self) -> None: ...


def pick_device(name: str) -> torch.device:
    """The device of ``--device``: auto is CUDA where there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(None, "--device cuda: no CUDA device is available")
    return torch.device(name)


def rank_device(device: torch.device) -> torch.device:
    """Under torchrun on GPUs, rank r uses GPU r mod the device count, made the current device."""
    rank, world = rank_world()
    if world > 1 and device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)   # the current device: its RNG is the one saved; NCCL uses it
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


def train_distributed(run_dir: str, steps: int, make_trainer: Callable[[Run, Callable[[str], None]], _Trainer], *,
                      device: str = "auto", timeout_s: float = 120) -> int:
    """A torchrun worker: joins the process group (gloo on the CPU, NCCL on GPUs, ``timeout_s``
    per collective), rank 0 holds the run's writer lock (a URL's: its lease), every rank trains.
    ``make_trainer`` builds this rank's Trainer on the run, with its log function."""
    with process_group(device, timeout_s) as rank:
        run = open_run(run_dir, create=True)
        lock = run.writer_lock("trainer rank 0") if rank == 0 else None
        trainer = None
        try:
            trainer = make_trainer(run, rank_log(rank))
            trainer.build()
            try:
                return trainer.fit(steps)
            finally:
                trainer.close()
        finally:
            if lock is not None:
                trainer.release(lock) if trainer is not None else lock.release()


def rank_log(rank: int) -> Callable[[str], None]:
    """Log lines to stderr tagged with the rank: ``[train rank 1] ...``."""
    return lambda msg: print(f"[train rank {rank}] {msg}", file=sys.stderr, flush=True)
