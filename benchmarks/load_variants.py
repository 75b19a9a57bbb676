"""Ways to load with the hash check, measured against each other in one run.

    python -m benchmarks load-variants            # andrea-12m, 7 repetitions

The figures behind the choices in ``ckptfmt.torch.load``: hash first and copy after (what the
library does), hash on a second thread while copying, and a fused loop that hashes a chunk and
copies it while it is still in cache; the copy alone is the limit. The hash variants copy the
whole file into one flat buffer, so they differ only in how hash and copy are scheduled. Also:
the library's load without the hash, releasing mapped pages per tensor (``BATCH = 0``) against
32 MiB batches. Writes benchmarks/results/load_variants.jsonl.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import blake3
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure  # noqa: E402
from run import build_state  # noqa: E402
from harness.record import write_results  # noqa: E402
from harness.render import tables  # noqa: E402

import ckptfmt.reader as reader  # noqa: E402
import ckptfmt.torch as ct  # noqa: E402


def mapped(path: str) -> tuple[mmap.mmap, torch.Tensor]:
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return mm, torch.from_numpy(np.frombuffer(mm, np.uint8))


def flat_contenders(path: str, dst: torch.Tensor) -> dict:
    def copy_only():
        mm, src = mapped(path)
        dst.copy_(src)
        del src
        mm.close()

    def hash_then_copy():
        mm, src = mapped(path)
        blake3.blake3(memoryview(mm), max_threads=blake3.blake3.AUTO).hexdigest()
        dst.copy_(src)
        del src
        mm.close()

    def hash_while_copying():
        mm, src = mapped(path)
        hasher = threading.Thread(target=lambda: blake3.blake3(memoryview(mm), max_threads=blake3.blake3.AUTO).hexdigest())
        hasher.start()
        dst.copy_(src)
        hasher.join()
        del src
        mm.close()

    def fused(chunk: int):
        def run():
            mm, src = mapped(path)
            h, view = blake3.blake3(max_threads=1), memoryview(mm)
            for a in range(0, len(view), chunk):
                h.update(view[a:a + chunk])
                dst[a:a + chunk].copy_(src[a:a + chunk])
            h.hexdigest()
            del src, view
            mm.close()
        return run

    return {"copy only (limit)": copy_only, "hash, then copy": hash_then_copy,
            "hash on a thread while copying": hash_while_copying,
            "fused, 1 MiB chunks": fused(1 << 20), "fused, 4 MiB chunks": fused(4 << 20)}


def library_contenders(path: str, model, opt) -> dict:
    def unverified(batch: int):
        def run():
            reader.ReleaseBehind.BATCH = batch
            ct.load(path, model, opt, verify=False).close()
        return run
    return {"ckptfmt.torch.load, no hash, release per tensor": unverified(0),
            "ckptfmt.torch.load, no hash, release per 32 MiB": unverified(32 << 20)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="andrea-12m")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default="/work/bench" if os.path.isdir("/work") else None)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "load_variants.jsonl"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ckptfmt-variants-", dir=args.dir) as d:
        model, opt = build_state(args.config, seed=0)
        path = str(Path(d) / "step_001000.bin")
        ct.save(path, model, opt)
        target, target_opt = build_state(args.config, seed=1)
        dst = torch.empty(os.path.getsize(path), dtype=torch.uint8).fill_(1)     # prewarmed
        groups = {"flat": flat_contenders(path, dst), "library": library_contenders(path, target, target_opt)}
        times: dict = {g: {k: [] for k in c} for g, c in groups.items()}
        for _ in range(args.reps):                       # alternate every contender in each repetition
            for g, contenders in groups.items():
                for name, fn in contenders.items():
                    times[g][name].append(measure(fn)[0])
        reader.ReleaseBehind.BATCH = 32 << 20
    limit = statistics.median(times["flat"]["copy only (limit)"])
    out = {"config": args.config, "bytes": dst.numel(), "reps": args.reps,
           "command": " ".join([".venv/bin/python", "benchmarks/load_variants.py"] + sys.argv[1:]),
           "median_ms": {name: statistics.median(v) * 1e3 for g in times.values() for name, v in g.items()}}
    out["vs_copy_limit"] = {k: limit * 1e3 / v for k, v in out["median_ms"].items()}
    print(tables(write_results("load-variants", out, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
