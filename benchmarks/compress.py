"""Compression of a trained checkpoint: the standard ``.zst`` (a zstd stream of the exact
``.bin``, which ``zstd -d`` reads) against the byte-plane ``.ckz`` (ckptfmt only).

    python -m benchmarks compress                    # tiny, trained 400 steps
    python -m benchmarks compress --andrea           # also andrea-12m, 20 steps

Trains the reference model in a fresh run (``ckptfmt train``), then writes each form at several
zstd levels with the converter's own writers, reads each back (and checks the bytes), and runs
the real ``zstd -d`` on the standard form (its output must equal the ``.bin``). Prints a markdown
table and writes benchmarks/results/compress.jsonl. Scratch files go under --dir and are removed.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from harness.record import write_results  # noqa: E402
from harness.render import tables  # noqa: E402
from ckptfmt import fingerprint  # noqa: E402
from ckptfmt.tools.convert import check, load, planes, zst  # noqa: E402


def trained(run: Path, config: str, steps: int, *extra: str) -> Path:
    """Train ``config`` to ``steps`` in a fresh run; the final generation's path."""
    shutil.rmtree(run, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "ckptfmt.cli", "train", "--run", str(run), "--config", config,
                    "--steps", str(steps), "--checkpoint-every", str(steps), "--sample-every", "0",
                    "--log-every", "100000", *extra], check=True, capture_output=True)
    return run / f"step_{steps:06d}.bin"


def measure_form(src: Path, out: Path, form: str, level: int) -> dict[str, Any]:
    """Ratio and speeds of one form at one level; the bytes are checked on the way back."""
    source = load(str(src))
    source.blake3 = check.digest_of(source)
    write = zst.write if form == "zst" else planes.write
    started = time.perf_counter()
    write(source, str(out), False, None, level=level)
    compress_s = time.perf_counter() - started
    started = time.perf_counter()
    back = load(str(out), "zst" if form == "zst" else "planes")
    decompress_s = time.perf_counter() - started
    assert check.digest_of(back) == source.blake3, f"{out}: does not read back to the source"
    size = src.stat().st_size
    row = {"form": form, "level": level, "bytes": out.stat().st_size, "ratio": size / out.stat().st_size,
           "compress_mb_s": size / compress_s / 1e6, "decompress_mb_s": size / decompress_s / 1e6}
    if form == "zst":
        plain = out.with_suffix(".bin")
        subprocess.run(["zstd", "-d", "-q", "-f", str(out), "-o", str(plain)], check=True)
        row["zstd_d_equals_bin"] = fingerprint.of_file(plain) == fingerprint.of_file(src)
        plain.unlink()
    out.unlink()
    return row


def bench(src: Path, scratch: Path) -> list[dict[str, Any]]:
    rows = []
    for form, levels in (("zst", (1, 3, 9)), ("planes", (1, 3, 9))):
        for level in levels:
            rows.append(measure_form(src, scratch / f"c.{'zst' if form == 'zst' else 'ckz'}", form, level))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--andrea", action="store_true", help="Also andrea-12m trained 20 steps (slow on CPU).")
    ap.add_argument("--dir", default=None, help="Scratch directory (default: a temp dir).")
    ap.add_argument("--out", default=str(HERE / "results" / "compress.jsonl"))
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ckptfmt-compress-", dir=args.dir))
    try:
        cases = [("tiny, trained 400 steps", "tiny", 400, ())]
        if args.andrea:
            cases.append(("andrea-12m, trained 20 steps", "andrea-12m", 20, ("--threads", "2")))
        results = {}
        for name, config, steps, extra in cases:
            src = trained(scratch / config, config, steps, *extra)
            results[name] = {"bytes": src.stat().st_size, "rows": bench(src, scratch)}
            print(f"{name} ({src.stat().st_size:,} bytes): measured", flush=True)
        print(tables(write_results("compress", results, args.out)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
