"""Export with verification against a plain copy of the same files.

    python -m benchmarks export [--config andrea-12m] [--reps 3] [--out benchmarks/results/export.jsonl]

Both sides end durable: `cp -r` is followed by `sync`. ckptfmt export additionally re-reads and
hashes every file at the destination, validates the newest generation and loads it into a fresh
model + AdamW. Prints a JSON line; ``--out`` writes it as results (docs/benchmarks/validate.md).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import build_state  # noqa: E402
from harness.record import write_results  # noqa: E402

import ckptfmt.torch as ct  # noqa: E402
from ckptfmt.tools.export import export  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="andrea-12m")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/work/bench")
    ap.add_argument("--out", help="write the figures as results here (JSON lines)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(dir=args.dir))
    run = base / "run"
    run.mkdir()
    model, opt = build_state(args.config)
    from ckptfmt.trainer.config import CONFIGS
    from ckptfmt.trainer.export_check import export_check
    manifest = {"config": CONFIGS[args.config].to_dict()}
    ct.save(str(run / "step_001000.bin"), model, opt, manifest=manifest)
    (run / ".loss.json").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 1001)))
    size = sum(p.stat().st_size for p in run.iterdir())
    cp, ex = [], []
    for i in range(args.reps):
        dest = base / f"cp{i}"
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(run), str(dest)], check=True)
        subprocess.run(["sync"], check=True)
        cp.append(time.perf_counter() - t)
        t = time.perf_counter()
        doc = export(str(run), str(base / f"ex{i}"), check=export_check)
        ex.append(time.perf_counter() - t)
    shutil.rmtree(base)
    out = {"config": args.config, "bytes": size, "reps": args.reps, "cp_sync_s": statistics.median(cp), "export_s": statistics.median(ex),
           "export_over_cp": statistics.median(ex) / statistics.median(cp), "verified": doc["verified"],
           "cp_gbps": size / statistics.median(cp) / 1e9, "export_gbps": size / statistics.median(ex) / 1e9}
    print(json.dumps(out))
    if args.out:
        write_results("export", out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
