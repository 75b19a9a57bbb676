"""What ``ckptfmt verify-resume --trainer command`` compares, recorded by any training loop.

The protocol (``ckptfmt.verify``) runs a loop four times in fresh processes and compares, step
by step, the sample ids each step consumed, its learning rate and loss, then the final state:
parameters, optimizer, scheduler, progress, the next draws of every RNG (observed and put back)
and an evaluation. A loop records them with ``ResumeRecord`` and writes ``summary.json``::

    record = ResumeRecord()
    ...                                   # in the loop:
    record.step(step, ids=batch_ids, lr=sched.get_last_lr()[0], loss=loss.item())
    ...                                   # at the end:
    record.write(output, checkpoint=path, model=model, optimizer=opt, scheduler=sched,
                 progress=sampler.state_dict(), generators={"noise": gen}, evaluation={"mse": mse})
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from . import optim, rng
from .distributed import is_sharded_model, rank_world
from .state import persistent_buffers, split

__all__ = ["ResumeRecord"]


class ResumeRecord:
    """The per-step records of one process, and the final summary it writes.

    Examples:
        A loop that proves its own resume records each step and writes ``summary.json`` at its end
        (``examples/plain_loop.py`` does, for ``ckptfmt verify-resume --trainer command``):

        ```python
        record = ResumeRecord()
        for step in range(start + 1, total + 1):
            ids = sampler.next()
            lr = sched.get_last_lr()[0]
            loss = train_step(ids)
            record.step(step, ids=ids, lr=lr, loss=loss.item())
        record.write(args.output, checkpoint=saved_path, model=model, optimizer=opt, scheduler=sched)
        ```
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def step(self, step: int, *, ids: Any, lr: float, loss: float) -> None:
        """What step ``step`` consumed (sample ids), its learning rate and its loss."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        self.steps.append({"step": step, "ids": ids, "lr": float(lr), "loss": float(loss)})

    def write(self, output: "str | os.PathLike[str]", *, checkpoint: "str | os.PathLike[str]",
              model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
              progress: Any = None, generators: dict[str, Any] | None = None,
              evaluation: dict[str, float] | None = None, step: int | None = None) -> Path:
        """Write ``output/summary.json`` as the verify-resume contract asks; returns its path.

        Under torchrun every rank calls it (an FSDP2 model's shards are gathered, a collective)
        and rank 0 writes the file."""
        params = list(model.parameters())
        ms, vs, opt_step = optim.moments(params, optimizer, step or 0)
        gather = is_sharded_model(model)
        flat = lambda ts: torch.cat([_whole(t, gather).detach().float().reshape(-1).cpu()  # noqa: E731
                                     for t in ts]).tolist()
        final = {"step": step if step is not None else (self.steps[-1]["step"] if self.steps else 0),
                 "parameters": flat(params),
                 "buffers": {k: v.detach().double().reshape(-1).tolist()
                             for k, v in persistent_buffers(model).items()},
                 "optimizer": {"step": opt_step, "m": flat(ms), "v": flat(vs)},
                 "scheduler": split(scheduler.state_dict(), "scheduler")[0] if scheduler is not None else None,
                 "progress": split(progress, "progress")[0] if progress is not None else None,
                 "next_draws": rng.next_draws(generators), "eval": evaluation or {}}
        path = Path(output) / "summary.json"
        if rank_world()[0] == 0:
            path.write_text(json.dumps({"steps": self.steps, "checkpoint": os.path.basename(checkpoint),
                                        "final": final}))
        return path


def _whole(t: torch.Tensor, gather: bool) -> torch.Tensor:
    """The full tensor of an FSDP2 shard (a collective: every rank, same order); others as they are."""
    return t.full_tensor() if gather and hasattr(t, "full_tensor") else t
