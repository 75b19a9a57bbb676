"""What the history's state digests (spec/RUN.md §3.9) cost a step of the tiny config, and what
they add to ``.loss.json``.

    python -m benchmarks digests                  # ~40 s; writes benchmarks/results/digests.jsonl
    python -m benchmarks digests --reps 40 --block 25

One reference trainer (``ckptfmt train``'s loop: ``Trainer.train_step`` then the manager's
``step``, which records the history; no saves) of the tiny config on the CPU, warmed up, then
blocks of ``--block`` steps with the manager's digests on and off in turn (the order flips every
repetition, so drift hits both alike). Each step is timed alone, whole and its manager part
(``mgr.step``: the digests, the history's append, the save decision), by the wall clock and by
the thread's CPU clock (the tiny config trains on one thread; on a shared machine the CPU clock is
what other processes leave alone):
- ``step, digests on`` / ``off``: the whole step, min and median;
- ``manager's step, digests on`` / ``off``: its manager part, whose spread is a fraction of the
  whole step's; the digests' cost is the difference of the two medians (run right after the
  training step, with the caches as it leaves them: about three times a warm call);
- the bytes the ``state`` field adds to a step's line (measured on this run's lines), and at
  200,000 steps (the optimizer's step then has up to 6 digits).
The default of ``CheckpointManager(digests=...)`` follows: on if they cost at most 1 % of the
median step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.record import RESULTS, write_results

from ckptfmt.trainer import config as cfgmod
from ckptfmt.trainer.loop import Trainer

CONTENDERS = ("step, digests on", "step, digests off")
MANAGER = tuple(name.replace("step", "manager's step") for name in CONTENDERS)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}   # cpu: this thread's, whatever else runs
COST = "cost (manager's step, median on - off, / median step off)"
LONG_RUN = 200_000


def stats(samples: list[float]) -> dict[str, Any]:
    ms = [round(x * 1e3, 4) for x in samples]
    return {"min_ms": min(ms), "median_ms": statistics.median(ms), "n": len(ms), "samples": ms}


def timed_steps(t: Trainer, reps: int, block: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """Seconds of each step of each contender and of its manager part (``mgr.step`` through the
    trainer's ``_step``: the digests, the history's append, the save decision), by the wall clock
    and by this thread's CPU clock (the tiny config trains on one thread: the figure a shared
    machine's other processes leave alone)."""
    step, target = 0, 10 ** 9
    times: dict[str, dict[str, list[float]]] = {name: {clock: [] for clock in CLOCKS}
                                                for name in (*CONTENDERS, *MANAGER)}

    def one(contender: int | None) -> None:
        nonlocal step
        step += 1
        t.mgr.digests = contender == 0
        start = {clock: now() for clock, now in CLOCKS.items()}
        record = t.train_step(step)
        record.pop("ids")
        trained = {clock: now() for clock, now in CLOCKS.items()}
        t._step(step, target, record)
        end = {clock: now() for clock, now in CLOCKS.items()}
        for clock in CLOCKS if contender is not None else ():
            times[CONTENDERS[contender]][clock].append(end[clock] - start[clock])
            times[MANAGER[contender]][clock].append(end[clock] - trained[clock])
    for _ in range(warmup):
        one(None)
    for rep in range(reps):
        for contender in ((0, 1) if rep % 2 == 0 else (1, 0)):
            for _ in range(block):
                one(contender)
    return times


def field_bytes(history: Path) -> dict[str, Any]:
    """What ``state`` adds to the lines of ``history`` that have it (as the writer encodes it:
    ``,"state":{...}``), and at ``LONG_RUN`` steps, where the optimizer's step has more digits."""
    added, lines, digits = [], [], []
    for line in history.read_text().splitlines():
        rec = json.loads(line)
        if "state" not in rec:
            continue
        added.append(len(',"state":') + len(json.dumps(rec["state"], separators=(",", ":"))))
        lines.append(len(line) + 1)
        digits.append(len(str(rec["state"]["optimizer.step"])))
    long_digits = sum(len(str(k)) for k in range(1, LONG_RUN + 1)) / LONG_RUN
    per_step_long = statistics.mean(added) - statistics.mean(digits) + long_digits
    return {"components": sorted(rec["state"]) if added else [], "records": len(added),
            "bytes_per_step": statistics.mean(added), "line_bytes_with_state": statistics.mean(lines),
            "line_bytes_without_state": statistics.mean(lines) - statistics.mean(added),
            "bytes_per_step_over_200k_steps": per_step_long,
            "bytes_at_200k_steps": round(per_step_long * LONG_RUN)}


def measure(reps: int, block: int, warmup: int) -> dict[str, Any]:
    """The benchmark's document: each contender's figures by clock, the costs, the history's bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Trainer(Path(tmp) / "run", cfgmod.get("tiny"), device="cpu", checkpoint_every=0, sample_every=0,
                    log_every=10 ** 9, log=lambda message: None)
        t.build()
        t.resume()
        load_before = os.getloadavg()[0]
        times = timed_steps(t, reps, block, warmup)
        load_after = os.getloadavg()[0]
        t.close()
        sizes = field_bytes(Path(tmp) / "run" / ".loss.json")
    doc: dict[str, Any] = {"config": "tiny", "reps": reps, "block": block, "warmup": warmup,
                           "contenders": {name: {clock: stats(samples) for clock, samples in by_clock.items()}
                                          for name, by_clock in times.items()}}
    c = doc["contenders"]
    for clock in CLOCKS:
        off = c[CONTENDERS[1]][clock]["median_ms"]
        doc[f"cost (median step, on / off - 1), {clock}"] = c[CONTENDERS[0]][clock]["median_ms"] / off - 1
        doc[f"{COST}, {clock}"] = (c[MANAGER[0]][clock]["median_ms"] - c[MANAGER[1]][clock]["median_ms"]) / off
    doc["history"] = sizes
    doc["load_avg_1min_before"], doc["load_avg_1min_after"] = load_before, load_after
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30, help="repetitions of (on block, off block)")
    ap.add_argument("--block", type=int, default=20, help="steps per block")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--out", default=str(RESULTS / "digests.jsonl"))
    args = ap.parse_args()
    doc = measure(args.reps, args.block, args.warmup)
    print(json.dumps({k: v for k, v in doc.items() if k != "contenders"}, indent=1))
    write_results("digests", doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
