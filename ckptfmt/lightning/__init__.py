"""Lightning's checkpoints as ckptfmt generations (spec/RUN.md §11): a user adds two things,

    Trainer(plugins=[ckptfmt.lightning.CheckpointIO()], callbacks=[ckptfmt.lightning.Checkpointing(), ...])

and ``fit(ckpt_path=PATH)`` / ``fit(ckpt_path="last")`` resume bit-exactly, verified by blake3.

The pair's contract, in the order Lightning calls it (every rank under DDP):

1. ``Checkpointing.setup`` (every stage): refuses a Trainer whose ``CheckpointIO`` is not the
   plugin, and one without a ModelCheckpoint when an option needs its directory, in one line.
2. ``CheckpointIO.load_checkpoint`` (``fit(ckpt_path=...)``, before anything reaches the
   module): the generation is verified (blake3 of ``.bin`` and companion), then mapped back
   into Lightning's dict (``files.read``); a plain ``.ckpt`` file is read with
   ``torch.load(weights_only=True)``.
3. ``Checkpointing.on_load_checkpoint`` (when fitting, before ``configure_optimizers``): puts
   this rank's RNG states back; a checkpoint without them is refused by name; a plain ``.ckpt``
   resumes without them, with a ``PlainCheckpointWarning``.
4. ``Checkpointing.on_fit_start`` (after ``configure_optimizers``, before the first step):
   refuses what a save could not hold (several optimizers, one the seed layout cannot hold,
   optimizer tensors outside the module, hyper-parameters JSON cannot hold) before training.
5. ``Checkpointing.on_train_start`` (after Lightning registered its signal handlers and made the
   training loader's iterator from its loaded state): a fit resumed inside an epoch gets step
   3's RNG states once more (that iterator's draw is none the straight run made); with an
   option on, opens the fit's ``run.session.Session`` in ModelCheckpoint's directory (every
   rank; handed to the plugin, which closes it): with ``history=True`` its history,
   ``.loss.json`` there (rank 0), with ``mirror=URL`` its mirror (rank 0,
   ``run.mirror_thread.Mirroring``), which makes a first pass at once; with ``signals=True``
   installs SIGUSR1 and SIGTERM handlers that set the session's flags and chain the ones found.
6. ``Checkpointing.on_train_batch_end`` (before ModelCheckpoint's, every batch): the
   checkpoints committed since the last batch through the session's ``after_commit``
   (retention, the mirror woken); the step to the session's ``step`` when ``global_step``
   advanced (its metrics to the history, with ``digests=True`` the state digests of what a
   checkpoint restores; the ranks agree on the signal flags), else the flags
   alone (``requests``); if one was raised, ``last.ckpt`` is saved.
7. ``Checkpointing.on_save_checkpoint`` (inside Lightning's ``dump_checkpoint``, every rank; a
   collective under DDP): adds ``checkpoint["ckptfmt"]``: the RNG states Lightning does not save
   (Python, NumPy, torch CPU, the CUDA device in use; every rank's), each param group's
   parameter names, read off the live optimizer, and the logged metrics; syncs the history.
8. ``CheckpointIO.save_checkpoint`` (rank 0): the dict becomes a directory at Lightning's path
   (``files.write``), or at a URL (a URL ``dirpath``) one generation written straight to the
   store under that prefix (``stored.write``); without step 7's entry a full checkpoint is
   refused, naming the callback.
   With ``async_save=True`` a copy is written by a thread; steps 2, 8, 9 and 11 wait for it.
   After the commit the mirror, if any, is woken (it returns at once).
9. ``CheckpointIO.remove_checkpoint`` (top-k, an older ``last``): removes exactly that path (at
   a URL each generation there, manifest first);
   the mirror is woken (it removes the path at the URL once the newer ones are there).
10. ``Checkpointing.on_train_end`` / ``on_exception``: retention once more (after a fit), the
    signal handlers given back.
11. ``CheckpointIO.teardown`` (the strategy's teardown, after a fit and after an exception,
    after ModelCheckpoint's last saves): the save in flight is committed; the session is closed:
    the mirror makes its last pass (a failed one retried), then ends (what it could not send is
    logged, never raised), the history is closed.

``files``, ``stored`` and ``keeping`` need torch, the core and the run layer only (``stored``
fsspec too, when a URL is given); the session and the mirror are the run layer's
(``run.session``, ``run.mirror_thread``); the Lightning classes (``plugin``, ``callback``) are
imported on first use, so ``import ckptfmt.lightning`` works without
Lightning and says what to install when a class is asked for.
"""
from __future__ import annotations

from typing import Any

from .files import generation_in, read, remove, write

__all__ = ["CheckpointIO", "Checkpointing", "PlainCheckpointWarning", "generation_in", "read", "remove", "write"]


def __getattr__(name: str) -> Any:
    if name in ("CheckpointIO", "PlainCheckpointWarning"):
        from . import plugin        # imports Lightning: only when its classes are asked for
        return getattr(plugin, name)
    if name == "Checkpointing":
        from . import callback
        return callback.Checkpointing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
