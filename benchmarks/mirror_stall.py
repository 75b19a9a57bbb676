"""The trainer's stall per checkpoint with ``--mirror URL`` against without: the
mirror runs on a background thread woken by the manager's commit hook, so the step loop should
pay nothing for it. Alternating runs of the tiny config; the stall is each ``checkpoint``
event's ``stall_ms`` in the run's history (what the loop waited in the save).

    python -m benchmarks mirror-stall --reps 3 --url file:///tmp/mirror-bench   # or s3://...
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.record import write_results

from ckptfmt.run import history as hist


def one(run: Path, steps: int, every: int, mirror: str | None) -> tuple[list[float], float]:
    """(stall of each checkpoint in ms, wall seconds) of one training run."""
    args = [sys.executable, "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", str(steps), "--config",
            "tiny", "--checkpoint-every", str(every), "--keep-last", "2", "--sample-every", "0",
            "--log-every", "100000", "--async-save"] + (["--mirror", mirror] if mirror else [])
    started = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    stalls = [e["stall_ms"] for e in hist.read(run / hist.NAME).events() if e["event"] == "checkpoint"]
    return stalls, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--url", required=True, help="the mirror's destination; a new path per run is used under it")
    ap.add_argument("--out", help="write the figures as results here (JSON lines)")
    args = ap.parse_args()
    stalls: dict[str, list[float]] = {"without": [], "with --mirror": []}
    walls: dict[str, list[float]] = {"without": [], "with --mirror": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name in ("without", "with --mirror") if rep % 2 == 0 else ("with --mirror", "without"):
                run = Path(tmp) / f"{name.replace(' ', '')}-{rep}"
                mirror = f"{args.url.rstrip('/')}/{run.name}" if name != "without" else None
                got, wall = one(run, args.steps, args.every, mirror)
                stalls[name] += got
                walls[name].append(wall)
                shutil.rmtree(run)
    out = {name: {"checkpoints": len(v), "stall_ms_median": statistics.median(v), "stall_ms_min": min(v),
                  "stall_ms_max": max(v), "wall_s_median": round(statistics.median(walls[name]), 2)}
           for name, v in stalls.items()}
    print(json.dumps({"results": out}, indent=1))
    if args.out:
        write_results("mirror-stall", {"results": out}, args.out)


if __name__ == "__main__":
    main()
