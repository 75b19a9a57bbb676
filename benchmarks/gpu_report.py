"""The report of benchmarks/gpu_check.py, rewritten after every stage.

``gpu_check.json`` is replaced atomically each time a stage ends (a kill between stages leaves
the last complete report, never half of one); ``gpu_check.log`` grows by each stage's own output
and the tail of every trainer's stderr, so an error on the GPU machine comes back even when the
command runs out of time. The summary ratios are recomputed from whatever throughput stages
finished: a save is compared with its own floor (the slowest of the pinned D2H copy, blake3 on
every core and write + fsync, the three things it pipelines), not with the D2H copy alone.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from gpu_stage import atomic_json, tail
from harness.record import write_results

STAGE_LOG_LINES, RUN_LOG_LINES = 40, 15
NOT_A_FAILURE = ("--stop-after", "not selected")     # skips the caller asked for


def exit_code(stages: dict[str, dict[str, Any]]) -> int:
    """1 when a check failed; 2 when a stage could not run or finish; else 0."""
    statuses = [e["status"] for e in stages.values()]
    if "failed" in statuses:
        return 1
    for entry in stages.values():
        if entry["status"] in ("timed_out", "error", "pending"):
            return 2
        if entry["status"] == "skipped" and not entry.get("reason", "").startswith(NOT_A_FAILURE):
            return 2
    return 0


def _ratio(a: Any, b: Any) -> float | None:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0
    return round(a / b, 3) if ok else None


def summarize(stages: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios between the throughput stages' figures (those that finished)."""
    lim = stages.get("throughput_limits", {}).get("gbps", {})
    save = stages.get("throughput_save", {})
    load = stages.get("throughput_load", {})
    limits = [lim.get(k) for k in ("d2h_pinned", "blake3_all_cores", "write_fsync")]
    floor = min([x for x in limits if isinstance(x, (int, float))], default=None)
    saved = save.get("gbps", {})
    warm, cold = load.get("warm_gbps", {}), load.get("cold_gbps") or {}
    out = {
        "save_floor_gbps": floor,
        "save_vs_its_floor": _ratio(saved.get("ct.save"), floor),
        "save_vs_write_fsync": _ratio(saved.get("ct.save"), lim.get("write_fsync")),
        "save_vs_torch_save": _ratio(saved.get("ct.save"), saved.get("torch.save")),
        "save_vs_safetensors": _ratio(saved.get("ct.save"), saved.get("safetensors")),
        "async_stall_vs_sync_stall": _ratio(save.get("stall_ms", {}).get("async"), save.get("stall_ms", {}).get("sync")),
        "load_warm_verified_vs_h2d": _ratio(warm.get("ct.load verify"), lim.get("h2d_pinned")),
        "load_warm_unverified_vs_h2d": _ratio(warm.get("ct.load no verify"), lim.get("h2d_pinned")),
        "load_warm_verified_vs_torch_load": _ratio(warm.get("ct.load verify"), warm.get("torch.load")),
        "load_warm_verified_vs_safetensors": _ratio(warm.get("ct.load verify"), warm.get("safetensors")),
        "load_cold_verified_vs_torch_load": _ratio(cold.get("ct.load verify"), cold.get("torch.load")),
        "load_cold_verified_vs_safetensors": _ratio(cold.get("ct.load verify"), cold.get("safetensors")),
    }
    return {k: v for k, v in out.items() if v is not None}


class Report:
    """``gpu_check.json`` and ``gpu_check.log`` in ``out``, and one line per stage on stdout."""

    def __init__(self, out: Path, mode: str, deadline_s: float, stages: list[tuple[str, str, float]]):
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.log_path = out / "gpu_check.json", out / "gpu_check.log"
        self.started = time.monotonic()
        self.current: str | None = None
        self.doc: dict[str, Any] = {
            "check": "benchmarks/gpu_check.py", "mode": mode, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "deadline_s": deadline_s, "elapsed_s": 0.0, "finished": False, "exit_code": None, "summary": {},
            "stages": {name: {"status": "pending", "what": what, "budget_s": budget} for name, what, budget in stages}}
        self.log_path.write_text(f"gpu_check ({mode}), started {self.doc['started']}, deadline {deadline_s:g} s\n")
        self._save()

    def _save(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - self.started, 2)
        self.doc["summary"] = summarize(self.doc["stages"])
        self.doc["exit_code"] = exit_code(self.doc["stages"])
        atomic_json(self.json_path, self.doc)

    def begin(self, name: str) -> None:
        self.current = name

    def set(self, name: str, entry: dict[str, Any], folder: Path | None = None) -> None:
        """Record a stage's outcome: JSON, log, one line on stdout."""
        self.doc["stages"][name] = {"what": self.doc["stages"][name]["what"], **entry}
        self._save()
        self._log(name, entry, folder)
        elapsed = time.monotonic() - self.started
        why = entry.get("line") or entry.get("reason")
        print(f"[{elapsed:6.1f} s] {name}: {entry['status']}" + (f" ({why})" if why else ""), flush=True)

    def _log(self, name: str, entry: dict[str, Any], folder: Path | None) -> None:
        lines = [f"== {name}: {entry['status']} ({entry.get('seconds', 0):.1f} s)"
                 + (f": {entry['reason']}" if entry.get("reason") else "")]
        if folder is not None and folder.is_dir():
            stage_log = tail(folder / "stage.log", STAGE_LOG_LINES)
            if stage_log:
                lines += [f"-- the stage's output (last {STAGE_LOG_LINES} lines)"] + ["   " + x for x in stage_log]
            for run_log in sorted(folder.glob("run-*.log")):
                lines += [f"-- {run_log.stem[4:]}: the trainer's stderr (last {RUN_LOG_LINES} lines)"]
                lines += ["   " + x for x in tail(run_log, RUN_LOG_LINES)]
        with open(self.log_path, "a") as f:
            f.write("\n".join(lines) + "\n")

    def interrupted(self, signame: str) -> None:
        """The driver got a signal (the wrapper's total timeout): record it, skip the rest."""
        for name, entry in self.doc["stages"].items():
            if entry["status"] == "pending":
                cut = name == self.current
                self.doc["stages"][name] = {"what": entry["what"], "status": "timed_out" if cut else "skipped",
                                            "reason": f"interrupted by {signame}" + (" while it ran" if cut else "")}
        self._save()
        with open(self.log_path, "a") as f:
            f.write(f"== interrupted by {signame} during {self.current}\n")

    def finish(self) -> int:
        """The final report (also as results, ``gpu_check.jsonl``: the machine as the
        environment stage saw it); the exit code."""
        self.doc["finished"] = True
        self._save()
        env = self.doc["stages"].get("environment", {})
        machine = {k: env[k] for k in ("gpu", "driver", "python", "platform", "packages") if k in env}
        try:
            write_results("gpu-check", {**self.doc, "machine": machine}, self.json_path.with_suffix(".jsonl"))
        except (OSError, ValueError) as exc:                # the report above is what counts
            print(f"gpu_check: results not written: {exc}", file=sys.stderr, flush=True)
        code = self.doc["exit_code"]
        print(f"gpu_check: exit {code}; report {self.json_path}, log {self.log_path}", file=sys.stderr, flush=True)
        return code
