"""The run's sidecar files and their rules (spec/RUN.md §4): names, JSON reading, zombie arms.

Lifetimes differ on purpose (seed 000, "Eine Regel"): the loss history runs on through pivots
and restarts, while samples and bandit state may be archived and reset at a polish pivot.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import atomic
from .. import manifest as mf
from ..errors import CheckpointError, SaveError, SidecarError, SidecarWriteError, parse_json
from .generations import list_dir

PINS = ".pins.json"
SAMPLES = ".samples.json"
STATE = ".state.json"
PIVOT = ".pivot.json"
ARCHIVE = "archive"


def read_json(path: "str | os.PathLike[str]", default: Any = None) -> Any:
    """A sidecar's JSON, ``default`` when the file does not exist, ``SidecarError`` when it is
    not valid JSON (a damaged sidecar is reported, never silently replaced)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return default
    return parse_json(data, SidecarError, str(path))


def write_json(path: "str | os.PathLike[str]", value: Any) -> None:
    """Replace a sidecar atomically (temp, fsync, rename, fsync the directory); the storage
    refusing it (a full disk) is a ``SidecarWriteError`` naming the sidecar, and the previous
    one is intact (no temp file is left)."""
    try:
        atomic.write_json(path, value)
    except SaveError as exc:
        if not isinstance(exc.__cause__, OSError):
            raise
        raise SidecarWriteError(str(path), "replacing the sidecar", exc.__cause__) from exc.__cause__


def zombie_arms(directory: "str | os.PathLike[str]") -> list[str]:
    """Bandit arms in .state.json whose data source the run's config no longer has (seed: the
    step-112,619 lesson). Empty when there is no state or no config to compare with.
    ``directory``: the run directory's path, or its ``Run`` (a path-like)."""
    path = Path(directory)
    state = read_json(path / STATE, default=None)
    if not isinstance(state, dict) or not isinstance(state.get("arms"), dict):
        return []
    gen = next((g for g in reversed(list_dir(path).generations) if g.committed), None)
    if gen is None:
        return []
    try:
        config = mf.read(gen.manifest).get("config")
    except CheckpointError:
        return []
    sources = config.get("sources") if isinstance(config, dict) else None
    if not isinstance(sources, list) or not sources:     # none, or not the trainer's config
        return []
    return sorted(set(state["arms"]) - set(sources))
