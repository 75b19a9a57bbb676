"""The Lightning plugin, ``CheckpointIO``, and what the Lightning classes share (``NAMESPACES``);
its callback, ``Checkpointing``, is ``callback``'s. The order in which Lightning calls the pair
is the package docstring's.

Each class derives from the base of every Lightning namespace installed (``pytorch_lightning``,
``lightning.pytorch``), so a Trainer of either accepts it: Lightning checks plugins and
callbacks with ``isinstance`` against its own namespace's classes.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from .. import fsio
from ..errors import MissingDependencyError, UnsupportedSetupError
from ..run.session import Session
from . import files, stored

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
    """A plain ``.ckpt`` was resumed: weights, optimizer and loops, but no RNG states.

    Examples:
        A plain ``.ckpt`` of Lightning's own ``TorchCheckpointIO``, resumed through the plugin:

        ```python
        import warnings
        from ckptfmt.lightning import PlainCheckpointWarning

        with warnings.catch_warnings():
            warnings.simplefilter("error", PlainCheckpointWarning)      # refuse a resume without RNG states
            trainer.fit(model, loader, ckpt_path="old/epoch=3-step=400.ckpt")
        ```
    """


class CheckpointIO(*(ns.plugins.io.CheckpointIO for ns in NAMESPACES)):   # type: ignore[misc]
    """Lightning's checkpoints as directories of one ckptfmt generation (``files``): written
    durably in one rename, verified by blake3 before they are loaded, removed durably; at a URL
    (ModelCheckpoint's ``dirpath="s3://..."``) as one generation under that prefix, written
    straight to the store, removed manifest first (``stored``).
    ``written``: (step, ``{"metrics": ...}`` as its manifest records them) of each checkpoint
    committed since the callback last took them (``taken``), for its session's commit sequence.

    ``async_save=True``: ``save_checkpoint`` copies the dict's tensors (the stall: one copy of
    weights and moments in memory) and returns; a thread writes them. One save at a time: the
    next save, a load, a removal and the end of training (``teardown``) wait for it, so an older
    checkpoint is only removed once the newer one is committed; a failed background save is
    raised there, naming its path.

    ``session`` (the callback's, one per fit: ``run.session.Session``): its mirror, if any, is
    woken after each commit and removal; it is closed at ``teardown``, after the last save of the
    fit (ModelCheckpoint's at the end of training or on an exception too), so the mirror's last
    pass and the history's close come after it. ``lock`` is held while a directory is written,
    so the mirror never links one halfway through its replacement.

    Examples:
        With the callback, in any ``Trainer`` (the tutorial's ``fit.py``):

        ```python
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import ModelCheckpoint
        from ckptfmt.lightning import CheckpointIO, Checkpointing

        trainer = pl.Trainer(max_steps=64, plugins=[CheckpointIO()],
                             callbacks=[Checkpointing(), ModelCheckpoint(dirpath="ckpt", every_n_train_steps=10)])
        trainer.fit(model, loader)
        ```
    """

    def __init__(self, *, async_save: bool = False) -> None:
        super().__init__()
        self.async_save = async_save
        self.written: list[tuple[int, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.session: Session | None = None
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
        ours = checkpoint.get(files.KEY) or {}
        self.written.append((int(checkpoint.get("global_step", 0)), {"metrics": ours.get("metrics") or {}}))
        self.changed()

    def taken(self) -> list[tuple[int, dict[str, Any]]]:
        """``written``, emptied (a save thread may append meanwhile: what it appends stays)."""
        count = len(self.written)
        taken = self.written[:count]
        del self.written[:count]
        return taken

    def home(self, path: Any) -> Any:
        """Where the checkpoint at ``path`` lives: at a URL (object storage) ``stored``, through
        this plugin's clients, else ``files`` (a local directory); each writes, reads, removes."""
        return self._stored if fsio.is_url(str(path)) else files

    def changed(self) -> None:
        """A checkpoint was committed or removed: wake the session's mirror, if any (it does not wait)."""
        mirror = self.session.mirror if self.session is not None else None
        if mirror is not None:
            mirror.wake()

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
        """The end of training: the save in flight is committed (or its error raised); then the
        fit's session is closed (its mirror catches up and ends, never raising; its history closed)."""
        try:
            self.wait()
        finally:
            session, self.session = self.session, None
            if session is not None:
                session.close()


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
