"""Measurement helpers: timing with alternation, peak RSS per operation, page-cache control."""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


def drop_cache(path: str) -> bool:
    """Evict one file's clean pages (no root needed); True if it worked."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def reset_peak_rss() -> int:
    """Reset VmHWM (Linux clear_refs 5) and return the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def peak_rss() -> int:
    return _status("VmHWM")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def measure(fn: Callable[[], Any], setup: Callable[[], Any] | None = None) -> tuple[float, int]:
    """(seconds, peak RSS above the starting RSS in bytes) of one call."""
    if setup:
        setup()
    gc.collect()
    base = reset_peak_rss()
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    return seconds, max(0, peak_rss() - base)


def summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def touch(a: np.ndarray) -> np.ndarray:
    """Fault every page in now, so no contender pays for fresh memory inside its timing."""
    a.view(np.uint8)[::4096] = 0
    return a


def fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable(write: Callable[[str], None], final: str) -> None:
    """The same durability for every peer: temp file, fsync, rename, fsync the directory."""
    tmp = final + ".tmp"
    write(tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(final)


def size_arguments(doc: str, sizes: str, reps: int, out: str) -> argparse.ArgumentParser:
    """The options every sized benchmark takes: --sizes, --reps, --dir (scratch, default
    /work/bench), --out (results JSON) and --table (print the README table of a results file)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--sizes", default=sizes)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--dir", default="/work/bench" if os.path.isdir("/work") else None)
    ap.add_argument("--out", default=out)
    ap.add_argument("--table", metavar="JSON", help="Only print the README table of a results file.")
    return ap


def header(script: str) -> dict[str, Any]:
    """What a results file records first: when, the machine's CPU count and the command line."""
    return {"when": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
            "command": " ".join([f"benchmarks/{script}"] + sys.argv[1:])}


def finish(result: dict[str, Any], started: float, out: str, table: Callable[[dict[str, Any]], str]) -> int:
    """The seconds since ``started`` recorded, the results file written, its README table printed."""
    result["seconds"] = round(time.time() - started, 1)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0
