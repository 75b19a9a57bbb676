"""What the history's state digests (spec/RUN.md §3.9) cost a step of the tiny config, and what
they add to ``.loss.json``.

    .venv/bin/python benchmarks/digests_bench.py                      # ~40 s; writes results/digests.json
    .venv/bin/python benchmarks/digests_bench.py --reps 40 --block 25
    .venv/bin/python benchmarks/digests_bench.py --table benchmarks/results/digests.json

One reference trainer (``ckptfmt train``'s loop: ``Trainer.train_step`` then the manager's
``step``, which records the history; no saves) of the tiny config on the CPU, warmed up, then
blocks of ``--block`` steps with the manager's digests on and off in turn (the order flips every
repetition, so drift hits both alike). Each step is timed alone, whole and its manager part
(``mgr.step``: the digests, the history's append, the save decision), whose spread is a
fraction of the whole step's on a shared machine:
- ``step, digests on`` / ``off``: the whole step, min and median;
- ``manager's step, digests on`` / ``off``: its manager part; the digests' cost is the
  difference of the two medians (run right after the training step, with the caches as it leaves
  them: about three times the time of a warm call);
- the bytes the ``state`` field adds to a step's line (measured on this run's lines), and at
  200,000 steps (the optimizer's step then has up to 6 digits).
The default of ``CheckpointManager(digests=...)`` follows: on if they cost at most 1 % of the
median step.
"""
from __future__ import annotations

import argparse
import datetime
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

from ckptfmt.trainer import config as cfgmod  # noqa: E402
from ckptfmt.trainer.loop import Trainer  # noqa: E402

CONTENDERS = ("step, digests on", "step, digests off")
MANAGER = tuple(name.replace("step", "manager's step") for name in CONTENDERS)
COST = "cost (manager's step, median on - off, / median step off)"
LONG_RUN = 200_000


def stats(samples: list[float]) -> dict[str, float]:
    return {"min_ms": min(samples) * 1e3, "median_ms": statistics.median(samples) * 1e3, "n": len(samples)}


def timed_steps(t: Trainer, reps: int, block: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """Per contender, seconds of each whole step and of its manager part (``mgr.step`` through
    the trainer's ``_step``: the digests, the history's append, the save decision)."""
    step, target = 0, 10 ** 9
    times: dict[str, dict[str, list[float]]] = {k: {"step": [], "manager": []} for k in CONTENDERS}

    def one(name: str) -> None:
        nonlocal step
        step += 1
        t.mgr.digests = name == CONTENDERS[0]
        start = time.perf_counter()
        record = t.train_step(step)
        record.pop("ids")
        trained = time.perf_counter()
        t._step(step, target, record)
        end = time.perf_counter()
        if name in times:
            times[name]["step"].append(end - start)
            times[name]["manager"].append(end - trained)
    for _ in range(warmup):
        one("warm-up")
    for rep in range(reps):
        for name in (CONTENDERS if rep % 2 == 0 else CONTENDERS[::-1]):
            for _ in range(block):
                one(name)
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
    out: dict[str, Any] = {}
    for name in CONTENDERS:
        out[name] = stats(times[name]["step"])
    for name, manager in zip(CONTENDERS, MANAGER):
        out[manager] = stats(times[name]["manager"])
    off = out[CONTENDERS[1]]["median_ms"]
    out["cost (median step, on / off - 1)"] = out[CONTENDERS[0]]["median_ms"] / off - 1
    out[COST] = (out[MANAGER[0]]["median_ms"] - out[MANAGER[1]]["median_ms"]) / off
    out["history"] = sizes
    out["load_before"], out["load_after"] = load_before, load_after
    return out


def table(result: dict[str, Any]) -> str:
    """The markdown table of benchmarks/README.md."""
    r = result["tiny"]
    rows = ["| | min ms | median ms |", "|---|---|---|"]
    for name in (*CONTENDERS, *MANAGER):
        rows.append(f"| {name} | {r[name]['min_ms']:.3f} | {r[name]['median_ms']:.3f} |")
    h = r["history"]
    rows += ["", f"Cost: {r[COST] * 100:.2f} % "
             f"of the median step by the manager's step ({r['cost (median step, on / off - 1)'] * 100:+.2f} % by "
             f"the whole steps' medians). `state` adds {h['bytes_per_step']:.0f} bytes to a step's line "
             f"({h['line_bytes_without_state']:.0f} without it), {h['bytes_at_200k_steps'] / 1e6:.1f} MB at 200,000 steps."]
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
    result = {"when": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
              "command": " ".join(["benchmarks/digests_bench.py"] + sys.argv[1:]),
              "tiny": measure(args.reps, args.block, args.warmup)}
    result["seconds"] = round(time.time() - started, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
