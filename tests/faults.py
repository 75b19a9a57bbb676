"""Fault-injection helpers for the reliability suite.

Scale: RELIABILITY_SCALE=long multiplies the counts (the long tier, scripts/long-tier.sh).
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

LONG = os.environ.get("RELIABILITY_SCALE") == "long"


def scale(ci: int, long: int) -> int:
    return long if LONG else ci


def arrays(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n).astype("<f4"), (rng.standard_normal(n) * 1e-3).astype("<f4"),
            (rng.random(n) * 1e-6).astype("<f4"))


@functools.lru_cache(maxsize=64)
def expected_digest(step: int, n: int) -> str:
    """blake3 of the file generation ``step`` must have (arrays seeded by the step)."""
    import blake3
    from ckptfmt import format as fmt
    h = blake3.blake3(fmt.pack_header(step, n))
    for a in arrays(n, step):
        h.update(a.tobytes())
    return h.hexdigest()


# A writer process: commits generations next, next+1, ... of N params, appending history and
# pruning to keep_last=2, and reports phases on stdout ("PHASE op path") when asked.
WRITER = r'''
import os, sys
sys.path.insert(0, {tests!r})
from faults import arrays
from ckptfmt import fsio
from ckptfmt.run import Run
run_dir, first, count, n, mode, target = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
calls = [0]
def hook(op, path):
    calls[0] += 1
    if mode == "count":
        return
    if mode == "crash" and calls[0] == int(target):
        os._exit(137)
    if mode == "phase" and op == target.split(":")[0] and target.split(":")[1] in path:
        sys.stdout.write("PHASE\n"); sys.stdout.flush()
fsio.hook = hook
run = Run(run_dir)
for step in range(first, first + count):
    run.commit(step, *arrays(n, step), manifest={{}})
    run.history.append({{"step": step, "loss": 1.0 / step}})
    run.history.sync()
    run.gc(keep_last=2)
    sys.stdout.write(f"ACK {{step}}\n"); sys.stdout.flush()
if mode == "count":
    print("CALLS", calls[0])
'''.format(tests=str(Path(__file__).resolve().parent))


def writer_argv(run_dir: Path, first: int, count: int, n: int, mode: str = "none", target: str = "0") -> list[str]:
    return [sys.executable, "-c", WRITER, str(run_dir), str(first), str(count), str(n), mode, target]


def base_run(directory: Path, n: int) -> Path:
    """A run with generation 1 committed and its history."""
    if (directory / "step_000001.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(writer_argv(directory, 1, 1, n), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return directory


def clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
