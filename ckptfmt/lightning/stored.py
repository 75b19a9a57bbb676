"""A Lightning checkpoint on object storage (spec/RUN.md §11.10), without Lightning: what
``files`` does for a local directory, for the URL Lightning chose under a URL dirpath
(``ModelCheckpoint(dirpath="s3://bucket/run")`` names ``s3://bucket/run/epoch=0-step=8.ckpt``).

The URL is a prefix holding one generation, as the local directory does: ``step_N.bin``, its
companion and its manifest, written straight to the store by the same path a run on a store
writes with (``store.writing.save``: the ``.bin`` streamed up hashed, every part confirmed on
the store, the manifest last), nothing staged on local disk. ``read`` reads the newest committed
generation there into memory, every part's blake3 checked before any value is returned;
``remove`` takes each generation there manifest first (``Generation.remove``), so a checkpoint
half removed never reads as committed.

A checkpoint saved again at its URL (``last.ckpt``) is written beside the old generation and the
old one removed once the new one is committed; a save of the same step takes the old one away
first. A kill between the two leaves both, and readers take the newest step.
"""
from __future__ import annotations

from typing import Any

from .. import format as fmt
from .. import kinds, statemap
from ..errors import NoValidGenerationError, NotACheckpointError, SaveError
from ..generation import Generation, by_step
from ..store import writing
from . import files

__all__ = ["Checkpoints", "write", "read", "remove", "lightning"]


class Checkpoints:
    """``write``, ``read`` and ``remove`` of the checkpoints at URLs, one client per folder
    (ModelCheckpoint's dirpath): each checkpoint's store is that folder's ``under`` its name,
    so a save does not pay for a new connection (the plugin keeps one of these)."""

    def __init__(self) -> None:
        self._folders: dict[str, Any] = {}

    def store(self, url: str) -> Any:
        from ..store.objects import ObjectStore    # fsspec only when a URL is given
        folder, _, name = url.rstrip("/").rpartition("/")
        if folder not in self._folders:
            self._folders[folder] = ObjectStore(folder)
        return self._folders[folder].under(name)

    def write(self, checkpoint: dict[str, Any], url: str) -> str:
        return write(checkpoint, url, self.store(url))

    def read(self, url: str) -> dict[str, Any]:
        return read(url, self.store(url))

    def remove(self, url: str) -> None:
        return remove(url, self.store(url))


def _store(url: str) -> Any:
    return Checkpoints().store(url)


def write(checkpoint: dict[str, Any], url: str, store: Any = None) -> str:
    """Write Lightning's ``checkpoint`` at ``url`` as one generation (``files.prepare``'s state,
    ``statemap.mapped``'s arguments, ``writing.save``); returns the ``.bin``'s URL. ``store``:
    the ``ObjectStore`` of ``url``, where the caller has one (``Checkpoints``)."""
    state, step, fields = files.prepare(checkpoint, url)
    store = store or _store(url)
    there = list(by_step(store).values())        # an older last.ckpt's, or what a killed save left
    for gen in there:
        if gen.step == step:
            gen.remove()
    step, arrays, how = statemap.mapped(state, url, step, fields)
    writing.save(store, step, *arrays, **how)
    for gen in there:
        if gen.step != step:
            gen.remove()
    return store.where(fmt.checkpoint_name(step))


def _newest(store: Any, url: str) -> Generation:
    """The newest committed generation at ``url``; refused in one line where there is none."""
    committed = [g for g in by_step(store).values() if g.committed]
    if committed:
        return committed[-1]
    if store.entries():
        raise NoValidGenerationError(url, "holds no committed ckptfmt generation of a Lightning checkpoint")
    raise NotACheckpointError(url, "no checkpoint at this URL (the ckptfmt plugin reads the checkpoints it wrote "
                                   "there; a plain .ckpt object is not one)")


def read(url: str, store: Any = None) -> dict[str, Any]:
    """The dict Lightning wrote at ``url``, from its newest generation read into memory, every
    part's blake3 checked first (``Generation.open``); ``files.KEY`` as ``files.read`` gives it."""
    store = store or _store(url)
    gen = _newest(store, url)
    ck = gen.open(verify=True)
    where = store.where(gen.bin.name)
    if not lightning(ck.manifest):
        raise NoValidGenerationError(url, "holds a generation that is not a Lightning checkpoint (its manifest "
                                          "has no lightning field)")
    return files.to_dict(statemap.read_bin(where, ck), where)


def remove(url: str, store: Any = None) -> None:
    """Remove the checkpoint at ``url``: each generation there manifest first, then its parts;
    a prefix that holds something else than the plugin's generations is refused, never deleted."""
    store = store or _store(url)
    there = list(by_step(store).values())
    committed = [g for g in there if g.committed]
    if (committed and not lightning(committed[-1].read_manifest())) or (not there and store.entries()):
        raise SaveError(url, "not a Lightning checkpoint the ckptfmt plugin wrote; refusing to delete it")
    for gen in reversed(there):
        gen.remove()


def lightning(doc: dict[str, Any] | None) -> bool:
    """The manifest is a Lightning checkpoint's (it has the ``lightning`` field)."""
    return isinstance((doc or {}).get(kinds.LIGHTNING), dict)
