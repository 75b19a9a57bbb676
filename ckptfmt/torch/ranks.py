"""What the checkpoint manager does differently under torchrun (one process per rank).

Each function is the single-process answer when there is one process, so the manager calls
them unconditionally:

- ``check_setup``: a sharded save holds float32 parameters and Adam/AdamW moments;
- ``TorchCollective``: the session's collective (``ckptfmt.run.collective``): a stop or save
  requested on any rank (a signal reaches one process) becomes every rank's decision at the
  same step (the Lightning callback's signal flags too);
- ``add_ranks``: every rank's RNGs and loop state (a sampler's position differs per rank) in
  the manifest as ``ranks`` (``per_rank``: the gathering, which the Lightning callback's
  RNG states go through too);
- ``agreed_source``: rank 0 picks the generation to resume, every rank takes the same one;
- ``own_pieces``: this rank's RNGs and loop state from a manifest (at another world size, the
  ranks that existed resume theirs and new ranks start fresh).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import UnsupportedSetupError
from ..run import Run, resuming
from . import optim, peers
from .distributed import any_rank, decided_by_rank0, gather_json, rank_world


def check_setup(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(rank, world); under torchrun, refuses what a sharded generation cannot hold."""
    rank, world = rank_world()
    if world > 1:
        inner = optim.unwrapped(optimizer)       # accelerate's AcceleratedOptimizer: the one inside
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            raise UnsupportedSetupError(None, f"under torchrun the manager saves Adam/AdamW state; "
                                              f"got {type(inner).__name__}")
        if any(p.dtype != torch.float32 for p in model.parameters()):
            raise UnsupportedSetupError(None, "under torchrun the manager saves float32 parameters")
    return rank, world


class TorchCollective:
    """The ``Collective`` of a session over torch.distributed: this process's rank and the
    world size (0 of 1 outside a process group)."""

    def __init__(self) -> None:
        self.rank, self.world = rank_world()

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag true if any rank's is (one MAX all-reduce per step)."""
        return any_rank(*flags)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def add_ranks(doc: dict[str, Any], extra: dict[str, Any]) -> None:
    """Every rank's ``rng`` and ``state`` as ``doc["ranks"]`` (a collective). Per-rank state
    must be JSON: the companion file is rank 0's."""
    if rank_world()[1] == 1:
        return
    tensors = sorted(k for k in extra if k.startswith("state."))
    if any(any_rank(bool(tensors))):
        raise UnsupportedSetupError(None, "under torchrun, state objects must be JSON (numbers, lists, "
                                          f"strings): tensors or arrays in {tensors or 'another rank'}")
    doc["ranks"] = per_rank({"rng": doc["rng"], "state": doc.get("state", {})})


def per_rank(entry: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's ``entry`` (its RNG states, its loop state: JSON), in rank order, as every rank
    sees them (a collective); None in one process."""
    return gather_json(entry) if rank_world()[1] > 1 else None


def agreed_source(run: Run, allow_nonfinite: bool = False) -> dict[str, Any]:
    """The torch state side's ``choose``: the newest valid generation as ``resuming.choose_here``
    sees it (``path``, ``why``, ``tier``, ``skipped``). Under torchrun rank 0 picks for every
    rank; on more than one node the RAM tier is each node's and ``peers`` finds what every rank
    can reach (``tier`` ``peer``: fetched)."""
    if peers.across_nodes(run):
        return peers.agreed_source(run, allow_nonfinite)
    return decided_by_rank0(lambda: resuming.choose_here(run, allow_nonfinite))


def own_pieces(doc: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None,
                                             dict[str, Any] | None]:
    """(rng, state, world-size change) of this rank from a manifest.

    The same world size: rank 0's top-level pieces in one process, ``ranks[rank]`` under
    torchrun. Another world size: ranks that existed resume their own pieces, a new rank gets
    (None, None) and starts fresh, a dropped rank's pieces are discarded; the third value
    describes the change (for the history's ``world_size_change`` event), None if there is none.
    """
    rank, world = rank_world()
    saved = doc.get("ranks")
    saved_world = len(saved) if saved else 1
    change = None if saved_world == world else {
        "saved": saved_world, "now": world,
        "identical": ["weights", "m", "v", "optimizer", "scheduler", "history"],
        "per_rank_state_resumed": list(range(min(saved_world, world))),
        "per_rank_state_fresh": [r for r in range(world) if r >= saved_world],
        "per_rank_state_dropped": list(range(world, saved_world))}
    if saved and rank < saved_world:
        return saved[rank]["rng"], saved[rank]["state"], change
    if rank == 0:
        return doc.get("rng"), doc.get("state"), change
    return None, None, change
