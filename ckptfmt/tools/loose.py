"""Checkpoint files that lie loose in a directory that is not a run: a directory holding a
``model.pt``, a ``ckpt.pt`` and a ``weights.safetensors`` and no generation is checked as those
files, each by its kind (spec/RUN.md §2.5), never called an empty run. Only what ``validate``
can read counts; hidden entries, links (a run never follows one), ``step_N`` names (a
generation's, judged as one), subdirectories that are
themselves run directories and files of no known kind are left out (``ls`` names them)."""
from __future__ import annotations

import os

from .. import format as fmt
from .. import kinds
from ..errors import CheckpointError

__all__ = ["checkpoint_files"]

LIMIT = 256          # entries looked at: a directory of thousands of files is no loose checkpoint set


def checkpoint_files(directory: "str | os.PathLike[str]") -> list[tuple[str, kinds.Kind]]:
    """(path, kind) of each checkpoint file or checkpoint directory in ``directory``, by name."""
    found = []
    try:
        with os.scandir(directory) as entries:
            names = sorted(e.name for _, e in zip(range(LIMIT), entries)
                           if not e.name.startswith(".") and not e.is_symlink() and fmt.parse_name(e.name) is None)
    except OSError:
        return []
    for name in names:
        path = os.path.join(os.fspath(directory), name)
        try:
            kind = kinds.sniff(path)
        except (CheckpointError, OSError):      # no known kind, a pipe, unreadable: ls names it
            continue
        if kind.name not in ("run", "manifest") and kind.can("validate"):
            found.append((path, kind))
    return found
