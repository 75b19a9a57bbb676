"""What a session needs from the other ranks of a job: who it is, and decisions they agree on.

A ``Session`` (``ckptfmt.run.session``) is given a ``Collective``: ``OneProcess`` here for a
loop of one process, the torch.distributed one (``ckptfmt.torch.ranks.TorchCollective``) under
torchrun; another framework brings its own. Every rank calls the same methods in the same order
(each is a collective there).

>>> one = OneProcess()
>>> one.rank, one.world, one.agree(True, False)
(0, 1, (True, False))
"""
from __future__ import annotations

from typing import Protocol

__all__ = ["Collective", "OneProcess"]


class Collective(Protocol):
    """The ranks of a job as a session sees them."""

    rank: int
    world: int

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag as every rank sees it: true if true on any rank (a signal reaches one
        process; its request becomes every rank's decision at the same step)."""
        ...

    def barrier(self) -> None:
        """Return once every rank has called it (a writer that commits outside the session:
        every rank's files written before rank 0 commits)."""
        ...


class OneProcess:
    """The collective of a job of one process: rank 0 of 1, its flags its own."""

    rank = 0
    world = 1

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        return tuple(flags)

    def barrier(self) -> None:
        return None
