"""What every stage of benchmarks/gpu_check.py shares: its context (mode, folder, deadline) and
the JSON it leaves behind as it goes.

A stage runs in its own process, which the driver kills when the stage's budget is spent. So a
stage records what it has measured after every unit of work (``Context.record``, an atomic
replace of its result file): a stage cut short still hands the driver what it had.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARGIN_S = 1.0      # a stage stops itself this long before the driver would kill it


class StageTimeout(Exception):
    """The stage's own deadline passed while it waited (for a trainer, a marker, a process)."""


def atomic_json(path: Path, doc: Any) -> None:
    """Write ``doc`` so a reader (or a kill) never sees half a file: temp, fsync, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """A stage's result file, or None when it wrote none (killed before its first record)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tail(path: Path, lines: int) -> list[str]:
    """The last ``lines`` lines of a log (decoded leniently: a trainer may die mid-line)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


@dataclass
class Context:
    """One stage's run: ``dry_run`` (CPU, small sizes), its own folder, its deadline."""
    name: str
    dry_run: bool
    folder: Path
    budget_s: float
    inject_failure: bool = False
    started: float = field(default_factory=time.monotonic)
    found: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> str:
        """cuda on the GPU machine, cpu in the dry run."""
        return "cpu" if self.dry_run else "cuda"

    @property
    def result_path(self) -> Path:
        return self.folder / "result.json"

    def left(self) -> float:
        """Seconds until this stage should stop itself (the driver kills it ``MARGIN_S`` later)."""
        return self.started + self.budget_s - MARGIN_S - time.monotonic()

    def check_time(self, what: str) -> None:
        """Raise ``StageTimeout`` once the deadline has passed (between units of work)."""
        if self.left() <= 0:
            raise StageTimeout(f"budget of {self.budget_s:g} s spent before {what}")

    def record(self, **fields: Any) -> None:
        """Keep what was measured so far, on disk at once (the driver reads it after a kill)."""
        self.found.update(fields)
        atomic_json(self.result_path, {"partial": True, **self.found})

    def finish(self, status: str, **fields: Any) -> None:
        """The stage's verdict: passed, failed (a check found a defect), done (measured only)."""
        self.found.update(fields)
        atomic_json(self.result_path, {"partial": False, "status": status, **self.found})
