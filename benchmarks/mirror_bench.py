"""Mirror throughput against a plain upload of the same file: what verifying and committing at the destination cost.

    python -m benchmarks mirror [--n-params 12800000] [--reps 3] [--out benchmarks/results/mirror.jsonl]

Against the tests' local S3 server (moto_server on 127.0.0.1, in memory, one Python process):
boto3's ``upload_file`` of the .bin (what ``aws s3 cp`` does: multipart, 10 threads) against
``ckptfmt mirror`` of a run holding that one generation (its own 16 MiB parts, four in flight,
hashed while sent, every object confirmed by the ETag S3 computed, then the manifest, read back). Contenders alternate within each
repetition; each mirror goes to a fresh prefix. The server, not the network, bounds both here, so
the ratio says what the verification costs on top of a plain upload, not what S3 would give.
Prints one JSON line; ``--out`` writes it as results (docs/benchmarks/object-storage.md).
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

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from s3server import S3Server  # noqa: E402
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.record import write_results  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt.run.mirror import mirror  # noqa: E402
from ckptfmt.store import confirm  # noqa: E402
from ckptfmt.store.objects import ObjectStore  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-params", type=int, default=12_800_000)     # andrea-12m: 153.6 MB
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="write the figures as results here (JSON lines)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp, S3Server() as s3:
        os.environ.update(s3.env)
        s3.bucket("bench")
        run = Path(tmp) / "run"
        run.mkdir()
        regions = [(rng.standard_normal(args.n_params) * s).astype("<f4") for s in (0.02, 1e-3, 1e-6)]
        ckptfmt.save_generation(run, 1000, *regions)
        path = run / "step_001000.bin"
        size = path.stat().st_size
        client = s3.client()
        plain, mirrored, sent, confirmed, read_back = [], [], [], [], []
        for i in range(args.reps):
            t = time.perf_counter()
            client.upload_file(str(path), "bench", f"plain{i}/step_001000.bin")
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            doc = mirror(run, f"s3://bench/mirror{i}")
            mirrored.append(time.perf_counter() - t)
            assert [u["step"] for u in doc["uploaded"]] == [1000]
            remote = ObjectStore(f"s3://bench/parts{i}")  # the parts of the mirror's cost
            t = time.perf_counter()
            written = remote.upload(path, path.name, None)
            sent.append(time.perf_counter() - t)
            t = time.perf_counter()
            confirm(remote, [written])                     # the size and the ETag S3 computed: one HEAD
            confirmed.append(time.perf_counter() - t)
            t = time.perf_counter()
            remote.digest(path.name)                       # what a store whose ETags are not MD5s pays instead
            read_back.append(time.perf_counter() - t)
    p, m = statistics.median(plain), statistics.median(mirrored)
    doc = {"bytes": size, "reps": args.reps, "upload_file_s": round(p, 3), "mirror_s": round(m, 3),
                      "mirror_over_upload_file": round(m / p, 2), "upload_file_mbps": round(size / p / 1e6, 1),
                      "mirror_mbps": round(size / m / 1e6, 1), "of_which_streamed_upload_s": round(statistics.median(sent), 3),
                      "of_which_confirm_s": round(statistics.median(confirmed), 3),
                      "read_back_instead_s": round(statistics.median(read_back), 3),
                      "server": "moto_server 127.0.0.1 (in memory)"}
    print(json.dumps(doc))
    if args.out:
        write_results("mirror", doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
