"""A Lightning ModelCheckpoint directory (spec/RUN.md §11.1): the checkpoint directories in it,
each a run of one generation, seen as one run by ``validate``, ``ls`` and ``inspect``.

Each checkpoint is judged as it is judged alone (``validate_run`` of its directory): the verdict
of the whole is the worst of theirs, and a directory whose checkpoints all validate is valid. A
link Lightning made (``save_last="link"``: ``last.ckpt`` pointing at a checkpoint of the same
directory) is listed as that link, not judged twice. The directory's own history (``.loss.json``,
``Checkpointing(history=True)``) is the callback's: its steps are counted, as a run's are.
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


def checkpoints(path: "str | os.PathLike[str]") -> list[tuple[int, Path, Path | None]]:
    """(step, checkpoint directory, the link's target where the entry is a link) of every
    Lightning checkpoint in ``path``, by step then name."""
    out = []
    for entry in sorted(Path(path).iterdir()):
        found = kinds.generation_in(entry) if entry.is_dir() else None
        if found is None:
            continue
        target = entry.resolve() if entry.is_symlink() else None
        out.append((fmt.parse_name(Path(found).name)[0], entry, target))
    return sorted(out, key=lambda row: (row[0], row[1].name))


def validate_lightning_dir(path: "str | os.PathLike[str]", validate_run: Any, *, deep: bool = True) -> Report:
    """Every checkpoint of the directory validated as a run of one generation (``validate_run``,
    validate's own, given by it); the findings of each, and the verdict of the whole: damaged
    where one is, else verified (committed)."""
    report = Report(str(path), kind="lightning-dir")
    rows = []
    for step, entry, target in checkpoints(path):
        if target is not None:
            rows.append({"step": step, "path": str(entry), "status": f"link to {target.name}"})
            continue
        sub = validate_run(entry, deep=deep)
        report.findings += sub.findings
        rows.append({"step": step, "path": str(entry), "status": sub.status})
    report.details["checkpoints"] = rows
    statuses = {r["status"] for r in rows if not r["status"].startswith("link to ")}
    report.status = "damaged" if not report.ok else "verified" if statuses == {"verified"} else \
        "committed" if statuses <= {"verified", "committed"} else sorted(statuses)[0]
    return report


def ls_lightning_dir(path: "str | os.PathLike[str]", *, deep: bool = False) -> dict[str, Any]:
    """``ls`` in the run listing's shape: each checkpoint with its step, status, size and age (a
    link: the checkpoint it points at)."""
    from ..run.ops import ls_run  # lazy: the run layer's listing of each checkpoint
    now, rows = time.time(), []
    for step, entry, target in checkpoints(path):
        row: dict[str, Any] = {"step": step, "path": str(entry), "pinned": False, "metrics": {}, "size": None,
                               "age_s": None, "committed": True}
        if target is not None:
            rows.append({**row, "status": f"link to {target.name}"})
            continue
        try:
            gen = ls_run(entry, deep=deep)["generations"][-1]
        except (CheckpointError, OSError, IndexError) as exc:
            rows.append({**row, "status": f"damaged: {exc}", "committed": False})
            continue
        rows.append({**row, "status": f"{gen['status']} ({entry.name})", "size": fsio.tree_size(entry),
                     "age_s": round(max(0.0, now - entry.stat().st_mtime), 1), "metrics": gen.get("metrics") or {},
                     "committed": gen["committed"]})
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
