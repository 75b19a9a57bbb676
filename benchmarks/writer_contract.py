"""Save cost of the writer's buffer contract, before vs after, in one run.

    python -m benchmarks writer-contract                 # 12.8M and 120M, 5 repetitions
    python -m benchmarks writer-contract --sizes 12.8M --reps 3

Contenders, alternating within each repetition, all durable (temp, fsync, rename, dir fsync):
- ``write+fsync``: the exact .bin bytes from memory, 8 MiB writes, then fsync (run.py's baseline);
- ``before``: ``ct.save`` through the writer as it was before the buffer contract (the next piece pulled
  while up to two hashes are outstanding: fast, and wrong for producers that reuse buffers);
- ``after``: ``ct.save`` through today's writer (a region iterator is resumed only once nothing
  it yielded is being hashed, spec/FORMAT.md §5.7.1).
Writes benchmarks/results/writer_contract.jsonl; docs/benchmarks/save.md's table is rendered from it.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import tempfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import durable, measure, summary  # noqa: E402
from run import CHUNK, SIZES, build_state, flat_bytes  # noqa: E402
from harness.record import write_results  # noqa: E402
from harness.render import tables  # noqa: E402

import ckptfmt.torch as ct  # noqa: E402
from ckptfmt import atomic, fingerprint, writer  # noqa: E402
from ckptfmt import format as fmt  # noqa: E402
from ckptfmt import manifest as mf  # noqa: E402
from ckptfmt.errors import SaveError  # noqa: E402


def _write_hashed_before(path: str, header: bytes, sources: tuple, n: int, facts=None, exclusive: bool = False) -> str:
    """The pipeline before the buffer contract (the next piece pulled while up to two hashes
    were outstanding), kept only to measure what the contract costs. It folds in the value
    facts and creates the file as today's writer does, so that the two differ in the contract
    alone."""
    hasher = fingerprint.hasher(1)
    expected = fmt.file_size(n)
    pieces = itertools.chain([(None, memoryview(header))], ((region, chunk) for region, views in zip(fmt.REGIONS, sources)
                                                            for chunk in writer._chunks(views)))
    with atomic.AtomicWriter(path, exclusive=exclusive) as out, ThreadPoolExecutor(1, "ckptfmt-hash") as pool:
        pending: deque = deque()
        for region, chunk in pieces:
            while len(pending) > 1:
                pending.popleft().result()
            pending.append(pool.submit(writer._digest, hasher, facts, region, chunk))
            out.write(chunk)
        for fut in pending:
            fut.result()
        if out.offset != expected:
            raise SaveError(path, "size", expected=expected, got=out.offset)
        out.commit()
    return hasher.hexdigest()


def contenders(model, opt, d: Path) -> dict:
    raw = flat_bytes(model, opt)
    after = writer._write_hashed
    ck = str(d / "step_001000.bin")

    def write(tmp: str) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        mv = memoryview(raw)
        for i in range(0, len(mv), CHUNK):
            os.write(fd, mv[i:i + CHUNK])
        os.close(fd)

    def save_with(impl):
        def run() -> None:
            for p in (ck, mf.path_for(ck)):
                if os.path.exists(p):
                    os.unlink(p)
            writer._write_hashed = impl
            try:
                ct.save(ck, model, opt)
            finally:
                writer._write_hashed = after
        return run
    return {"write+fsync": lambda: durable(write, str(d / "raw.bin")),
            "before": save_with(_write_hashed_before), "after": save_with(after)}, raw.nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="12.8M,120M")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/work/bench" if os.path.isdir("/work") else None)
    ap.add_argument("--out", default=str(HERE / "results" / "writer_contract.jsonl"))
    args = ap.parse_args()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    result = {"when": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["benchmarks/writer_contract.py"] + sys.argv[1:]), "sizes": {}}
    for label in args.sizes.split(","):
        model, opt = build_state(SIZES[label])
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            fns, nbytes = contenders(model, opt, Path(tmp))
            times: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(args.reps):
                for name, fn in fns.items():
                    os.sync()
                    times[name].append(measure(fn)[0])
        row = {k: {**summary(v), "gbps": nbytes / summary(v)["median"] / 1e9} for k, v in times.items()}
        base = row["write+fsync"]["median"]
        row["ratio_vs_write_fsync"] = {k: base / row[k]["median"] for k in ("before", "after")}
        row["after_vs_before"] = row["before"]["median"] / row["after"]["median"]
        result["sizes"][label] = row
        print(label, json.dumps(row, indent=1))
        del model, opt
    print(tables(write_results("writer-contract", result, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
