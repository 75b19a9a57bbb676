"""``ckptfmt train``'s entry point: the run opened (a local run directory, or a URL: a run on
object storage, spec/RUN.md §2.0.2), its writer lock held, the trainer built, resumed and fitted;
under torchrun, ``distributed.train_distributed``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import atomic
from ..fsio import is_url
from ..run import LOCK
from ..run.signals import Flags
from ..run.storerun import open_run
from ..torch.distributed import launched_by_torchrun
from . import config as cfgmod
from .distributed import train_distributed
from .loop import Trainer
from .protocol import Observer


def train(run_dir: str, config_name: str, steps: int, *, seed: int | None = None,
          threads: int | None = None, sets: dict[str, Any] | None = None, flags: Flags | None = None,
          summary: str | None = None, pause_at: tuple[int, str] | None = None,
          dist_timeout: float = 120, **options: Any) -> int:
    """Entry point used by ``ckptfmt train``: lock the run, build, resume, fit; the exit code.

    ``options`` are the Trainer's (device, cadences, retention, amp, omit_rng_restore, ...).
    The verifier's hooks (trainer/protocol.py), single process only: ``summary`` writes its
    summary.json there at exit; ``pause_at=(N, MARKER)`` creates MARKER after step N and waits
    for a signal. Under torchrun (``WORLD_SIZE`` > 1), ``dist_timeout`` seconds bound every
    collective. ``flags``: what signals asked for (``ckptfmt train`` sets them from its start).
    """
    flags = flags if flags is not None else Flags()
    cfg = cfgmod.for_run(config_name, sets, seed, threads)
    made = [] if is_url(run_dir) else atomic.missing_dirs(run_dir)   # a stop during start-up takes these away again
    try:
        return _train(run_dir, cfg, steps, flags, summary, pause_at, dist_timeout, made, options)
    finally:
        if flags.stop:
            atomic.remove_dirs(made)          # only if still empty: nothing was written


def _train(run_dir: str, cfg: Any, steps: int, flags: Flags, summary: str | None,
           pause_at: tuple[int, str] | None, dist_timeout: float, made: list[Any], options: dict[str, Any]) -> int:
    run = open_run(run_dir, create=True)
    if flags.stop:
        return 0
    if launched_by_torchrun():
        if summary or pause_at:
            raise ValueError("summary and pause_at are single-process only (not under torchrun)")
        return train_distributed(run_dir, steps, lambda run, log: Trainer(run, cfg, flags=flags, log=log, **options),
                                 device=options.get("device", "auto"), timeout_s=dist_timeout)
    lock, trainer = run.writer_lock("trainer"), None
    try:
        trainer = Trainer(run, cfg, flags=flags, **options)
        trainer.build()
        if flags.stop:        # SIGTERM during start-up: nothing new is written
            # a run directory this command made holds only its .lock: that goes too (held)
            lock.transient = bool(made) and [p.name for p in Path(run_dir).iterdir()] == [LOCK]
            return 0
        observer = Observer(trainer, pause_at) if summary or pause_at else None
        try:
            code = trainer.fit(steps, on_step=observer.on_step if observer else None)
            if summary and code == 0:
                observer.write(summary)
            return code
        finally:
            trainer.close()
    finally:
        trainer.release(lock) if trainer is not None else lock.release()
