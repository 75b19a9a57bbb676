"""Every benchmark, where it lives and how it is usually run: ``python -m benchmarks --list``.

``python -m benchmarks NAME [ARGS...]`` runs the benchmark's script with the arguments it has
always taken, in place of this process (its own interpreter, path, signals and children, as
``python benchmarks/SCRIPT.py ARGS`` would), and tells it the command as typed so that its
results record that. A benchmark added here needs a shape in shapes.py for its results and,
for its own page, a block in render/; until then its results appear in the rendered "Other
results" page.
"""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    page: str          # the rendered page its results appear on (docs/benchmarks/PAGE.md)
    what: str
    usual: str         # the arguments of the committed run, and about how long it takes here
    results: str       # the file under benchmarks/results/ its committed results are in


BENCHMARKS = (
    Benchmark("peers", "run.py", "save", "ckptfmt against its peers and the machine's limits: save, open, load, "
              "validate, diff, compression, the trainer's stall", "--reps 5  (~15 min; --stall-only: the stall alone)",
              "latest.jsonl"),
    Benchmark("load-variants", "load_variants.py", "load", "hash and copy schedules for the verified load",
              "(~1 min)", "load_variants.jsonl"),
    Benchmark("writer-contract", "writer_contract.py", "save", "the writer's buffer contract, before and after",
              "--reps 5  (~2 min)", "writer_contract.jsonl"),
    Benchmark("facts", "facts_bench.py", "save", "save with and without the value-facts pass; validate by the "
              "recorded facts against the scan", "--reps 7  (~1.5 min)", "facts.jsonl"),
    Benchmark("scale", "scale.py", "scale", "12.8M to 1B parameters, every operation cold (12 GB files, 12 GB of "
              "memory)", "--reps 1  (~8 min)", "scale.jsonl"),
    Benchmark("compress", "compress.py", "compression", "standard .zst against byte-plane .ckz on trained checkpoints",
              "--andrea  (~6 min)", "compress.jsonl"),
    Benchmark("export", "export_bench.py", "validate", "`ckptfmt export` (copy, re-read, validate, load) against "
              "cp -r + sync", "--reps 3", "export.jsonl"),
    Benchmark("sharded-save", "dist_bench.py", "save", "the collective sharded save with 1 and 2 ranks (torchrun, "
              "gloo)", "--config andrea-12m --reps 3", "sharded_save.jsonl"),
    Benchmark("mirror", "mirror_bench.py", "object-storage", "`ckptfmt mirror` against boto3 upload_file (local S3 "
              "server)", "--reps 3  (~1 min)", "mirror.jsonl"),
    Benchmark("mirror-stall", "mirror_stall.py", "object-storage", "the trainer's stall with --mirror",
              "--reps 2 --url file:///tmp/mirror-bench  (~1 min)", "mirror_stall.jsonl"),
    Benchmark("store", "store_bench.py", "object-storage", "runs written straight to S3 (local moto server): "
              "save and restore against raw fsspec and DCP, requests, the loop's stall, the server's memory",
              "--reps 3  (~10-14 min)", "store_bench.jsonl"),
    Benchmark("history-scale", "history_scale.py", "history", "ls, validate, gc, bisect and plot on 2,000 "
              "generations and long histories, one tree against another", "--trees a428c40,.  (~8 min)",
              "history_scale.jsonl"),
    Benchmark("roots-scan", "roots_scan.py", "history", "latest-valid's read of the root digests against parsing "
              "every line", "--steps 1000000 --reps 5  (~20 s)", "roots_scan.jsonl"),
    Benchmark("digests", "digests_bench.py", "history", "the history's state digests: a tiny-config step with and "
              "without them, the bytes they add to a record", "(~40 s)", "digests.jsonl"),
    Benchmark("tiers", "tiers_bench.py", "tiers", "recovery tiers: the RAM save's stall, restarts from RAM, disk, "
              "mirror and peer, memory", "--reps 3  (~15 min)", "tiers.jsonl"),
    Benchmark("lightning-io", "lightning_io.py", "frameworks", "the Lightning plugin against TorchCheckpointIO",
              "--reps 3  (~45 s)", "lightning_io.jsonl"),
    Benchmark("gpu-check", "gpu_check.py", "gpu", "the GPU check: correctness, then throughput, each stage under "
              "a budget (on the lent machine: bash benchmarks/gpu_check.sh)", "--dry-run --out /tmp/gc  (CPU, 1-2 min)",
              "gpu_check/gpu_check.jsonl"),
    Benchmark("cuda-manager", "cuda_manager_check.py", "gpu", "the manager's bit-exact resume on CUDA",
              "--device cuda --out benchmarks/results/cuda_manager.jsonl", "cuda_manager.jsonl"),
)
BY_NAME = {b.name: b for b in BENCHMARKS}
COMMANDS = {"render": "docs/benchmarks/ from the results (--check: compare, write nothing; --no-plots)",
            "table": "FILE: the tables of one results file (the scripts' --table)",
            "convert": "benchmarks/results/raw/*.json -> benchmarks/results/*.jsonl (the results before the schema)"}
USAGE = "usage: python -m benchmarks --list | NAME [ARGS...] | " + " | ".join(COMMANDS)


def listing() -> str:
    width = max(len(n) for n in [*BY_NAME, *COMMANDS])
    lines = ["benchmarks (python -m benchmarks NAME [ARGS...]; the script's own --help says more):", ""]
    for b in BENCHMARKS:
        lines += [f"  {b.name:<{width}}  {b.what}",
                  f"  {'':<{width}}  benchmarks/{b.script} {b.usual}; results/{b.results}; page {b.page}"]
    lines += ["", "commands:", ""] + [f"  {n:<{width}}  {what}" for n, what in COMMANDS.items()]
    return "\n".join(lines)


def run(name: str, args: list[str]) -> None:
    """Become the benchmark's script (never returns)."""
    script = HERE / BY_NAME[name].script
    os.environ["BENCHMARKS_COMMAND"] = shlex.join(["python", "-m", "benchmarks", name, *args])
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, str(script), *args])


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\n" + USAGE)
        return 0 if argv else 2
    name, args = argv[0], argv[1:]
    if name == "--list":
        print(listing())
        return 0
    if name in BY_NAME:
        run(name, args)
    if name == "render":
        from .render import main as render
        return render(args)
    if name == "table":
        from .render import table_main
        return table_main(args)
    if name == "convert":
        from .convert import main as convert
        return convert(args)
    print(f"python -m benchmarks: no benchmark or command {name!r}; `python -m benchmarks --list` lists them",
          file=sys.stderr)
    return 2
