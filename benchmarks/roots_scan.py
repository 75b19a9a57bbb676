"""How long latest-valid's read of the history's root digests takes (spec/RUN.md §3.7): a
synthetic trainer history (one record a step, a checkpoint event every 1,000 steps) read by
``roots.recorded`` (event lines only, in chunks) against parsing every line as the history's
readers do (``history._lines`` + ``record_of``), alternating, min and median of ``--reps``.

    python -m benchmarks roots-scan --steps 1000000 --reps 5 --out benchmarks/results/roots_scan.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from harness.record import write_results

from ckptfmt.run import history as hist
from ckptfmt.run import roots


def write_history(path: str, steps: int) -> None:
    with open(path, "w") as f:
        for s in range(1, steps + 1):
            f.write('{"step":%d,"time":1733000000.123,"loss":%.6f,"lr":0.0003,"source":"a","tokens":4096}\n' % (s, 1 / s))
            if s % 1000 == 0:
                f.write(json.dumps({"event": "checkpoint", "step": s, "time": 1.0, "reason": "cadence",
                                    "root": "ab" * 32}, separators=(",", ":")) + "\n")


def every_line(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _, _, raw in hist._lines(f, None) if (hist.record_of(raw) or {}).get("event"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, hist.NAME)
        write_history(path, args.steps)
        times: dict[str, list[float]] = {"roots.recorded": [], "parse every line": []}
        for _ in range(args.reps):
            for name, fn in (("roots.recorded", roots.recorded), ("parse every line", every_line)):
                started = time.perf_counter()
                fn(path)
                times[name].append(time.perf_counter() - started)
        doc = {"steps": args.steps, "bytes": os.path.getsize(path), "reps": args.reps,
               "seconds": {k: {"min": round(min(v), 4), "median": round(statistics.median(v), 4)}
                           for k, v in times.items()}}
    print(json.dumps(doc, indent=1))
    if args.out:
        write_results("roots-scan", doc, args.out)


if __name__ == "__main__":
    main()
