"""The RAM tier's directories over their life (spec/RUN.md §13.10): made with a record of their
run, emptied of what the durable tier covers when the run closes or is collected, and found
again when their run is gone.

Each tier directory (``ROOT/<run id>/``, ``tiers.tier_dir``) holds ``.run.json``: the absolute
path of the run it serves and the ID, written by the writer that makes the directory. A tier is
*orphaned* when that run directory no longer exists or has another ID now (deleted and made
again, or its ID record damaged): none of its generations can ever be resumed, and ``ckptfmt
ram --remove-orphans`` removes it. A tier without the record (made by an earlier version) has an
unknown run: listed, and removed only when named (``--remove ID``).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .. import atomic
from ..errors import CheckpointError, UnsupportedSetupError
from ..generation import list_dir
from . import tiers
from .generations import non_finite
from .sidecars import read_json, write_json

OWNER = ".run.json"           # in a tier directory: {"run": absolute path, "id", "created"}
IN_USE, ORPHANED, UNKNOWN = "in use", "orphaned", "unknown run"


def make(run: "str | os.PathLike[str]", where: Path, *, record: bool = True) -> Path:
    """The tier directory ``where`` of ``run``, made if missing (its root mode 0700: one user's
    RAM generations are not for others to read), with its ``.run.json`` (``record``: the writer
    that owns the directory, each node's first rank). Returns ``where``."""
    if not where.parent.is_dir():
        with contextlib.suppress(FileExistsError):
            where.parent.mkdir(mode=0o700, parents=True)
    atomic.make_durable_dir(where)
    if record and not (where / OWNER).exists():
        write_json(where / OWNER, {"run": str(Path(run).resolve()), "id": where.name, "created": round(time.time(), 3)})
    return where


def release(run: "str | os.PathLike[str]", step: int | None) -> list[int]:
    """When the run closes with ``step`` its newest durable generation: remove the RAM tier's
    generations at or below it (a restore takes the durable one first at the same step, and
    never an older one over it) and the tier's temp files; the tier directory too once nothing
    is left in it. The steps removed; nothing unless the run directory holds ``step`` committed
    and finite (a diverged one does not cover an older finite RAM generation: a restore would
    take that one, spec/RUN.md §13.6)."""
    where = tiers.memory_dir(run)
    if step is None or where is None or not where.is_dir():
        return []
    durable = next((g for g in list_dir(run).generations if g.step == step and g.committed), None)
    if durable is None or non_finite(durable):
        return []
    listing = list_dir(where)
    for temp in listing.temps:
        if temp.is_file() and not temp.is_symlink():
            atomic.remove(temp)
    gone = [g for g in listing.generations if g.step <= step]
    for gen in gone:
        gen.remove()
    if len(gone) == len(listing.generations):
        _remove_if_empty(where)
    return [g.step for g in gone]


def _remove_if_empty(where: Path) -> None:
    """The tier directory, when it holds nothing but its ``.run.json`` (a writer that has just
    made it again keeps it: ``rmdir`` fails on a directory that is not empty)."""
    with contextlib.suppress(OSError):
        if {e.name for e in os.scandir(where)} <= {OWNER}:
            (where / OWNER).unlink(missing_ok=True)
            where.rmdir()


def _roots() -> list[Path]:
    legacy = tiers.legacy_root()
    return [tiers.memory_root()] + ([legacy] if legacy is not None else [])


def survey() -> list[dict[str, Any]]:
    """Every RAM tier of this user under the roots (the per-user one, and the shared root of
    earlier versions where ``$CKPTFMT_MEMORY_DIR`` is unset): its directory, ID, run, status
    (``in use``, ``orphaned``, ``unknown run``) and why, its committed steps and bytes."""
    out = []
    for root in _roots():
        with contextlib.suppress(OSError):
            for entry in sorted(os.scandir(root), key=lambda e: e.name):
                if tiers.ID.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False) \
                        and entry.stat(follow_symlinks=False).st_uid == os.getuid():
                    out.append(_state(Path(entry.path)))
    return out


def _state(where: Path) -> dict[str, Any]:
    try:
        doc = read_json(where / OWNER, default=None)
    except CheckpointError:
        doc = None
    run = doc.get("run") if isinstance(doc, dict) and isinstance(doc.get("run"), str) else None
    if run is None:
        status, why = UNKNOWN, "no record of its run (made by an earlier ckptfmt): remove it by naming its ID"
    elif not Path(run).is_dir():
        status, why = ORPHANED, f"its run {run} no longer exists"
    elif tiers.run_id(run) != where.name:
        status, why = ORPHANED, f"its run {run} has another ID now (deleted and made again)"
    else:
        status, why = IN_USE, f"the RAM tier of {run}"
    steps, size = [], 0
    with contextlib.suppress(OSError):
        gens = list_dir(where).generations
        steps = [g.step for g in gens if g.manifest is not None]
        size = sum(f.stat().st_size for f in where.rglob("*") if f.is_file() and not f.is_symlink())
    return {"dir": str(where), "run_id": where.name, "run": run, "status": status, "why": why,
            "steps": steps, "bytes": size}


def remove(found: dict[str, Any]) -> None:
    """Remove one surveyed tier, its status looked at again first: a tier whose run has it as
    its RAM tier is refused (``gc RUN`` removes what that run no longer needs)."""
    _refuse_in_use(_state(Path(found["dir"])))
    shutil.rmtree(found["dir"])


def _refuse_in_use(state: dict[str, Any]) -> None:
    if state["status"] == IN_USE:
        raise UnsupportedSetupError(state["dir"], f"{state['why']}: not removed (ckptfmt gc {state['run']} "
                                                  "removes the RAM generations the run no longer needs)")


def collect(run: "str | os.PathLike[str]", newest: int | None, *, dry_run: bool = False) -> dict[str, Any] | None:
    """``gc RUN``'s pass over the run's RAM tier (the caller holds the run lock, so no writer
    is saving there): what ``release`` removes at ``newest``, the newest valid finite durable
    generation (``covered_by``); ``kept``: the RAM steps newer than it. None when the run has no
    RAM tier."""
    where = tiers.memory_dir(run)
    if where is None or not where.is_dir():
        return None
    steps = [g.step for g in list_dir(where).generations]
    deleted = [s for s in steps if newest is not None and s <= newest]
    if not dry_run:
        deleted = release(run, newest)
    return {"dir": str(where), "covered_by": newest, "deleted": deleted, "kept": [s for s in steps if s not in deleted]}


def sweep(*, orphans: bool = False, ids: "tuple[str, ...] | list[str]" = (), dry_run: bool = False) -> dict[str, Any]:
    """``ckptfmt ram``: every RAM tier of this user (``survey``); with ``orphans`` the orphaned
    ones removed, and those named in ``ids`` (an unknown ID, or one whose run uses it, refuses
    the whole call before anything is removed). ``removed``: the tiers removed (or, with
    ``dry_run``, that would be)."""
    found = survey()
    by_id = {t["run_id"]: t for t in found}
    for name in ids:
        if name not in by_id:
            raise UnsupportedSetupError(str(tiers.memory_root()), f"no RAM tier with ID {name!r} "
                                                                  "(ckptfmt ram lists them)")
        _refuse_in_use(by_id[name])
    doomed = [t for t in found if (orphans and t["status"] == ORPHANED) or t["run_id"] in ids]
    if not dry_run:
        for tier in doomed:
            remove(tier)
    return {"root": str(tiers.memory_root()), "tiers": found, "dry_run": dry_run,
            "removed": [t["dir"] for t in doomed]}
