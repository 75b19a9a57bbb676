"""Hugging Face: a ``transformers.Trainer`` callback that saves on SIGTERM / SIGUSR1 and commits
every ``checkpoint-N`` with a blake3 record, and the resume choice that checks them (spec/RUN.md
§12). accelerate needs nothing here: ``CheckpointManager`` and ``ckptfmt.torch.save`` take what
``Accelerator.prepare`` returns.

    from ckptfmt.hf import Checkpointing, resume_path
    ckpt = Checkpointing(retention=Policy(keep_last=3))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ckpt])
    trainer.train(resume_from_checkpoint=resume_path(args.output_dir))
    if ckpt.stopped_by_signal:
        sys.exit(0)                       # checkpoint committed; skip evaluation, exit 0

transformers is imported when ``Checkpointing`` is first asked for (the extra ``ckptfmt[hf]``);
``resume_path`` needs neither transformers nor torch.
"""
from __future__ import annotations

from typing import Any

from ..tools.hfrun import resume_path, retain

__all__ = ["Checkpointing", "resume_path", "retain"]


def __getattr__(name: str) -> Any:
    if name == "Checkpointing":
        from .callback import Checkpointing     # lazy: transformers only when the callback is used
        return Checkpointing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
