"""A Lightning ModelCheckpoint directory (spec/RUN.md §11.1): the checkpoint directories in it,
each a run of one generation, seen as one run by ``validate``, ``ls`` and ``inspect``.

Each checkpoint is judged as it is judged alone (``validate_run`` of its directory): the verdict
of the whole is the worst of theirs, and a directory whose checkpoints all validate is valid. A
link Lightning made (``save_last="link"``: ``last.ckpt`` pointing at a checkpoint of the same
directory) is listed as that link, not judged twice; a link elsewhere is judged as what it
reaches, a dangling one is named. The directory's own history (``.loss.json``,
``Checkpointing(history=True)``) is the callback's; it is not judged here.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .. import format as fmt
from .. import fsio, kinds
from ..errors import CheckpointError
from .report import Report

__all__ = ["checkpoints", "inspect_lightning_dir", "is_lightning_dir", "ls_lightning_dir", "validate_lightning_dir"]


def is_lightning_dir(path: "str | os.PathLike[str]") -> bool:
    """``path`` is such a directory (``kinds`` says ``lightning-dir``)."""
    try:
        return kinds.sniff(path).name == "lightning-dir"
    except (CheckpointError, OSError):
        return False


def checkpoints(path: "str | os.PathLike[str]") -> list[tuple[int | None, Path, str]]:
    """(step, entry, what) of every checkpoint entry of ``path``, by step then name: ``what``
    is ``checkpoint`` (a Lightning checkpoint directory, or a ``*.ckpt`` directory holding
    ``step_N`` entries that no longer reads as one: damaged, its step None where no manifest
    says it), ``link`` (``save_last="link"``: a link to a checkpoint of this directory) or
    ``dangling`` (a link to nothing). A link elsewhere is judged as the checkpoint it reaches."""
    root, rows = Path(path), []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_symlink() and not entry.exists():
            rows.append((None, entry, "dangling"))
            continue
        if not entry.is_dir():
            continue
        found = kinds.generation_in(entry)
        names = [] if found is not None else [n for n in os.listdir(entry) if fmt.parse_name(n) is not None]
        if found is None and not (entry.name.endswith(".ckpt") and names):
            continue
        step = fmt.parse_name(Path(found).name)[0] if found else max((fmt.parse_name(n)[0] for n in names), default=None)
        mine = entry.is_symlink() and entry.resolve().parent == root.resolve() and not entry.resolve().is_symlink()
        rows.append((step, entry, "link" if mine else "checkpoint"))
    return sorted(rows, key=lambda row: (-1 if row[0] is None else row[0], row[1].name))


def validate_lightning_dir(path: "str | os.PathLike[str]", validate_run: Any, *, deep: bool = True) -> Report:
    """Every checkpoint of the directory validated as a run of one generation (``validate_run``,
    validate's own, given by it); the findings of each, and the verdict of the whole: damaged
    where one is, no checkpoint where none is there, else verified (committed)."""
    report = Report(str(path), kind="lightning-dir")
    rows = []
    for step, entry, what in checkpoints(path):
        if what != "checkpoint":
            if what == "dangling":
                report.warn("dangling_link", f"{entry}: a link to nothing ({os.readlink(entry)})")
            rows.append({"step": step, "path": str(entry), "status": _linked(entry, what)})
            continue
        sub = validate_run(entry, deep=deep)
        report.findings += sub.findings
        rows.append({"step": step, "path": str(entry), "status": sub.status})
    report.details["checkpoints"] = rows
    statuses = {r["status"] for r in rows if not r["status"].startswith(("link to ", "dangling"))}
    if not statuses:
        report.defect("no_checkpoint", f"{path}: no checkpoint directory in it, only links")
    report.status = "damaged" if not report.ok else "verified" if statuses == {"verified"} else \
        "committed" if statuses <= {"verified", "committed"} else sorted(statuses)[0]
    return report


def _linked(entry: Path, what: str) -> str:
    return f"link to {entry.resolve().name}" if what == "link" else f"dangling link to {os.readlink(entry)}"


def ls_lightning_dir(path: "str | os.PathLike[str]", *, deep: bool = False) -> dict[str, Any]:
    """``ls`` in the run listing's shape: each checkpoint with its step, status, size and age (a
    link: the checkpoint it points at)."""
    from ..run.ops import ls_run  # lazy: the run layer's listing of each checkpoint
    now, rows = time.time(), []
    for step, entry, what in checkpoints(path):
        row: dict[str, Any] = {"step": step, "path": str(entry), "pinned": False, "metrics": {}, "size": None,
                               "age_s": None, "committed": False, "diverged": False, "non_finite": {}}
        if what != "checkpoint":
            rows.append({**row, "status": _linked(entry, what)})
            continue
        try:
            gen = ls_run(entry, deep=deep)["generations"][-1]
        except (CheckpointError, OSError, IndexError) as exc:
            rows.append({**row, "status": f"damaged: {exc}"})
            continue
        rows.append({**row, "status": f"{gen['status']} ({entry.name})", "size": fsio.tree_size(entry),
                     "age_s": round(max(0.0, now - entry.stat().st_mtime), 1), "metrics": gen.get("metrics") or {},
                     "committed": gen["committed"], "diverged": gen.get("diverged", False),
                     "non_finite": gen.get("non_finite") or {}})
    return {"run": str(path), "kind": "lightning-dir", "deep": deep, "generations": rows, "leftovers": [],
            "in_progress": [], "foreign": [], "lock": None, "leases": [], "mirrors": [], "policy": {}}


def inspect_lightning_dir(path: "str | os.PathLike[str]", inspect_run: Any) -> dict[str, Any]:
    """``ls`` of the directory and ``inspect_run(newest valid checkpoint)``, as for a run."""
    out = ls_lightning_dir(path)
    valid = [Path(r["path"]) for r in out["generations"]
             if r["status"].split(" ")[0] in ("verified", "committed", "diverged")]
    out["latest"] = inspect_run(valid[-1]).get("latest") if valid else None
    if not valid and out["generations"]:
        out["latest_problem"] = f"{path}: no checkpoint in it is valid"
    return out
