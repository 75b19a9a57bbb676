"""What the save-time value-facts pass costs, and what it buys deep validation.

    python -m benchmarks facts                  # 12.8M and 120M, 5 repetitions
    python -m benchmarks facts --sizes 12.8M --reps 3
    python -m benchmarks facts --table benchmarks/results/facts.jsonl

Contenders, alternating within each repetition (the order flips every repetition), all through
``ckptfmt.torch.save`` (durable: temp, fsync, rename, directory fsync) of the reference model +
AdamW with trained-looking values:
- ``save``: today's writer, value facts folded in on the hashing thread (spec/FORMAT.md §5.9);
- ``save, no facts``: the same writer with ``value_facts=False``;
- ``write only``: the writer's durable write alone (``atomic.AtomicWriter``: 8 MiB writes,
  writeback started every 64 MiB, fsync, rename, directory fsync) of the same bytes from memory:
  no hash, no facts, the floor a hashing save is measured against.
Then, on the committed generation: deep ``validate`` (one hash, the recorded facts) against
``validate --scan`` (hash and value scan in parallel, as before the facts were recorded at save). Alone, for scale: the
facts pass and blake3 with one thread over the same bytes in memory. The machine's load average
is recorded before and after each size (the machine is shared). Writes
benchmarks/results/facts.jsonl; docs/benchmarks/save.md's tables are rendered from it.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import size_arguments, measure, summary  # noqa: E402
from harness.record import write_results  # noqa: E402
from harness.render import tables  # noqa: E402
from run import CHUNK, SIZES, build_state, flat_bytes  # noqa: E402

import numpy as np  # noqa: E402

import ckptfmt.torch as ct  # noqa: E402
from ckptfmt import atomic  # noqa: E402
from ckptfmt import facts as valfacts  # noqa: E402
from ckptfmt import fingerprint  # noqa: E402
from ckptfmt import format as fmt  # noqa: E402
from ckptfmt import manifest as mf  # noqa: E402
from ckptfmt.tools.validate import validate_file  # noqa: E402


def alternate(fns: dict, reps: int) -> dict[str, list[float]]:
    """Seconds per contender; the order flips every repetition so drift hits both alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            os.sync()
            times[name].append(measure(fns[name])[0])
    return times


def savers(model, opt, ck: str, raw: np.ndarray) -> dict:
    def save(facts: bool):
        def run() -> None:
            for p in (ck, mf.path_for(ck)):
                if os.path.exists(p):
                    os.unlink(p)
            ct.save(ck, model, opt, value_facts=facts)
        return run

    def write_only() -> None:
        if os.path.exists(ck + ".raw"):   # as the saves do: renaming over a big file costs more
            os.unlink(ck + ".raw")
        mv = memoryview(raw)
        with atomic.AtomicWriter(ck + ".raw") as out:
            for start in range(0, len(mv), CHUNK):
                out.write(mv[start:start + CHUNK])
            out.commit()
    return {"save": save(True), "save, no facts": save(False), "write only": write_only}


def validators(ck: str) -> dict:
    def check(scan: bool):
        def run() -> None:
            report = validate_file(ck, scan=scan)
            assert report.ok and report.details["values"] == ("scanned" if scan else "recorded")
        return run
    return {"validate (recorded facts)": check(False), "validate --scan": check(True)}


def in_memory(raw: np.ndarray, n: int, reps: int) -> dict:
    """The facts pass and a one-thread blake3 over the same bytes, no I/O."""
    def facts() -> None:
        f = valfacts.ValueFacts()
        view = raw[8:].view(fmt.DTYPE)
        for k, name in enumerate(fmt.REGIONS):
            region = view[k * n:(k + 1) * n]
            for start in range(0, n, 2 << 20):          # the writer's 8 MiB chunks
                f.add(name, region[start:start + (2 << 20)])

    def blake3_1() -> None:
        h = fingerprint.hasher(1)
        mv = memoryview(raw)
        for start in range(0, len(mv), 8 << 20):
            h.update(mv[start:start + (8 << 20)])
    return alternate({"facts pass alone": facts, "blake3, 1 thread, alone": blake3_1}, reps)


def measure_size(label: str, reps: int, directory: str | None) -> dict:
    model, opt = build_state(SIZES[label])
    raw = flat_bytes(model, opt)
    n = (raw.nbytes - 8) // 12
    row: dict = {"bytes": int(raw.nbytes), "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        ck = str(Path(tmp) / "step_001000.bin")
        fns = savers(model, opt, ck, raw)
        times = alternate(fns, reps)
        fns["save"]()                      # the generation validated next has its facts
        times.update(alternate(validators(ck), reps))
    times.update(in_memory(raw, n, reps))
    row["load_after"] = os.getloadavg()
    for name, samples in times.items():
        row[name] = {**summary(samples), "gbps": raw.nbytes / summary(samples)["median"] / 1e9}
    row["save cost of facts (median ratio)"] = row["save"]["median"] / row["save, no facts"]["median"]
    row["save vs write only (speed, median)"] = {k: row["write only"]["median"] / row[k]["median"]
                                                 for k in ("save", "save, no facts")}
    row["validate speed-up (median ratio)"] = row["validate --scan"]["median"] / row["validate (recorded facts)"]["median"]
    return row


def main() -> int:
    ap = size_arguments(__doc__, "12.8M,120M", 5, str(HERE / "results" / "facts.jsonl"))
    args = ap.parse_args()
    if args.table:
        print(tables(args.table, "facts"))
        return 0
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    result = {"when": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
              "command": " ".join(["benchmarks/facts_bench.py"] + sys.argv[1:]), "sizes": {}}
    started = time.time()
    for label in args.sizes.split(","):
        result["sizes"][label] = row = measure_size(label, args.reps, args.dir)
        print(label, json.dumps(row, indent=1), flush=True)
    result["seconds"] = round(time.time() - started, 1)
    print(tables(write_results("facts", result, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
