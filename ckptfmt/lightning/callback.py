"""The Lightning callback, ``Checkpointing``: the plugin's other half (names and RNG states in,
RNG states back out) and, by option, what Lightning lacks, run by the run layer's ``Session``
in ModelCheckpoint's directory (spec/RUN.md §11.8). The order in which Lightning calls it is
the package docstring's; it derives from every Lightning namespace's ``Callback`` (``plugin``).
"""
from __future__ import annotations

import os
import signal
from typing import Any

from .. import fsio
from ..errors import IncompleteResumeStateError, UnsupportedSetupError
from ..run import Policy, SavePolicy
from ..run import mirror_thread as mirroring
from ..run.metrics import manifest_value
from ..run.session import Session
from ..run.signals import Flags, Handlers
from ..torch import adapter, optim, ranks, rng
from ..torch import digests as digesting
from ..torch.state import split
from . import files, keeping
from .plugin import NAMESPACES, CheckpointIO, PlainCheckpointWarning
from ..warn import warn

NEEDS_PLUGIN = ("the ckptfmt Checkpointing callback needs its plugin: add ckptfmt.lightning.CheckpointIO() "
                "to Trainer(plugins=[...])")


class Checkpointing(*(ns.Callback for ns in NAMESPACES)):   # type: ignore[misc]
    """The plugin's other half: names and RNG states in (every rank's), RNG states back out; and,
    by option, what Lightning lacks (spec/RUN.md §11.8), run by the run layer's ``Session`` in
    ModelCheckpoint's directory, one per fit, as every other loop's saves are.

    ``restore_rng=False`` resumes without putting the RNG states back (the negative control of
    ``verify-resume``: such a resume diverges). ``signals=True``: SIGUSR1 = a checkpoint at the
    end of the batch, training goes on; SIGTERM (Lightning's own flag) = a checkpoint at the end
    of the batch, then every rank stops as Lightning stops on SIGTERM; both write ``last.ckpt``
    in ModelCheckpoint's directory, so ``fit(ckpt_path="last")`` resumes there.
    ``retention=Policy(...)``: the run layer's retention over the checkpoint directories there.
    ``history=True``: ``.loss.json`` there, one record per training step of the metrics logged;
    with ``digests=True`` each record holds the digests of what a checkpoint restores, as the
    next step finds it (spec/RUN.md §3.9; ``_state_digests``), for ``ckptfmt bisect``.
    ``mirror=URL``: each checkpoint directory there to ``URL/NAME``, verified, on a background
    thread (rank 0; ``run.mirror_thread.Mirroring``, the session's mirror); removed there once
    removed here; caught up at teardown; ``mirroring.report``: what it did.

    Examples:
        Signals, retention, a history with state digests, and a mirror, beside the plugin:

        ```python
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import ModelCheckpoint
        from ckptfmt.lightning import CheckpointIO, Checkpointing
        from ckptfmt.run import Policy

        callback = Checkpointing(signals=True, retention=Policy(keep_last=3), history=True, digests=True)
        trainer = pl.Trainer(max_steps=64, plugins=[CheckpointIO()],
                             callbacks=[callback, ModelCheckpoint(dirpath="ckpt", every_n_train_steps=10,
                                                                  save_top_k=-1, save_last="link")])
        trainer.fit(model, loader, ckpt_path="last")       # resumes from ckpt/last.ckpt when there is one
        ```
    """

    def __init__(self, *, restore_rng: bool = True, signals: bool = False, retention: Policy | None = None,
                 history: bool = False, mirror: str | None = None, digests: bool = digesting.DEFAULT) -> None:
        super().__init__()
        if retention is not None and not isinstance(retention, Policy):
            raise TypeError(f"Checkpointing: retention must be a ckptfmt.run.Policy, got {type(retention).__name__}")
        if digests and not history:
            raise UnsupportedSetupError(None, "Checkpointing(digests=True) records the state digests in the "
                                              "history: give history=True too")
        if mirror is not None:
            mirroring.check_url(mirror)
        self.restore_rng, self.signals, self.retention, self.history, self.mirror, self.digests = \
            restore_rng, signals, retention, history, mirror, digests
        self.mirroring: mirroring.Mirroring | None = None
        self.session: Session | None = None        # the fit's (on_train_start); the plugin closes it
        self._handlers: Handlers | None = None     # ours, setting the session's flags
        self._recorded = 0                         # the newest step given to the session (or resumed)
        self._resumed_at: int | None = None
        self._rng: tuple[dict[str, Any], Any] | None = None     # the RNG states a fit resumed with

    def _options(self) -> bool:
        """An option that works in ModelCheckpoint's directory, through the session, is on."""
        return bool(self.signals or self.retention or self.history or self.mirror)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Refuse a Trainer without the plugin (or, for the options, without a ModelCheckpoint)."""
        if not isinstance(trainer.strategy.checkpoint_io, CheckpointIO):
            raise UnsupportedSetupError(None, NEEDS_PLUGIN)
        if self._options() and trainer.checkpoint_callback is None:
            raise UnsupportedSetupError(None, "Checkpointing(signals=, retention=, history=, mirror=) works in "
                                              "ModelCheckpoint's directory: the Trainer has no ModelCheckpoint")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Refuse before the first step what no save could hold, and the options a ModelCheckpoint
        writing to a URL cannot take (``_refuse_at_url``)."""
        where = getattr(trainer.checkpoint_callback, "dirpath", None)
        if where is not None and fsio.is_url(str(where)):
            self._refuse_at_url(str(where))
        if len(trainer.optimizers) > 1:
            raise UnsupportedSetupError(None, f"{len(trainer.optimizers)} optimizers: the seed layout holds "
                                              "one optimizer's moments")
        adapter.refuse_unheld(pl_module, trainer.optimizers)
        try:
            split(dict(pl_module.hparams), "hyper_parameters")
        except TypeError as exc:
            raise UnsupportedSetupError(None, f"{exc}: the manifest could not hold it") from None

    def _refuse_at_url(self, where: str) -> None:
        """ModelCheckpoint's dirpath is a URL: its checkpoints are written there (``stored``), so
        ``mirror=`` would have nothing to upload."""
        if self.mirror is not None:
            raise UnsupportedSetupError(where, "Checkpointing(mirror=) with a URL dirpath: the checkpoints are "
                                               "written there already; drop mirror=")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """After Lightning registered its signal handlers and made ModelCheckpoint's directory
        known: a resume inside an epoch puts the RNG states back once more (``_inside_epoch``);
        with an option on, the fit's session opens there (``_open``), then our handlers chain
        Lightning's (``_install``)."""
        rng_states, self._rng = self._rng, None
        if rng_states is not None and _inside_epoch(trainer.fit_loop):
            rng.restore_rng(rng_states[0], path=rng_states[1])
        self.session = self._open(trainer) if self._options() else None
        if self.signals:
            self._install(trainer)

    def _open(self, trainer: Any) -> Session:
        """The session of this fit in ModelCheckpoint's directory (every rank: the ranks agree
        through it on one ``TorchCollective``), handed to the plugin, which closes it at teardown.
        Lightning saves: the session has no writer; it keeps the history (rank 0, with
        ``history=True``: a ``resume`` event after a resume), runs retention through ``_retain``
        and wakes the mirror (rank 0) after the saves, and agrees on the signals' flags. It holds
        no lock: ModelCheckpoint's directory is Lightning's."""
        callback, io = trainer.checkpoint_callback, trainer.strategy.checkpoint_io
        url = self.mirror
        mirror = None if url is None else lambda _: mirroring.Mirroring(
            callback.dirpath, url, lock=io.lock, extension=callback.FILE_EXTENSION)
        session = io.session = Session(callback.dirpath, write=None, writer=None, saving=SavePolicy(),
                                       retention=self.retention, collective=ranks.TorchCollective(), lock=False,
                                       handle_signals=False, mirror=mirror, retain=lambda: self._retain(trainer))
        self.mirroring = session.mirror
        self._recorded = self._resumed_at or 0
        if self._resumed_at is not None:
            session.resumed(self._resumed_at, {}, durable=False)
            if self.history:
                session.event("resume", self._resumed_at)
        elif self.history:
            session.event("start", 0, world_size=trainer.world_size)   # a fit from scratch: an earlier one's records are a lost timeline
        return session

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The saves committed since the last batch through the session's commit sequence; the
        step to the history; a checkpoint when a signal asked for one (every rank agrees first)."""
        if self.session is None:
            return
        self._after_saves(trainer)
        stop, save = self._agree(trainer)
        if stop or save:
            callback = trainer.checkpoint_callback
            trainer.save_checkpoint(os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION))
        if stop:
            trainer._signal_connector.received_sigterm = True    # every rank leaves as Lightning leaves on SIGTERM

    def _agree(self, trainer: Any) -> tuple[bool, bool]:
        """(stop, save) as every rank sees them. A step that advanced ``global_step`` goes to the
        session's ``step`` with its metrics (``history=True``), which agrees on the flags in the
        same call; a batch that ends no optimizer step (gradient accumulation), or every batch
        without the history, agrees on them alone (``requests``); without either option, no
        collective at all. Lightning's own SIGTERM flag counts as a stop request too (its
        handler may have run where ours did not)."""
        if self.signals and trainer.received_sigterm:
            self.session.flags.request_stop("SIGTERM")
        step = trainer.global_step
        if self.history and step > self._recorded:
            self._recorded = step
            state = _state_digests(trainer) if self.digests else None     # every rank: a state_dict may be a collective
            return self.session.step(step, _numbers(trainer.callback_metrics), state=state)
        return self.session.requests() if self.signals else (False, False)

    def _after_saves(self, trainer: Any) -> None:
        """The checkpoints the plugin committed since the last call (rank 0: it writes them), as
        one commit, the newest: the session's ``after_commit`` (retention, the mirror woken).
        No ``checkpoint`` event: the history of ModelCheckpoint's directory holds the steps and
        resumes (spec/RUN.md §11.8); each checkpoint's manifest records its commit."""
        done = trainer.strategy.checkpoint_io.taken()
        if done:
            self.session.after_commit(*done[-1])

    def _retain(self, trainer: Any) -> list[str]:
        """Retention over the checkpoint directories (``keeping.prune``), keeping ``last*`` and
        ModelCheckpoint's best and last whatever the policy says; the removed paths."""
        callback = trainer.checkpoint_callback
        keep = [os.path.join(callback.dirpath, n) for n in keeping.names(callback.dirpath)
                if n.startswith(callback.CHECKPOINT_NAME_LAST)]
        return keeping.prune(callback.dirpath, self.retention, keep=[*keep, callback.best_model_path,
                                                                     callback.last_model_path])

    def _install(self, trainer: Any) -> None:
        """SIGUSR1: the session's flag, then the handler found (Lightning's SLURM requeue handler,
        the user's). SIGTERM: the flag, then the handlers Lightning composed except its notifier,
        whose broadcast inside the handler can meet another collective on the other ranks (a
        hang); the ranks agree at the batch's end instead, and Lightning's own flag is set then,
        on every rank, so Lightning still ends the run as it ends it on SIGTERM."""
        usr1, term = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
        notifier = getattr(getattr(trainer, "_signal_connector", None), "_sigterm_notifier_fn", None)
        handlers = getattr(term, "signal_handlers", [term])          # Lightning's _HandlersCompose
        self._handlers = Handlers(self.session.flags, Flags.note_and_chain, (signal.SIGUSR1, signal.SIGTERM))
        if not self._handlers.install({signal.SIGUSR1: [usr1], signal.SIGTERM: [h for h in handlers if h != notifier]}):
            warn("Checkpointing(signals=True): signals are not handled: the Trainer runs outside the "
                          "main thread, where Python lets no handler be installed")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Retention after the last saves (committed first: an async one is waited for); the
        signal handlers given back. The session stays open for ModelCheckpoint's own saves at
        the end of training: the plugin's teardown closes it."""
        trainer.strategy.checkpoint_io.wait()
        if self.session is not None:
            self._after_saves(trainer)
        self._give_back()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """A run that ends by an exception (Lightning's SIGTERMException too) gives the signal
        handlers back; the plugin's teardown closes the session after the save in flight."""
        self._give_back()

    def _give_back(self) -> None:
        if self._handlers is not None:
            self._handlers.restore()
            self._handlers = None
        self._resumed_at = self._rng = None

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Add the RNG states (every rank's: a collective), each param group's parameter names
        and the metrics logged, for the plugin; the history is synced before the commit."""
        ours = {"rng": rng.rng_state(), "namespace": type(trainer).__module__.split(".")[0],
                "members": [optim.members(pl_module, o) for o in trainer.optimizers],
                "metrics": {k: {"value": manifest_value(v), "step": trainer.global_step}
                            for k, v in _numbers(trainer.callback_metrics).items()}}
        everyone = ranks.per_rank({"rng": ours["rng"]})
        if everyone is not None:
            ours["ranks"] = everyone
        checkpoint[files.KEY] = ours
        if self.history and self.session is not None:
            self.session.run.history.sync()

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Put this rank's RNG states back when fitting (a checkpoint without them is refused);
        kept for ``on_train_start``, which puts them back once more inside an epoch."""
        if trainer.state.fn != "fit":
            return                   # validate/test/predict draw nothing a resume must repeat
        self._resumed_at = int(checkpoint.get("global_step", 0))
        ours = checkpoint.get(files.KEY) or {}
        if ours.get("plain"):
            warn(f"{ours['path']}: a plain Lightning .ckpt (TorchCheckpointIO) holds no RNG states: "
                          "resumed as Lightning resumes it, not bit-exactly", PlainCheckpointWarning)
            return
        if self.restore_rng:
            self._rng = (_rank_rng(ours, trainer.global_rank, trainer.world_size), ours.get("path"))
            rng.restore_rng(self._rng[0], path=self._rng[1])


def _inside_epoch(fit_loop: Any) -> bool:
    """The fit resumed inside an epoch, before its last batch: the loader's iterator, made since
    the RNG states came back (``fit_loop.setup_data``: a stateful loader's state loaded, then
    ``iter()``), goes on with the epoch the straight run had begun, so a draw it made (torchdata's
    ``StatefulDataLoader`` draws its base seed from torch's RNG) is none the straight run made
    after the save. At an epoch's last batch ``iter()`` begins the next epoch, whose draws the
    straight run made after the save: the RNG states stay as it left them (a ``StatefulDataLoader``
    makes its finished iterator first, one draw more: not yet bit-exact, spec/RUN.md §11.4)."""
    return bool(fit_loop.restarted_mid_epoch and not fit_loop.epoch_loop.batch_progress.is_last_batch)


def _rank_rng(ours: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """This rank's RNG states: its own entry of ``ranks`` (a checkpoint of several processes),
    else, in one process, the checkpoint's ``rng``; refused by name where there is none."""
    entries = ours.get("ranks")
    if isinstance(entries, list) and rank < len(entries) and len(entries) == world:
        return entries[rank]["rng"]
    if ours.get("rng") is None or world > 1:
        saved = len(entries) if isinstance(entries, list) else 1
        raise IncompleteResumeStateError(ours.get("path"), "cannot resume bit-exactly: the checkpoint lacks "
                                         + ("rng (saved without the Checkpointing callback)" if ours.get("rng") is None
                                            else f"rank {rank}'s rng (saved by {saved} process(es), resumed by {world})"))
    return ours["rng"]


def _state_digests(trainer: Any) -> dict[str, Any]:
    """The history's state digests (spec/RUN.md §3.9) of what a Lightning checkpoint restores, as
    the next step finds it (``on_train_batch_end`` runs after the optimizer's and the step-interval
    schedulers' steps): the RNGs the callback saves (every CUDA device's), each param group's lr
    and the optimizer's step, the schedulers' states (``scheduler``: one's ``state_dict()``, or
    the list of several, as the checkpoint's ``lr_schedulers``), the precision plugin's
    GradScaler (``amp.scaler``, ``amp.scale``) and each stateful training loader's state
    (``state.train_loader``, ``.I`` of several: what ``fit_loop`` saves, its ``digest_every`` kept)."""
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    pieces: list[tuple[str, Any]] = []
    if schedulers:
        pieces.append(("scheduler", schedulers[0] if len(schedulers) == 1
                       else digesting.Held([s.state_dict() for s in schedulers])))
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        pieces.append(("amp.scaler", scaler))
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = [dl for dl in getattr(combined, "flattened", None) or []
               if callable(getattr(dl, "state_dict", None)) and callable(getattr(dl, "load_state_dict", None))]
    pieces += [("state.train_loader" + (f".{i}" if len(loaders) > 1 else ""), dl) for i, dl in enumerate(loaders)]
    return digesting.state_digests(optimizer=trainer.optimizers[0] if trainer.optimizers else None, pieces=pieces,
                                   generators={}, scaler=scaler, step=trainer.global_step)


def _numbers(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics that are one number (Lightning's ``callback_metrics`` are 0-d tensors)."""
    return {k: v for k, v in metrics.items() if manifest_value(v) is not None}
