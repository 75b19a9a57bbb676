"""Save, open, validate, verified load and diff from 12.8M to 1B parameters.

    python -m benchmarks scale                          # 12.8M,120M,350M,1B; ~8 min
    python -m benchmarks scale --sizes 12.8M,120M --reps 1   # a quick look
    python -m benchmarks scale --table benchmarks/results/scale.jsonl

Each size is a model of a few large float32 parameters (at most 64M elements each, like the
big matrices of a transformer) with an AdamW state whose values look trained, so a 1B model
needs 12 GB of memory for itself and writes 12 GB files (generated here, removed at the end,
never committed). Every operation runs with the file's pages evicted first
(``posix_fadvise(DONTNEED)``): at 350M and 1B the files no longer fit in the page cache beside
the model (24 GiB here), so cold is the regime a user meets, and every size is measured alike.

Peak RSS is ``VmHWM`` above the RSS at the start of the operation (``/proc/self/clear_refs``):
for the load that is what it costs beyond the model's own memory; mapped file pages count.
Writes benchmarks/results/scale.jsonl (after every size: a cut run keeps what it has); the
table and the plot of docs/benchmarks/scale.md are rendered from it.
"""
from __future__ import annotations

import datetime
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import size_arguments, drop_cache, measure, summary  # noqa: E402
from run import trained_looking  # noqa: E402
from harness.record import write_results  # noqa: E402
from harness.render import tables  # noqa: E402

import torch  # noqa: E402

import ckptfmt  # noqa: E402
import ckptfmt.torch as ct  # noqa: E402
from ckptfmt import manifest as mf  # noqa: E402
from ckptfmt.tools.diff import diff  # noqa: E402
from ckptfmt.tools.validate import validate_file  # noqa: E402

SIZES = {"12.8M": 12_800_000, "120M": 120_000_000, "350M": 350_000_000, "1B": 1_000_000_000}
PIECE = 64 << 20          # elements per parameter at most (256 MB)


class Flat(torch.nn.Module):
    """``n`` float32 parameters in pieces of at most ``PIECE`` elements."""

    def __init__(self, n: int):
        super().__init__()
        sizes = [PIECE] * (n // PIECE) + ([n % PIECE] if n % PIECE else [])
        self.pieces = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(k)) for k in sizes)


def build(n: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Weights ~ N(0, 0.02), m ~ N(0, 1e-3), v = m'^2, step 1000: trained-looking values."""
    return trained_looking(Flat(n), seed)


def fresh_save(path: str, model, opt) -> Callable[[], None]:
    def save() -> None:
        for p in (path, mf.path_for(path)):
            if os.path.exists(p):
                os.unlink(p)
        ct.save(path, model, opt)
    return save


def checked(fn: Callable[[], Any], ok: Callable[[Any], bool], what: str) -> Callable[[], None]:
    """``fn``, failing the benchmark if its result is not what a correct run gives."""
    def run() -> None:
        result = fn()
        if not ok(result):
            raise SystemExit(f"scale: {what} gave an unexpected result: {result!r}")
    return run


def operations(a: str, b: str, model, opt) -> dict[str, Callable[[], None]]:
    def load() -> None:
        ct.load(a, model, opt, verify=True).close()
    return {
        "save": fresh_save(a, model, opt),
        "open": lambda: ckptfmt.open(a).close(),
        "validate": checked(lambda: validate_file(a), lambda r: r.ok and r.details.get("values") == "recorded",
                            "validate"),
        "validate --scan": checked(lambda: validate_file(a, scan=True), lambda r: r.ok, "validate --scan"),
        "load (verified)": load,
        "diff": checked(lambda: diff(a, b), lambda r: not r.identical, "diff"),
    }


def measure_size(label: str, d: Path, reps: int) -> dict[str, Any]:
    n = SIZES[label]
    model, opt = build(n)
    a, b = str(d / "step_001000.bin"), str(d / "other" / "step_001000.bin")
    (d / "other").mkdir(exist_ok=True)
    with torch.no_grad():                      # the second generation differs in one piece
        first = next(model.parameters())
        first[:1000].add_(1e-3)
        fresh_save(b, model, opt)()
        first[:1000].sub_(1e-3)
    fresh_save(a, model, opt)()
    ops = operations(a, b, model, opt)
    times: dict[str, list[float]] = {k: [] for k in ops}
    rss: dict[str, int] = {}
    for _ in range(reps):
        for name, fn in ops.items():
            os.sync()
            seconds, peak = measure(fn, lambda: [drop_cache(p) for p in (a, b)])
            times[name].append(seconds)
            rss[name] = max(rss.get(name, 0), peak)
        print(f"[{label}] " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    nbytes = os.path.getsize(a)
    out = {"n_params": n, "bytes": nbytes, "model_and_adam_gb": 12 * n / 1e9}
    for name, samples in times.items():
        gbps = (2 if name == "diff" else 1) * nbytes / summary(samples)["median"] / 1e9
        out[name] = {**summary(samples), "gbps": gbps, "peak_rss_mb": rss[name] / 1e6}
    del model, opt
    for p in list(d.iterdir()):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return out


def main() -> int:
    ap = size_arguments(__doc__, ",".join(SIZES), 2, str(HERE / "results" / "scale.jsonl"))
    args = ap.parse_args()
    if args.table:
        print(tables(args.table, "scale"))
        return 0
    unknown = [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    torch.set_num_threads(2)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    result: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                              "command": " ".join([".venv/bin/python", "benchmarks/scale.py"] + sys.argv[1:]),
                              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                          "torch": torch.__version__}, "sizes": {}}
    d = Path(tempfile.mkdtemp(prefix="ckptfmt-scale-", dir=args.dir))
    try:
        for label in args.sizes.split(","):
            result["sizes"][label] = measure_size(label, d, args.reps)
            out = write_results("scale", result, args.out)      # a cut run keeps what it has
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(tables(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
