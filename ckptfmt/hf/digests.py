"""The history's state digests of a Trainer's step (spec/RUN.md §3.9, §12.6): what its
``checkpoint-N`` restores, as the next step finds it, for ``ckptfmt bisect``.

``Checkpointing(digests=True)`` takes them at ``on_step_end``, after the optimizer's and the
scheduler's steps and before anything of the next step draws (its batches are fetched after the
hook), and hands them to the step's record, which is written later, once the Trainer has logged
the step. A ``checkpoint-N`` restores the RNG states (``rng_state.pth``: Python, NumPy, torch's
CPU and every CUDA device's), the optimizer (``optimizer.pt``: each param group's lr, the step),
the scheduler (``scheduler.pt``), the GradScaler (``scaler.pt``, where the Trainer has one) and
``trainer_state.json``, whose data position is the global step and the epoch: the record's step is
the first, and ``state.trainer_state`` digests the two (an epoch that a resume reads from another
place in the epoch differs there). The rest of ``trainer_state.json`` (the log, the callbacks'
states) is left out: the log grows with the run, and the metrics are in the record already.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..torch import digests as digesting

__all__ = ["step_digests"]


def step_digests(state: Any, hooked: Mapping[str, Any]) -> dict[str, Any]:
    """The digests of the Trainer's state after step ``state.global_step``; ``hooked``: the
    callback hook's keyword arguments (``optimizer``, ``lr_scheduler``). The GradScaler is the
    one accelerate's optimizer holds (the Trainer saves the accelerator's, which it is)."""
    optimizer, scheduler = hooked.get("optimizer"), hooked.get("lr_scheduler")
    scaler = getattr(optimizer, "scaler", None)
    pieces: list[tuple[str, Any]] = [] if scheduler is None else [("scheduler", scheduler)]
    if scaler is not None:
        pieces.append(("amp.scaler", scaler))
    pieces.append(("state.trainer_state", digesting.Held({"global_step": state.global_step, "epoch": state.epoch})))
    return digesting.state_digests(optimizer=optimizer, pieces=pieces, generators={}, scaler=scaler,
                                   step=state.global_step)
