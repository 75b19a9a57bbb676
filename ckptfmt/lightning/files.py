"""A Lightning checkpoint on disk (spec/RUN.md §11), without Lightning: ``write`` turns the dict
Lightning hands a ``CheckpointIO`` into a directory at the path Lightning chose, ``read`` turns
that directory back into the dict, ``remove`` deletes one. Torch is needed; Lightning is not.

The directory (``epoch=1-step=16.ckpt/``) holds a run of one generation: ``step_N.bin`` (the
weights and Adam/AdamW moments or SGD momentum, mapped by ``statemap`` exactly as ``convert``
maps a ``torch.save`` file), ``step_N.extra.safetensors`` (buffers and every tensor of Lightning's
other entries) and ``step_N.json`` (the commit marker, with blake3, the layout, the optimizer by
parameter name, Lightning's other entries as strict JSON under ``imported.other``, the RNGs
under ``rng`` and a summary under ``lightning``). It is built in a sibling temp directory and
renamed into place, so the path holds a whole checkpoint or none.

>>> import tempfile, torch
>>> d = tempfile.mkdtemp(); net = torch.nn.Linear(2, 1)
>>> sd = {"epoch": 0, "global_step": 3, "state_dict": net.state_dict()}
>>> write(sd, d + "/epoch=0-step=3.ckpt").endswith("epoch=0-step=3.ckpt/step_000003.bin")
True
>>> sorted(os.listdir(d + "/epoch=0-step=3.ckpt"))
['step_000003.bin', 'step_000003.json']
>>> back = read(d + "/epoch=0-step=3.ckpt")
>>> back["global_step"], torch.equal(back["state_dict"]["weight"], net.weight)
(3, True)
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .. import atomic, fsio, kinds, statemap
from ..statestep import header_step
from .. import format as fmt
from ..errors import NotACheckpointError, NoValidGenerationError, SaveError, UnsupportedSetupError
from ..torch import torchsave

__all__ = ["KEY", "write", "read", "remove", "generation_in", "prepare", "to_dict"]

KEY = "ckptfmt"                    # the callback's entry in Lightning's checkpoint dict
OPTIMIZERS = "optimizer_states"    # Lightning's list of optimizer state dicts
NEEDS_CALLBACK = ("the ckptfmt CheckpointIO plugin needs its callback for parameter names and RNG states: "
                  "add ckptfmt.lightning.Checkpointing() to Trainer(callbacks=[...])")
RENAME_EXCHANGE = 2                # renameat2(2): swap two names atomically (Linux >= 3.15)
AT_FDCWD = -100


def generation_in(path: "str | os.PathLike[str]") -> str:
    """The ``step_N.bin`` of the Lightning checkpoint directory ``path`` (a symlink to one
    too: ``save_last="link"``); refused in one line for anything else (a plain ``.ckpt`` file
    is read by ``read``, but has no generation).

    Examples:
        >>> import torch
        >>> from ckptfmt.lightning import generation_in, write
        >>> _ = write({"state_dict": {"w": torch.ones(2)}, "global_step": 5, "epoch": 0}, "epoch=0-step=5.ckpt")
        >>> generation_in("epoch=0-step=5.ckpt")
        'epoch=0-step=5.ckpt/step_000005.bin'
    """
    found = kinds.generation_in(path) if os.path.isdir(path) else None
    if found is not None:
        return found
    if os.path.isdir(path):
        raise NoValidGenerationError(os.fspath(path), "holds no committed ckptfmt generation of a Lightning "
                                                      "checkpoint (no step_N.json with a lightning field)")
    if os.path.lexists(path):
        raise NotACheckpointError(os.fspath(path), "a file, not a checkpoint directory the ckptfmt "
                                                   "CheckpointIO plugin wrote")
    raise FileNotFoundError(2, "No such file or directory", os.fspath(path))


# ---------------------------------------------------------------- the dict -> a generation
def write(checkpoint: dict[str, Any], path: "str | os.PathLike[str]") -> str:
    """Write Lightning's ``checkpoint`` at ``path`` as a directory of one generation, replacing
    what is there in one step; returns the generation's ``.bin`` there. A full checkpoint (it
    has ``optimizer_states``) needs the callback's entry (``KEY``); a weights-only one is
    written without RNG states.

    Examples:
        A weights-only checkpoint (a full one, with ``optimizer_states``, comes through the callback):

        >>> import os, torch
        >>> from ckptfmt.lightning import write
        >>> write({"state_dict": {"w": torch.ones(2)}, "global_step": 8, "epoch": 1}, "epoch=1-step=8.ckpt")
        'epoch=1-step=8.ckpt/step_000008.bin'
        >>> sorted(os.listdir("epoch=1-step=8.ckpt"))
        ['step_000008.bin', 'step_000008.json']
    """
    path = os.fspath(path)
    state, step, fields = prepare(checkpoint, path)
    atomic.make_durable_dir(Path(path).parent)       # Lightning's dirpath may not exist yet
    staging = atomic.temp_path_for(path)
    try:
        os.mkdir(staging)
        statemap.write_bin(state, os.path.join(staging, fmt.checkpoint_name(step)), path, fields)
        fsio.fsync_dir(staging)
        _publish(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return os.path.join(path, fmt.checkpoint_name(step))


def prepare(checkpoint: dict[str, Any], path: str) -> tuple[statemap.State, int, dict[str, Any]]:
    """(the mapped state, its step, the manifest's further fields) of Lightning's ``checkpoint``
    for the checkpoint at ``path`` (a local directory's or a URL's: ``stored``); a full
    checkpoint without the callback's entry is refused, naming the callback."""
    ours = checkpoint.get(KEY)
    if not isinstance(ours, dict) and OPTIMIZERS in checkpoint:
        raise UnsupportedSetupError(path, NEEDS_CALLBACK)
    ours = ours or {}
    state = torchsave.to_state(_torch_form(checkpoint), path, _members(ours), "the Checkpointing callback")
    state.imported.update({"from": "lightning", "file": os.path.basename(path)})
    global_step = int(checkpoint.get("global_step", 0))
    fields = {kinds.LIGHTNING: {"epoch": checkpoint.get("epoch"), "global_step": global_step,
                                "version": checkpoint.get("pytorch-lightning_version"),
                                "namespace": ours.get("namespace"), "optimizers": _count(checkpoint)}}
    fields.update({key: ours[key] for key in ("rng", "ranks", "metrics") if ours.get(key)})
    fields["created"] = time.time()                  # the commit time retention's time rules read
    return state, header_step(state, global_step), fields


def _torch_form(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Lightning's dict as the mapping reads a ``torch.save`` checkpoint (``state_dict`` and the
    one state dict of ``optimizer_states``; more than one is refused there): all but ``KEY``."""
    return {key: value for key, value in checkpoint.items() if key != KEY}


def _count(checkpoint: dict[str, Any]) -> int | None:
    states = checkpoint.get(OPTIMIZERS)
    return len(states) if isinstance(states, list) else None


def _members(ours: dict[str, Any]) -> list[list[str]] | None:
    """Each param group's parameter names, as the callback read them off the live optimizer."""
    members = ours.get("members")
    return members[0] if isinstance(members, list) and members else None


# ---------------------------------------------------------------- a generation -> the dict
def read(path: "str | os.PathLike[str]") -> dict[str, Any]:
    """The dict Lightning wrote at ``path``, from its generation verified first (blake3 of the
    ``.bin`` and the companion, before any value is returned); ``KEY`` holds the RNG states
    (``rng``, None when not recorded) and the generation's path, for the callback. A file there
    is a plain Lightning ``.ckpt`` (``TorchCheckpointIO``), read with
    ``torch.load(weights_only=True)`` (``plain`` in ``KEY``; no RNG states).

    Examples:
        >>> import torch
        >>> from ckptfmt.lightning import read, write
        >>> _ = write({"state_dict": {"w": torch.ones(2)}, "global_step": 6, "epoch": 1}, "epoch=1-step=6.ckpt")
        >>> checkpoint = read("epoch=1-step=6.ckpt")                # blake3-verified before any value
        >>> checkpoint["global_step"], checkpoint["state_dict"]["w"].tolist()
        (6, [1.0, 1.0])
    """
    if os.path.isfile(path):
        return _plain(os.fspath(path))
    bin_path = generation_in(path)
    return to_dict(statemap.read_bin(bin_path), bin_path)


def to_dict(state: statemap.State, where: str) -> dict[str, Any]:
    """Lightning's dict of the verified generation ``state`` read at ``where`` (its ``.bin``, a
    local path or a URL), with ``KEY`` for the callback."""
    out = torchsave.from_state(state, where)
    out[KEY] = {"rng": state.manifest.get("rng"), "ranks": state.manifest.get("ranks"), "path": where}
    return out


def _plain(path: str) -> dict[str, Any]:
    """A ``torch.save`` ``.ckpt`` of Lightning's dict; what ``weights_only`` refuses (an
    ``argparse.Namespace`` in the hyper-parameters) is refused in one line naming it."""
    obj = torchsave.read(path)
    if not (isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict) and "global_step" in obj):
        raise NotACheckpointError(path, "not a Lightning checkpoint: a torch.save file without state_dict "
                                        "and global_step")
    return {**obj, KEY: {"rng": None, "path": path, "plain": True}}


# ---------------------------------------------------------------- publishing and removing
def _publish(staging: str, path: str) -> None:
    """Rename the complete ``staging`` directory to ``path``: a new name in one rename; an
    existing checkpoint (``last.ckpt`` saved again) swapped with it in one ``renameat2``
    exchange, then removed; where the filesystem cannot exchange, moved aside first (a crash
    between the two renames leaves both under temp names, never a half checkpoint at ``path``)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(path):
        try:
            os.rename(staging, path)
        except FileExistsError:          # appeared meanwhile: exchange below
            pass
        else:
            return fsio.fsync_dir(parent)
    old = atomic.temp_path_for(path)
    if _exchange(staging, path):
        os.rename(staging, old)          # the old checkpoint, now under the staging name
    else:
        os.rename(path, old)
        try:
            os.rename(staging, path)
        except OSError:
            os.rename(old, path)         # the old checkpoint back where it was
            raise
    fsio.fsync_dir(parent)
    _delete(old)


def _exchange(a: str, b: str) -> bool:
    """Swap two names atomically; False where the system or filesystem cannot."""
    call = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)    # the C library in this process
    if call is None:
        return False
    return call(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0


def remove(path: "str | os.PathLike[str]") -> None:
    """Remove the checkpoint at ``path`` durably: its name goes in one rename (then the
    directory's entry is fsynced), its files after. A link (``save_last="link"``) or a file is
    unlinked; a directory that is not a ckptfmt Lightning checkpoint is refused, never deleted.

    Examples:
        >>> import os, torch
        >>> from ckptfmt.lightning import remove, write
        >>> _ = write({"state_dict": {"w": torch.ones(2)}, "global_step": 7, "epoch": 1}, "epoch=1-step=7.ckpt")
        >>> remove("epoch=1-step=7.ckpt")
        >>> os.path.exists("epoch=1-step=7.ckpt")
        False
    """
    path = os.fspath(path)
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        return atomic.remove(path)
    if kinds.generation_in(path) is None:
        raise SaveError(path, "not a Lightning checkpoint the ckptfmt plugin wrote; refusing to delete the directory")
    gone = atomic.temp_path_for(path)
    os.rename(path, gone)
    atomic.sync_dir_of(path)
    _delete(gone)


def _delete(path: str) -> None:
    """Remove what a rename already took out of sight (a file, a link or a directory)."""
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
