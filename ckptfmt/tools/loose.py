"""A directory without any generation, judged once for every command (spec/RUN.md §2.5): a live
run before its first commit is training; a run with a loss history and no generation stopped
before its first checkpoint; a directory holding checkpoint files of other kinds (a ``model.pt``,
a ``ckpt.pt``, a DCP directory) is those files, each checked by its kind, never an empty run;
anything else is empty. A file counts only where its content says what it is (a ``train.bin`` of
tokens is not claimed by its name), and hidden entries, links (a run never follows one), names
of the ``step_`` family (a generation's, judged as one), ``training_args.bin`` (a pickle, never
opened) and subdirectories that are no checkpoint are left out (``ls`` names what it skips)."""
from __future__ import annotations

import os
from typing import Any

from .. import kinds
from ..errors import CheckpointError
from ..run import history as hist
from ..run import timeline

__all__ = ["checkpoint_files", "empty_directory", "own_kind"]

LIMIT = 256                         # entries looked at: thousands of files are no checkpoint set
NEVER_OPENED = ("training_args.bin",)


def empty_directory(path: "str | os.PathLike[str]", holder: dict[str, Any] | None
                    ) -> tuple[str, "str | list[tuple[str, kinds.Kind]]"]:
    """("training", what to say), ("stopped", what to say), ("files", [(path, kind)]) or
    ("empty", what to say) for ``path``, a directory without any generation whose writer lock
    ``holder`` holds (None: no live writer)."""
    if holder is not None:
        return "training", (f"{path}: no generation yet: training, pid {holder.get('pid', '?')} holds the run "
                            "and has not committed its first generation")
    steps = sum(1 for _ in timeline.canonical(os.path.join(path, hist.NAME)))
    if steps:
        return "stopped", (f"{path}: stopped before its first checkpoint: the history holds {steps} steps but "
                           "no generation was committed; nothing to resume, a restart begins at step 0")
    files = checkpoint_files(path)
    if files:
        return "files", files
    return "empty", f"{path}: no generation to resume from (not a run directory, or an empty one)"


def own_kind(directory: "str | os.PathLike[str]") -> kinds.Kind | None:
    """The kind a directory without generations is itself, by its content (a DCP directory, a
    ``save_pretrained`` model: what validate and inspect take it as); None for a plain one."""
    kind = _by_content(os.fspath(directory))
    return kind if kind is not None and kind.name != "run" and kind.can("validate") else None


def checkpoint_files(directory: "str | os.PathLike[str]") -> list[tuple[str, kinds.Kind]]:
    """(path, kind) of each checkpoint file or checkpoint directory in ``directory``, by name."""
    try:
        with os.scandir(directory) as entries:
            names = sorted(e.name for _, e in zip(range(LIMIT), entries)
                           if not e.name.startswith((".", "step_")) and not e.is_symlink() and e.name not in NEVER_OPENED)
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(os.fspath(directory), name)
        kind = _by_content(path)
        if kind is not None and kind.name not in ("run", "manifest") and kind.can("validate"):
            found.append((path, kind))
    return found


def _by_content(path: str) -> kinds.Kind | None:
    """The kind ``path``'s content decides, None where only a name would (or nothing does)."""
    try:
        probe = kinds.Probe(path)
    except OSError:
        return None
    if not (probe.is_file or probe.is_dir):     # a pipe, a socket, a device: never opened
        return None
    try:
        return next((kind for kind in kinds.KINDS if kind.sniff(probe)), None)
    except (CheckpointError, OSError):
        return None
