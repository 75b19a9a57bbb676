"""What the history's state digests (spec/RUN.md §3.9) cost a step of the tiny config, and what
they add to ``.loss.json``.

    .venv/bin/python benchmarks/digests_bench.py                      # ~40 s; writes results/digests.json
    .venv/bin/python benchmarks/digests_bench.py --reps 40 --block 25
    .venv/bin/python benchmarks/digests_bench.py --table benchmarks/results/digests.json

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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from common import finish, header  # noqa: E402

from ckptfmt.trainer import config as cfgmod  # noqa: E402
from ckptfmt.trainer.loop import Trainer  # noqa: E402

CONTENDERS = ("step, digests on", "step, digests off")
MANAGER = tuple(name.replace("step", "manager's step") for name in CONTENDERS)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}   # cpu: this thread's, whatever else runs
COST = "cost (manager's step, median on - off, / median step off)"
LONG_RUN = 200_000


def stats(samples: list[float]) -> dict[str, float]:
    return {"min_ms": min(samples) * 1e3, "median_ms": statistics.median(samples) * 1e3, "n": len(samples)}


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
    with tempfile.TemporaryDirectory() as tmp:
        t = Trainer(Path(tmp) / "run", cfgmod.get("tiny"), device="cpu", checkpoint_every=0, sample_every=0,
                    log_every=10 ** 9, log=lambda message: None)
        t.build()
        t.resume()
        load_before = os.getloadavg()
        times = timed_steps(t, reps, block, warmup)
        load_after = os.getloadavg()
        t.close()
        sizes = field_bytes(Path(tmp) / "run" / ".loss.json")
    out: dict[str, Any] = {name: {clock: stats(samples) for clock, samples in by_clock.items()}
                           for name, by_clock in times.items()}
    for clock in CLOCKS:
        off = out[CONTENDERS[1]][clock]["median_ms"]
        out[f"cost (median step, on / off - 1), {clock}"] = out[CONTENDERS[0]][clock]["median_ms"] / off - 1
        out[f"{COST}, {clock}"] = (out[MANAGER[0]][clock]["median_ms"] - out[MANAGER[1]][clock]["median_ms"]) / off
    out["history"] = sizes
    out["load_before"], out["load_after"] = load_before, load_after
    return out


def table(result: dict[str, Any]) -> str:
    """The markdown table of benchmarks/README.md."""
    r = result["tiny"]
    rows = ["| | min ms, wall | median ms, wall | min ms, CPU | median ms, CPU |", "|---|---|---|---|---|"]
    for name in (*CONTENDERS, *MANAGER):
        rows.append(f"| {name} | " + " | ".join(f"{r[name][clock]['min_ms']:.3f} | {r[name][clock]['median_ms']:.3f}"
                                                for clock in CLOCKS) + " |")
    h = r["history"]
    rows += ["", "Cost of the digests (the manager's step, median on - off, over the median step off): "
             + ", ".join(f"{r[f'{COST}, {clock}'] * 100:.2f} % by the {clock} clock" for clock in CLOCKS)
             + " (" + ", ".join(f"{r[f'cost (median step, on / off - 1), {clock}'] * 100:+.2f} %"
                                for clock in CLOCKS) + " by the whole steps' medians). "
             f"`state` adds {h['bytes_per_step']:.0f} bytes to a step's line ({h['line_bytes_without_state']:.0f} "
             f"without it), {h['bytes_at_200k_steps'] / 1e6:.1f} MB at 200,000 steps."]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30, help="repetitions of (on block, off block)")
    ap.add_argument("--block", type=int, default=20, help="steps per block")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--out", default=str(HERE / "results" / "digests.json"))
    ap.add_argument("--table", help="print the table of a results file and exit")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    started = time.time()
    result = {**header("digests_bench.py"), "tiny": measure(args.reps, args.block, args.warmup)}
    return finish(result, started, args.out, table)


if __name__ == "__main__":
    sys.exit(main())
