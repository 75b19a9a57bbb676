"""Save and load time of the ckptfmt Lightning plugin against Lightning's own TorchCheckpointIO
with an fsync added (file and directory, so both are durable), on Lightning's checkpoint dict of
a model with AdamW state: 12.8M and 120M parameters. The contenders alternate within each
repetition (ratios from one run); loads are warm (the file just written, in the page cache) and
include what each does on load: the plugin hashes the .bin and the companion (blake3) before it
returns, TorchCheckpointIO unpickles. The stall of ``CheckpointIO(async_save=True)``: the time
until ``save_checkpoint`` returns (its copy of the tensors); the write is waited for outside it.

    python -m benchmarks lightning-io --reps 3      # ~3 min; writes benchmarks/results/lightning_io.jsonl
    python -m benchmarks lightning-io --table benchmarks/results/lightning_io.jsonl
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fsync_dir, measure, size_arguments, summary   # noqa: E402
from harness.record import write_results  # noqa: E402
from harness.render import tables  # noqa: E402

from ckptfmt.lightning import CheckpointIO                   # noqa: E402
from ckptfmt.torch import rng                               # noqa: E402

SIZES = {"12.8M": (4, 1600, 2000), "120M": (30, 2000, 2000)}    # tensors, rows, cols


def checkpoint(size: str) -> dict:
    """Lightning's dict as dump_checkpoint builds it, with the callback's entry: weights
    ~ N(0, 0.02), AdamW moments that look trained, step 1000."""
    count, rows, cols = SIZES[size]
    g = torch.Generator().manual_seed(0)
    names = [f"layers.{i}.weight" for i in range(count)]
    weights = {n: torch.randn(rows, cols, generator=g) * 0.02 for n in names}
    state = {}
    for i, n in enumerate(names):
        m = torch.randn(rows, cols, generator=g) * 1e-3
        state[i] = {"step": torch.tensor(1000.0), "exp_avg": m, "exp_avg_sq": m * m}
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True, "params": list(range(count))}
    return {"epoch": 0, "global_step": 1000, "pytorch-lightning_version": "2.6.6", "state_dict": weights,
            "loops": {}, "callbacks": {}, "optimizer_states": [{"state": state, "param_groups": [group]}],
            "lr_schedulers": [], "ckptfmt": {"rng": rng.rng_state(), "namespace": "pytorch_lightning",
                                              "members": [[names]]}}


def torch_io_durable(io, ckpt: dict, path: str) -> None:
    """TorchCheckpointIO.save_checkpoint, then fsync of the file and its directory."""
    io.save_checkpoint(ckpt, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path)


def one_size(size: str, reps: int, scratch: str) -> dict:
    from pytorch_lightning.plugins.io import TorchCheckpointIO
    ckpt = checkpoint(size)
    ours, theirs = CheckpointIO(), TorchCheckpointIO()
    paths = {"ckptfmt": os.path.join(scratch, "ours.ckpt"), "torch+fsync": os.path.join(scratch, "theirs.ckpt")}
    save = {"ckptfmt": lambda: ours.save_checkpoint(ckpt, paths["ckptfmt"]),
            "torch+fsync": lambda: torch_io_durable(theirs, ckpt, paths["torch+fsync"])}
    load = {"ckptfmt": lambda: ours.load_checkpoint(paths["ckptfmt"]),
            "torch+fsync": lambda: theirs.load_checkpoint(paths["torch+fsync"], weights_only=True)}
    times = {f"{op}:{who}": [] for op in ("save", "load") for who in save}
    times["stall:ckptfmt-async"] = []
    background = CheckpointIO(async_save=True)
    for rep in range(reps):
        for who in (("ckptfmt", "torch+fsync") if rep % 2 == 0 else ("torch+fsync", "ckptfmt")):
            times[f"save:{who}"].append(measure(save[who])[0])
            times[f"load:{who}"].append(measure(load[who])[0])
        async_path = os.path.join(scratch, "async.ckpt")       # the stall: until save_checkpoint returns
        times["stall:ckptfmt-async"].append(measure(lambda: background.save_checkpoint(ckpt, async_path))[0])
        background.wait()                                      # committed before the next contender
    sizes = {who: _size(p) for who, p in paths.items()}
    shutil.rmtree(scratch)
    return {"times": {k: summary(v) for k, v in times.items()}, "bytes": sizes}


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return os.path.getsize(path)


def main() -> None:
    ap = size_arguments(__doc__, ",".join(SIZES), 3, os.path.join(os.path.dirname(__file__), "results", "lightning_io.jsonl"))
    args = ap.parse_args()
    if args.table:
        print(tables(args.table, "lightning-io"))
        return
    started = time.time()
    doc = {"command": " ".join(["benchmarks/lightning_io.py", *sys.argv[1:]]), "reps": args.reps,
           "load_before": os.getloadavg(), "results": {}}
    for size in args.sizes.split(","):
        scratch = tempfile.mkdtemp(dir=args.dir if args.dir and os.path.isdir(args.dir) else None)
        doc["results"][size] = one_size(size, args.reps, scratch)
        print(size, json.dumps(doc["results"][size]["times"]), flush=True)
    doc.update(load_after=os.getloadavg(), seconds=time.time() - started)
    print(tables(write_results("lightning-io", doc, args.out)))


if __name__ == "__main__":
    main()
