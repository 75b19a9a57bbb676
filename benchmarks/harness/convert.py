"""The results written before the schema, converted into it: ``python -m benchmarks convert``.

Each file in benchmarks/results/raw/ (kept as it was written) becomes benchmarks/results/NAME.jsonl
through its benchmark's shape, the same code that writes new results. What a file did not record
comes from benchmarks/README.md where it said it (the command, the day, the machine), else it is
null: no old result knows its commit unless it wrote one. A few figures were only ever printed,
never saved (export, the sharded save, the first checks on a GPU): they are transcribed below
from the README of the commit before this converter, with what it said of how they were made.

Every conversion is checked: the records put back together give the file's document exactly
(stamps aside), so nothing of an old result is lost.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .record import RESULTS, dump, to_document, to_records
from .shapes import SPECS

RAW = RESULTS / "raw"
VM = {"description": "the development VM: 2 cores, 24 GiB, ext4 on a virtual disk, no GPU (benchmarks/README.md)"}
GPU = {"description": "the lent GPU machine: one NVIDIA H200 (benchmarks/README.md \"GPU\")"}
README_SAYS = "benchmarks/README.md before the schema"

# raw file -> (benchmark, what the README said that the file did not)
FILES: dict[str, tuple[str, dict[str, Any]]] = {
    "latest.json": ("peers", {}),
    "stall.json": ("peers", {}),
    "facts.json": ("facts", {}),
    "facts_120m_11reps.json": ("facts", {}),
    "writer_contract.json": ("writer-contract", {}),
    "scale.json": ("scale", {}),
    "load_variants.json": ("load-variants", {"date": "2026-11-30"}),
    "compress.json": ("compress", {"command": ".venv/bin/python benchmarks/compress.py --andrea"}),
    "mirror.json": ("mirror", {}),
    "mirror_stall.json": ("mirror-stall", {}),
    "store_bench.json": ("store", {}),
    "history_scale.json": ("history-scale", {}),
    "history_scale_1m.json": ("history-scale", {}),
    "history_stream.json": ("history-scale", {}),
    "roots_scan.json": ("roots-scan", {"date": "2026-12-05", "command": ".venv/bin/python benchmarks/roots_scan.py "
                                       "--steps 1000000 --reps 5 --out benchmarks/results/roots_scan.json"}),
    "tiers.json": ("tiers", {}),
    "lightning_io.json": ("lightning-io", {}),
    "cuda_manager.json": ("cuda-manager", {"date": "2026-11-30", "machine": GPU,
                                           "command": "python3 benchmarks/cuda_manager_check.py --device cuda --steps 40"}),
}

# figures only printed, never saved: (results file, benchmark, document as the script prints it, stamps)
TRANSCRIBED: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("export.jsonl", "export",
     {"config": "andrea-12m", "bytes": 153819319, "reps": 3, "cp_sync_s": 0.112, "export_s": 0.604,
      "export_over_cp": 5.4, "cp_gbps": 1.37, "export_gbps": 0.25,
      "transcribed": f"{README_SAYS}: the figures as printed, rounded as there"},
     {"command": ".venv/bin/python benchmarks/export_bench.py --reps 3"}),
    ("sharded_save.jsonl", "sharded-save",
     {"config": "andrea-12m", "ranks": {"1": {"world_size": 1, "gbps": 1.02}, "2": {"world_size": 2, "gbps": 1.02}},
      "speedup_2_over_1": 1.0, "transcribed": f"{README_SAYS}: the figures as printed, rounded as there"},
     {"command": ".venv/bin/python benchmarks/dist_bench.py --config andrea-12m --reps 3"}),
    ("gpu_first_runs.jsonl", "gpu-first-runs",
     {"checks": {
         "trainer, async save": {
             "what": "reference trainer on CUDA with `--async-save` (bf16 autocast by default): straight 40 vs 20 "
                     "+ resume",
             "command": "ckptfmt train --config tiny --device cuda --async-save ..., then ckptfmt diff",
             "result": "bit-identical; `validate` OK (verified); stall 3-6 ms per save"},
         "trainer, bf16 and fp16": {
             "what": "reference trainer on CUDA, bf16 and fp16 (GradScaler), new and pre-manager manifests, "
                     "synchronous saves",
             "command": None, "how": "a review session's script (not committed)",
             "result": "straight = straight, resumed = straight, `omit_rng_restore` diverged"},
         "deterministic kernels": {
             "what": "deterministic kernels (`trainer/determinism.py`: `use_deterministic_algorithms(True)` raising, "
                     "math attention kernel pinned, cuBLAS workspace `:4096:8`): andrea-12m (ctx 512, bf16), "
                     "straight 30 twice, 15 + resume to 30, and the same with `--omit-rng-restore`",
             "command": "ckptfmt train --config andrea-12m --device cuda --steps 30 --checkpoint-every 15, "
                        "then ckptfmt diff",
             "result": "straight = straight, resumed = straight (exit 0), negative control differs (exit 1); no "
                       "non-determinism warning; the manifest's `run` records `deterministic_mode: error`, "
                       "`sdpa: math`, `gpu: NVIDIA H200`, `cuda: 13.0`, `cudnn: 91900`"}},
      "transcribed": f"{README_SAYS}, \"First runs on a GPU\": checks by hand, no results file"},
     {"date": "2026-11-30", "machine": {**GPU, "gpu": "NVIDIA H200", "torch": "2.11.0+cu130"}}),
]


def _checked(benchmark: str, doc: dict, said: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The records of ``doc``; ValueError unless they give the document back exactly."""
    records = json.loads(json.dumps(to_records(benchmark, doc, {"machine": VM, **said})))
    _, rest = SPECS[benchmark].stamps(doc)
    if to_document(records) != rest:
        raise ValueError(f"{name}: its records do not give the document back")
    return records


def convert(raw: Path = RAW, out: Path = RESULTS) -> list[Path]:
    """Write results/NAME.jsonl for every raw file and every transcription; the paths written."""
    written = []
    for name, (benchmark, said) in FILES.items():
        doc = json.loads((raw / name).read_text())
        written.append(dump(_checked(benchmark, doc, said, name), out / (Path(name).stem + ".jsonl")))
    for name, benchmark, doc, said in TRANSCRIBED:
        written.append(dump(_checked(benchmark, doc, said, name), out / name))
    return written


def main(argv: list[str]) -> int:
    if argv:
        print("usage: python -m benchmarks convert   (benchmarks/results/raw/*.json -> benchmarks/results/*.jsonl)")
        return 2
    for path in convert():
        print(path.relative_to(RESULTS.parents[1]))
    return 0
