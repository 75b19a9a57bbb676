"""The RAM tier's directories over their life (spec/RUN.md §13.10): made with a record of their
run, held by the process that saves there, emptied of what the durable tier covers when the run
closes or is collected, and found again when their run is gone.

Each tier directory (``ROOT/<run id>/``, ``tiers.tier_dir``) holds ``.run.json``: the absolute
path of the run it serves and the ID, written again whenever the run is met at another path (a
run directory moved between a kill and its restart). A process that saves RAM generations holds
a shared ``flock`` on the tier directory for its life. A tier is *orphaned* when that run
directory no longer exists or has another ID now (deleted and made again, or its ID record
damaged), and no live process holds it: ``ckptfmt ram --remove-orphans`` removes it once nothing
in it changed for ``GRACE_S`` (a run moved while it was killed comes back to its tier at its
restart). A tier without a usable record (made by an earlier version) has an unknown run: listed,
and removed only when named (``--remove ID``).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .. import atomic
from ..errors import CheckpointError, UnsupportedSetupError
from ..fsio import is_url
from ..generation import list_dir
from . import tiers
from .directory import Run
from .generations import non_finite
from .sidecars import read_json, write_json

OWNER = ".run.json"           # in a tier directory: {"run": absolute path, "id", "recorded"}
IN_USE, ORPHANED, UNKNOWN, UNREADABLE = "in use", "orphaned", "unknown run", "unreadable"
GRACE_S = 3600                # --remove-orphans leaves an orphan that changed within the last hour


def make(run: "Run | str | os.PathLike[str]", where: Path, *, record: bool = True) -> Path:
    """The tier directory ``where`` of ``run``, made if missing (the default root mode 0700: one
    user's RAM generations are not for others to read; one another user made, a symbolic link or
    one writable by others is refused, ``UnsupportedSetupError``), with its ``.run.json``
    (``record``: the writer that owns the directory, each node's first rank). Returns ``where``."""
    if not where.parent.is_dir():
        with contextlib.suppress(FileExistsError):
            where.parent.mkdir(mode=0o700, parents=True)
    if where.parent == tiers.memory_root() and (problem := tiers.root_problem()) is not None:
        raise UnsupportedSetupError(str(where.parent), f"the RAM tier's root {problem}: not used (remove it, "
                                                       f"or set {tiers.MEMORY_ENV})")
    atomic.make_durable_dir(where)
    if record:
        claim(run, where)
    return where


def claim(run: "Run | str | os.PathLike[str]", where: Path) -> None:
    """``.run.json`` in the tier ``where``, naming ``run`` by its absolute path (a run on a
    store: its URL): written when it is missing, damaged or names another path (the run was moved)."""
    path = tiers.as_run(run).origin
    try:
        doc = read_json(where / OWNER, default=None)
    except CheckpointError:
        doc = None
    if not (isinstance(doc, dict) and doc.get("run") == path and doc.get("id") == where.name):
        write_json(where / OWNER, {"run": path, "id": where.name, "recorded": round(time.time(), 3)})


_HELD: dict[str, int] = {}    # the tiers this process holds: directory -> descriptor


def keep(where: Path, *, wait: bool = False) -> bool:
    """This process holds the tier ``where`` (a shared ``flock``) until ``let_go(where)``, or
    until it ends, however it ends (the kernel lets go): ``ckptfmt ram`` never removes a held
    tier. A saver takes it at each RAM save (taken again when the directory was made again);
    a restore takes it with ``wait`` (a removal in progress finishes first) before it looks at
    the tier, and keeps it while it loads. False when the tier is not there (or, without
    ``wait``, cannot be held now)."""
    key = str(where)
    if key in _HELD and _same(_HELD[key], where):
        return True
    let_go(where)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | (0 if wait else fcntl.LOCK_NB))
        if not _same(fd, where):          # removed while this waited
            raise FileNotFoundError(key)
    except OSError:
        os.close(fd)
        return False
    _HELD[key] = fd
    return True


def _same(fd: int, where: Path) -> bool:
    """The descriptor is of the directory at ``where`` now (not one removed and made again)."""
    try:
        return os.fstat(fd).st_ino == os.stat(where).st_ino
    except OSError:
        return False


def holding() -> bool:
    """This process holds some tier (``keep``)."""
    return bool(_HELD)


def let_go(where: "Path | None") -> None:
    """Give back what ``keep`` took of ``where`` (nothing held: nothing to do)."""
    fd = _HELD.pop(str(where), None) if where is not None else None
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def release(run: "Run | str | os.PathLike[str]", step: int | None) -> list[int]:
    """When the run closes with ``step`` its newest durable generation: remove the RAM tier's
    generations at or below it (a restore takes the durable one first at the same step, and
    never an older one over it) and the tier's temp files; the tier directory too once nothing
    is left in it. The steps removed; nothing unless the run directory holds ``step`` committed
    and finite (a diverged one does not cover an older finite RAM generation: a restore would
    take that one, spec/RUN.md §13.6)."""
    where = tiers.memory_dir(run)
    if step is None or where is None or not where.is_dir():
        return []
    durable = next((g for g in tiers.as_run(run).generations() if g.step == step and g.committed), None)
    if durable is None or non_finite(durable):
        return []
    gone = tiers.remove_generations(where, lambda s: s <= step)
    _remove_if_empty(where)
    return gone


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
    earlier versions where ``$CKPTFMT_MEMORY_DIR`` is unset, passed over when this user cannot
    list it): its directory, ID, run, status (``in use``, ``orphaned``, ``unknown run``,
    ``unreadable``) and why, its committed steps, bytes and age (seconds since anything in it
    changed). A root of this user's that cannot be listed, or a default root not to be used
    (``tiers.root_problem``), is ``UnsupportedSetupError``."""
    mine = tiers.memory_root()
    if (problem := tiers.root_problem()) is not None:
        raise UnsupportedSetupError(str(mine), f"the RAM tier's root {problem}")
    out = []
    for root in _roots():
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if root != mine:             # the earlier shared root, closed to this user
                continue
            raise UnsupportedSetupError(str(root), f"cannot list the RAM tiers: {exc.strerror or exc}") from None
        for entry in entries:
            try:
                if not (tiers.ID.fullmatch(entry.name) and tiers.owned(Path(entry.path))):
                    continue
                out.append(_state(Path(entry.path)))
            except OSError as exc:       # one tier that cannot be read hides none of the others
                out.append({"dir": entry.path, "run_id": entry.name, "run": None, "status": UNREADABLE,
                            "why": f"cannot be read: {exc.strerror or exc}", "steps": [], "bytes": 0, "age_s": None})
    return out


def _state(where: Path, *, look_held: bool = True) -> dict[str, Any]:
    """One tier's row of ``survey`` (``look_held``: whether a live process holds it is asked)."""
    try:
        doc = read_json(where / OWNER, default=None)
    except CheckpointError:
        doc = None
    run = doc.get("run") if isinstance(doc, dict) and isinstance(doc.get("run"), str) else None
    if run is not None and not (os.path.isabs(run) or is_url(run)):
        run = None                       # a record not written by ckptfmt: nothing to judge it by
    if look_held and _held(where):
        status, why = IN_USE, "a live process saves RAM generations there" + (f" (its run: {run})" if run else "")
    elif run is None:
        status, why = UNKNOWN, "no usable record of its run (made by an earlier ckptfmt): remove it by naming its ID"
    elif is_url(run):
        status, why = UNKNOWN, (f"its run {run} is on object storage, not looked up from here: `ckptfmt gc "
                                f"{run}` removes what its durable generations cover, or remove it by naming its ID")
    elif not Path(run).is_dir():
        status, why = ORPHANED, f"its run {run} no longer exists"
    elif tiers.run_id(run) != where.name:
        status, why = ORPHANED, f"its run {run} has another ID now (deleted and made again)"
    else:
        status, why = IN_USE, f"the RAM tier of {run}"
    gens = list_dir(where).generations
    files = [f for f in where.rglob("*") if f.is_file() and not f.is_symlink()]
    newest = max([where.stat().st_mtime] + [f.stat().st_mtime for f in files])
    return {"dir": str(where), "run_id": where.name, "run": run, "status": status, "why": why,
            "steps": [g.step for g in gens if g.manifest is not None], "bytes": sum(f.stat().st_size for f in files),
            "age_s": round(max(0.0, time.time() - newest), 1)}


def _held(where: Path) -> bool:
    """A live process holds the tier (``keep``): an exclusive ``flock`` is refused."""
    fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _refuse_in_use(state: dict[str, Any]) -> None:
    if state["status"] == IN_USE:
        raise UnsupportedSetupError(state["dir"], f"{state['why']}: not removed (ckptfmt gc {state['run'] or 'RUN'} "
                                                  "--keep-last K removes the RAM generations the run no longer needs)")


def collect(run: "Run | str | os.PathLike[str]", newest: int | None, *, dry_run: bool = False) -> dict[str, Any] | None:
    """``gc RUN``'s pass over the run's RAM tier (the caller holds the run lock, so no writer
    is saving there): what ``release`` removes at ``newest``, the newest valid finite durable
    generation (``covered_by``); ``kept``: the RAM steps newer than it. None when the run has no
    RAM tier."""
    where = tiers.memory_dir(run)
    if where is None or not where.is_dir():
        return None
    listing = list_dir(where)
    steps = [g.step for g in listing.generations]
    deleted = [s for s in steps if newest is not None and s <= newest]
    swept = [str(t) for t in listing.temps if t.is_file() and not t.is_symlink()]
    if not dry_run:
        for temp in swept:
            atomic.remove(temp)
        deleted = release(run, newest)
    return {"dir": str(where), "covered_by": newest, "deleted": deleted, "kept": [s for s in steps if s not in deleted],
            "swept_temps": [] if dry_run else swept}


def _ripe(state: dict[str, Any]) -> bool:
    """An orphan ``--remove-orphans`` takes: nothing in it changed for ``GRACE_S``."""
    return state["status"] == ORPHANED and state["age_s"] >= GRACE_S


def sweep(*, orphans: bool = False, ids: "tuple[str, ...] | list[str]" = (), dry_run: bool = False) -> dict[str, Any]:
    """``ckptfmt ram``: every RAM tier of this user (``survey``); with ``orphans`` the orphaned
    ones nothing changed in for ``GRACE_S`` removed (the younger ones in ``waiting``), and those
    named in ``ids``. Every tier to go is looked at again, and seized (an exclusive ``flock``),
    before any is removed: an unknown ID, a tier a live process holds or whose run has it as its
    tier, refuses the whole call and nothing is removed. ``removed``: the tiers removed (or,
    with ``dry_run``, that would be)."""
    found = survey()
    by_id = {t["run_id"]: t for t in found}
    for name in ids:
        if name not in by_id:
            raise UnsupportedSetupError(str(tiers.memory_root()), f"no RAM tier with ID {name!r} "
                                                                  "(ckptfmt ram lists them); nothing removed")
        _refuse_in_use(by_id[name])
    doomed = [t for t in found if t["run_id"] in ids or (orphans and _ripe(t))]
    waiting = [t for t in found if orphans and t["status"] == ORPHANED and t not in doomed]
    out = {"root": str(tiers.memory_root()), "tiers": found, "dry_run": dry_run,
           "removed": [t["dir"] for t in doomed], "waiting": [t["dir"] for t in waiting], "grace_s": GRACE_S}
    if dry_run or not doomed:
        return out
    seized: list[int] = []
    try:
        for tier in doomed:
            seized.append(_seize(tier, named=tier["run_id"] in ids))
        for tier in doomed:
            shutil.rmtree(tier["dir"])
    finally:
        for fd in seized:
            os.close(fd)
    return out


def _seize(tier: dict[str, Any], *, named: bool) -> int:
    """The tier about to go, held exclusively and looked at again under that hold: a live
    process holding it, its run having it as its tier now, or (an orphan not ``named``) a
    change within ``GRACE_S``, is ``UnsupportedSetupError``. The descriptor, for the caller to close."""
    where = Path(tier["dir"])
    try:
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise UnsupportedSetupError(str(where), f"cannot be removed: {exc.strerror or exc}; nothing removed") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        now = _state(where, look_held=False)
        _refuse_in_use(now)
        if not named and not _ripe(now):
            raise UnsupportedSetupError(str(where), f"changed while this command ran ({now['status']}): "
                                                    "nothing removed")
    except BlockingIOError:
        os.close(fd)
        raise UnsupportedSetupError(str(where), "a live process saves RAM generations there: nothing "
                                                "removed") from None
    except BaseException:
        os.close(fd)
        raise
    return fd
