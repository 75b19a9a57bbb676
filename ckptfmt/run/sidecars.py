"""The run's sidecar files and their rules (spec/RUN.md §4): names, JSON reading, zombie arms.

Lifetimes differ on purpose (seed 000, "Eine Regel"): the loss history runs on through pivots
and restarts, while samples and bandit state may be archived and reset at a polish pivot.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import atomic, fsio
from .. import format as fmt
from .. import manifest as mf
from ..errors import CheckpointError, SaveError, SidecarError, SidecarWriteError, parse_json
from ..generation import list_dir
from .retention import Policy

PINS = ".pins.json"
SAMPLES = ".samples.json"
STATE = ".state.json"
PIVOT = ".pivot.json"
POLICY = ".policy.json"
ARCHIVE = "archive"


def read_json(path: "str | os.PathLike[str]", default: Any = None) -> Any:
    """A sidecar's JSON, ``default`` when the file does not exist, ``SidecarError`` when it is
    not valid JSON (a damaged sidecar is reported, never silently replaced).

    Examples:
        >>> import json
        >>> from ckptfmt.run import read_json
        >>> read_json("absent.json", default={})
        {}
        >>> _ = open("pins.json", "w").write(json.dumps([4000]))
        >>> read_json("pins.json")
        [4000]
    """
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


def archive(directory: Path, step: int, names: tuple[str, ...]) -> tuple[str, list[str]]:
    """Move the sidecars ``names`` that are there into ``ARCHIVE/step_N/`` (``step_N.2``, ...
    where taken), each under its name without the dot, durably (a pivot): (the archive's name in
    the run, the names moved)."""
    base = directory / ARCHIVE / fmt.stem(step)
    dest, i = base, 1
    while dest.exists():
        i += 1
        dest = base.with_name(f"{base.name}.{i}")
    dest.mkdir(parents=True)
    moved = []
    for name in names:
        if (directory / name).exists():
            os.replace(directory / name, dest / name.lstrip("."))
            moved.append(name)
    for d in (dest, directory):
        fsio.fsync_dir(str(d))
    return str(dest.relative_to(directory)), moved


def record_policy(run: Any, retention: Policy | None, saving: Any = None,
                  by: str = "checkpoint manager") -> None:
    """Write the policy a writer runs the run with (spec/RUN.md §5.6): ``retention`` (None: it
    keeps every generation) and ``saving`` (a ``SavePolicy``), so ``ls`` shows what keeps each
    generation without being told. ``run``: a ``Run`` (its sidecar calls: a run on a store too).

    Examples:
        >>> import os
        >>> from ckptfmt.run import Policy, Run, SavePolicy, record_policy, recorded_policy
        >>> os.makedirs("recorded", exist_ok=True)
        >>> record_policy(Run("recorded"), Policy(keep_last=2), SavePolicy(every=10))
        >>> recorded_policy("recorded")[1].keep_last
        2
    """
    doc = {"by": by, "retention": retention.to_json() if retention is not None else None,
           "saving": saving.to_json() if saving is not None else None}
    try:
        same = run.read_sidecar(POLICY, default=None) == doc
    except SidecarError:        # a damaged record says nothing: replaced by what is true now
        same = False
    if not same:
        run.write_sidecar(POLICY, doc)


def recorded_policy(directory: "str | os.PathLike[str]") -> tuple[bool, Policy | None]:
    """(whether the run's writer recorded a policy, the retention policy it recorded: None when
    it keeps every generation); a sidecar that holds no policy record is a ``SidecarError``
    naming it.

    Examples:
        >>> import os
        >>> from ckptfmt.run import Policy, Run, record_policy, recorded_policy
        >>> os.makedirs("policy-run", exist_ok=True)
        >>> recorded_policy("policy-run")                           # no writer recorded one
        (False, None)
        >>> record_policy(Run("policy-run"), None)                   # keeps every generation
        >>> recorded_policy("policy-run")
        (True, None)
    """
    path = Path(directory) / POLICY
    doc = read_json(path, default=None)
    if doc is None:
        return False, None
    try:
        rules = doc["retention"]
        return True, None if rules is None else Policy.from_json(rules)
    except (KeyError, TypeError, ValueError) as exc:
        raise SidecarError(str(path), f"not a policy record: {exc}") from None


def zombie_arms(directory: "str | os.PathLike[str]") -> list[str]:
    """Bandit arms in .state.json whose data source the run's config no longer has (seed: the
    step-112,619 lesson). Empty when there is no state or no config to compare with.
    ``directory``: the run directory's path, or its ``Run`` (a path-like).

    Examples:
        A bandit arm whose source a pivot took out of the config:

        >>> import json, os, numpy as np, ckptfmt
        >>> from ckptfmt.run import zombie_arms
        >>> os.makedirs("bandit", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("bandit", 10, z, z, z, manifest={"config": {"sources": ["code", "topics"]}})
        >>> _ = open("bandit/.state.json", "w").write(json.dumps({"arms": {"code": {}, "topics": {}, "docstrings": {}}}))
        >>> zombie_arms("bandit")
        ['docstrings']
    """
    path = Path(directory)
    state = read_json(path / STATE, default=None)
    if not isinstance(state, dict) or not isinstance(state.get("arms"), dict):
        return []
    config = None
    for gen in reversed([g for g in list_dir(path).generations if g.committed]):
        try:                                # the newest manifest that reads: a damaged one is passed over
            config = mf.read(gen.manifest).get("config")
            break
        except CheckpointError:
            continue
    sources = config.get("sources") if isinstance(config, dict) else None
    if not isinstance(sources, list) or not sources:     # none, or not the trainer's config
        return []
    return sorted(set(state["arms"]) - set(sources))
