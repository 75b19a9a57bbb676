"""The Lightning classes: ``CheckpointIO`` (the plugin) and ``Checkpointing`` (its callback);
the order in which Lightning calls them is the package docstring's.

Each class derives from the base of every Lightning namespace installed (``pytorch_lightning``,
``lightning.pytorch``), so a Trainer of either accepts it: Lightning checks plugins and
callbacks with ``isinstance`` against its own namespace's classes.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .. import atomic, fsio
from ..errors import IncompleteResumeStateError, MissingDependencyError, UnsupportedSetupError
from ..run import History, Policy
from ..run import mirror_thread as mirroring
from ..run.segments import SegmentedHistory
from ..run.metrics import history_value, manifest_value
from ..run.signals import Flags, Handlers
from ..torch import adapter, optim, ranks, rng
from ..torch.state import split
from . import files, keeping, stored

try:
    import pytorch_lightning
except ImportError:         # the other namespace may be the one installed
    pytorch_lightning = None
try:
    import lightning.pytorch as lightning_pytorch
except ImportError:
    lightning_pytorch = None

NAMESPACES = tuple(ns for ns in (pytorch_lightning, lightning_pytorch) if ns is not None)
if not NAMESPACES:
    raise MissingDependencyError(None, "ckptfmt.lightning needs Lightning: pip install 'ckptfmt[lightning]' "
                                       "(pytorch-lightning)")


class PlainCheckpointWarning(UserWarning):
    """A plain ``.ckpt`` was resumed: weights, optimizer and loops, but no RNG states."""


NEEDS_PLUGIN = ("the ckptfmt Checkpointing callback needs its plugin: add ckptfmt.lightning.CheckpointIO() "
                "to Trainer(plugins=[...])")


class CheckpointIO(*(ns.plugins.io.CheckpointIO for ns in NAMESPACES)):   # type: ignore[misc]
    """Lightning's checkpoints as directories of one ckptfmt generation (``files``): written
    durably in one rename, verified by blake3 before they are loaded, removed durably; at a URL
    (ModelCheckpoint's ``dirpath="s3://..."``) as one generation under that prefix, written
    straight to the store, removed manifest first (``stored``).
    ``written``: the paths committed since the callback last applied its retention.

    ``async_save=True``: ``save_checkpoint`` copies the dict's tensors (the stall: one copy of
    weights and moments in memory) and returns; a thread writes them. One save at a time: the
    next save, a load, a removal and the end of training (``teardown``) wait for it, so an older
    checkpoint is only removed once the newer one is committed; a failed background save is
    raised there, naming its path.

    ``mirror`` (set by the callback's ``mirror=URL``): woken after each commit and removal,
    closed at ``teardown`` once the URL caught up; ``lock`` is held while a directory is
    written, so the mirror never links one halfway through its replacement."""

    def __init__(self, *, async_save: bool = False) -> None:
        super().__init__()
        self.async_save = async_save
        self.written: list[str] = []
        self.lock = threading.Lock()
        self.mirror: mirroring.Mirroring | None = None
        self._pending: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._stored = stored.Checkpoints()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Write ``checkpoint`` at ``path`` as a directory of one generation (``files.write``; a
        URL: ``stored.write``)."""
        if storage_options is not None:
            raise UnsupportedSetupError(str(path), "storage_options are not supported by the ckptfmt plugin")
        self.wait()
        if not self.async_save:
            return self._commit(checkpoint, str(path))
        staged = _copy(checkpoint)
        self._pending = threading.Thread(target=self._write, args=(staged, str(path)), name="ckptfmt-save", daemon=True)
        self._pending.start()

    def _write(self, checkpoint: dict[str, Any], path: str) -> None:
        try:
            self._commit(checkpoint, path)
        except BaseException as exc:    # noqa: BLE001 - raised in the training thread by wait()
            self._failed = exc

    def _commit(self, checkpoint: dict[str, Any], path: str) -> None:
        with self.lock:
            self.home(path).write(checkpoint, path)
        self.written.append(path)
        self.changed()

    def home(self, path: Any) -> Any:
        """Where the checkpoint at ``path`` lives: at a URL (object storage) ``stored``, through
        this plugin's clients, else ``files`` (a local directory); each writes, reads, removes."""
        return self._stored if fsio.is_url(str(path)) else files

    def changed(self) -> None:
        """A checkpoint was committed or removed: wake the mirror, if any (it does not wait)."""
        if self.mirror is not None:
            self.mirror.wake()

    def wait(self) -> None:
        """Wait for the background save, if any; raise its error."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        """The dict, its tensors on the CPU (Lightning moves them to the module's device; nothing
        is unpickled, whatever ``weights_only`` says)."""
        self.wait()
        return self.home(path).read(path)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove exactly ``path``, durably (``files.remove``; at a URL manifest first,
        ``stored.remove``), once the save in flight committed."""
        self.wait()
        self.home(path).remove(path)
        self.changed()

    def teardown(self) -> None:
        """The end of training: the save in flight is committed (or its error raised); the
        mirror, if any, catches up and ends (it never raises)."""
        try:
            self.wait()
        finally:
            mirror, self.mirror = self.mirror, None
            if mirror is not None:
                mirror.close()


def _copy(value: Any, memo: dict[Any, Any] | None = None) -> Any:
    """``value`` with every tensor copied (on the CPU; a tensor seen twice, tied weights, copied
    once) and every container rebuilt: what a background save writes while training goes on."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(),
               value.dtype, value.device) if value.numel() else id(value)
        if key not in memo:
            memo[key] = value.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(value, dict):
        items = [(k, _copy(v, memo)) for k, v in value.items()]
        return dict(items) if type(value) is dict else type(value)(items)
    if isinstance(value, (list, tuple)):
        copied = [_copy(v, memo) for v in value]
        return type(value)(*copied) if hasattr(value, "_fields") else type(value)(copied)
    return value


class Checkpointing(*(ns.Callback for ns in NAMESPACES)):   # type: ignore[misc]
    """The plugin's other half: names and RNG states in (every rank's), RNG states back out; and,
    by option, what Lightning lacks (spec/RUN.md §11.8).

    ``restore_rng=False`` resumes without putting the RNG states back (the negative control of
    ``verify-resume``: such a resume diverges). ``signals=True``: SIGUSR1 = a checkpoint at the
    end of the batch, training goes on; SIGTERM (Lightning's own flag) = a checkpoint at the end
    of the batch, then every rank stops as Lightning stops on SIGTERM; both write ``last.ckpt``
    in ModelCheckpoint's directory, so ``fit(ckpt_path="last")`` resumes there.
    ``retention=Policy(...)``: the run layer's retention over the checkpoint directories there.
    ``history=True``: ``.loss.json`` there, one record per step of the metrics logged.
    ``mirror=URL``: each checkpoint directory there to ``URL/NAME``, verified, on a background
    thread (rank 0; ``run.mirror_thread.Mirroring``); removed there once removed here; caught up at teardown;
    ``mirroring.report``: what it did."""

    def __init__(self, *, restore_rng: bool = True, signals: bool = False, retention: Policy | None = None,
                 history: bool = False, mirror: str | None = None) -> None:
        super().__init__()
        if retention is not None and not isinstance(retention, Policy):
            raise TypeError(f"Checkpointing: retention must be a ckptfmt.run.Policy, got {type(retention).__name__}")
        if mirror is not None:
            mirroring.check_url(mirror)
        self.restore_rng, self.retention, self.history, self.mirror = restore_rng, retention, history, mirror
        self.mirroring: mirroring.Mirroring | None = None
        self._flags = Flags()                      # set by our handlers, read at a batch's end
        self._signals = Handlers(self._flags, Flags.note_and_chain, (signal.SIGUSR1, signal.SIGTERM)) \
            if signals else None
        self._log: History | SegmentedHistory | None = None
        self._resumed_at: int | None = None
        self._rng: tuple[dict[str, Any], Any] | None = None     # the RNG states a fit resumed with

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Refuse a Trainer without the plugin (or, for the options, without a ModelCheckpoint)."""
        if not isinstance(trainer.strategy.checkpoint_io, CheckpointIO):
            raise UnsupportedSetupError(None, NEEDS_PLUGIN)
        if (self._signals or self.retention or self.history or self.mirror) and trainer.checkpoint_callback is None:
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
        """After Lightning registered its signal handlers: ours for SIGUSR1 chains theirs; the
        history opens (rank 0), with a ``resume`` event after a resume; the mirror starts (rank 0);
        a resume inside an epoch puts the RNG states back once more (``_inside_epoch``)."""
        rng_states, self._rng = self._rng, None
        if rng_states is not None and _inside_epoch(trainer.fit_loop):
            rng.restore_rng(rng_states[0], path=rng_states[1])
        if self._signals is not None:
            self._install(trainer)
        if self.mirror is not None and trainer.is_global_zero:
            callback, io = trainer.checkpoint_callback, trainer.strategy.checkpoint_io
            self.mirroring = io.mirror = mirroring.Mirroring(callback.dirpath, self.mirror, lock=io.lock,
                                                             extension=callback.FILE_EXTENSION)
        if self.history and trainer.is_global_zero:
            self._log = _history(trainer.checkpoint_callback.dirpath)
            if self._resumed_at is not None:
                self._log.event("resume", self._resumed_at)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The step's metrics to the history, retention after the saves since the last batch, and
        a checkpoint when a signal asked for one (every rank agrees first)."""
        if self._log is not None:
            self._log.append({"step": trainer.global_step, "time": time.time(),
                              **{k: history_value(v) for k, v in _numbers(trainer.callback_metrics).items()}})
        self._prune(trainer)
        if self._signals is not None:
            self._on_signals(trainer)

    def _install(self, trainer: Any) -> None:
        """SIGUSR1: our flag, then the handler found (Lightning's SLURM requeue handler, the
        user's). SIGTERM: our flag, then the handlers Lightning composed except its notifier,
        whose broadcast inside the handler can meet another collective on the other ranks
        (a hang); the ranks agree at the batch's end instead, and Lightning's own flag is set
        then, on every rank, so Lightning still ends the run as it ends it on SIGTERM."""
        usr1, term = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
        notifier = getattr(getattr(trainer, "_signal_connector", None), "_sigterm_notifier_fn", None)
        handlers = getattr(term, "signal_handlers", [term])          # Lightning's _HandlersCompose
        if not self._signals.install({signal.SIGUSR1: [usr1], signal.SIGTERM: [h for h in handlers if h != notifier]}):
            warnings.warn("Checkpointing(signals=True): signals are not handled: the Trainer runs outside the "
                          "main thread, where Python lets no handler be installed", stacklevel=2)

    def _on_signals(self, trainer: Any) -> None:
        usr1 = self._flags.pop_save()
        term = self._flags.pop_stop() or bool(trainer.received_sigterm)
        usr1, term = ranks.TorchCollective().agree(usr1, term)       # a signal reaches one process: any rank's asks for all
        if usr1 or term:
            callback = trainer.checkpoint_callback
            trainer.save_checkpoint(os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION))
        if term:
            trainer._signal_connector.received_sigterm = True    # every rank leaves as Lightning leaves on SIGTERM

    def _prune(self, trainer: Any) -> None:
        io = trainer.strategy.checkpoint_io
        saved, io.written = bool(io.written), []
        if self.retention is None or not trainer.is_global_zero or not saved:
            return
        callback = trainer.checkpoint_callback
        keep = [os.path.join(callback.dirpath, n) for n in keeping.names(callback.dirpath)
                if n.startswith(callback.CHECKPOINT_NAME_LAST)]
        if keeping.prune(callback.dirpath, self.retention, keep=[*keep, callback.best_model_path, callback.last_model_path]):
            io.changed()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Retention after the last saves (committed first: an async one is waited for); the
        signal handlers given back, the history closed."""
        trainer.strategy.checkpoint_io.wait()
        self._prune(trainer)
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """A run that ends by an exception (Lightning's SIGTERMException too) gives the signal
        handlers back and closes the history."""
        self._close()

    def _close(self) -> None:
        if self._signals is not None:
            self._signals.restore()
        if self._log is not None:
            self._log.close()
            self._log = None
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
        if self._log is not None:
            self._log.sync()

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Put this rank's RNG states back when fitting (a checkpoint without them is refused);
        kept for ``on_train_start``, which puts them back once more inside an epoch."""
        if trainer.state.fn != "fit":
            return                   # validate/test/predict draw nothing a resume must repeat
        self._resumed_at = int(checkpoint.get("global_step", 0))
        ours = checkpoint.get(files.KEY) or {}
        if ours.get("plain"):
            warnings.warn(f"{ours['path']}: a plain Lightning .ckpt (TorchCheckpointIO) holds no RNG states: "
                          "resumed as Lightning resumes it, not bit-exactly", PlainCheckpointWarning, stacklevel=2)
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


def _history(where: Any) -> "History | SegmentedHistory":
    """The history in ModelCheckpoint's directory: ``.loss.json`` there; at a URL, numbered
    segments under ``.loss.d/`` (an object cannot be appended to: ``run.segments``)."""
    if fsio.is_url(str(where)):
        from ..store.objects import ObjectStore     # fsspec only when a URL is given
        return SegmentedHistory(ObjectStore(str(where)))
    atomic.make_durable_dir(Path(where))            # made by its first save: made now for the history
    return History(os.path.join(where, ".loss.json"))


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


def _numbers(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics that are one number (Lightning's ``callback_metrics`` are 0-d tensors)."""
    return {k: v for k, v in metrics.items() if manifest_value(v) is not None}
