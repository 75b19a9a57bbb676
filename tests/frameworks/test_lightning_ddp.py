"""The plugin under Lightning's DDP with two CPU processes (gloo), spec/RUN.md §11.9: one agreed
checkpoint, every rank's RNG states in it, a SIGTERM to rank 0 (the process the scheduler or the
user signals; Lightning forwards it to the other rank) commits last.ckpt and stops both ranks,
and ckpt_path="last" resumes each rank bit-identically. Each rank seeds its own RNG, so a resume
that gave every rank rank 0's states would diverge.

This file is also the script the test runs (Lightning's launcher runs it again for rank 1)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

SCRIPT = os.path.abspath(__file__)
STEPS, CUT = 10, 6          # 4 steps an epoch on each rank: the cut is mid-epoch
# two ranks: never beside a torchrun job; a hang fails in minutes (the test takes 30-40 s)
pytestmark = [pytest.mark.xdist_group("torchrun"), pytest.mark.timeout(150)]


def run(output, *extra: str):
    """The script on 2 ranks (Lightning's launcher starts rank 1), its output kept beside ``output``;
    killed with its rank 1 if the test ends first."""
    from torchrun import run as run_job
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    return run_job([sys.executable, SCRIPT, "--output", str(output), *extra], Path(f"{output}.log"), timeout=120,
                   env={**env, "PYTHONWARNINGS": "ignore"})


def finals(output) -> list[dict]:
    return [json.loads((output / f"final-rank{r}.json").read_text()) for r in (0, 1)]


def test_ddp_sigterm_to_rank_0_commits_one_checkpoint_and_resumes_every_rank_bit_identically(tmp_path):
    pytest.importorskip("pytorch_lightning")
    straight = run(tmp_path / "straight")
    assert straight.returncode == 0, straight.tail()
    want = finals(tmp_path / "straight")
    assert want[0]["weights"] == want[1]["weights"] and want[0]["draws"] != want[1]["draws"]
    cut = run(tmp_path / "cut", "--sigterm-at", str(CUT))
    assert cut.returncode == 0, cut.tail()                              # stopped cleanly
    from ckptfmt.lightning import generation_in
    assert sorted(os.listdir(tmp_path / "cut")) == ["last.ckpt"]
    doc = json.loads(open(generation_in(tmp_path / "cut" / "last.ckpt")[:-4] + ".json").read())
    assert doc["lightning"]["global_step"] == CUT and len(doc["ranks"]) == 2
    assert doc["ranks"][0]["rng"]["torch_cpu"] != doc["ranks"][1]["rng"]["torch_cpu"]
    resumed = run(tmp_path / "cut", "--resume")
    assert resumed.returncode == 0, resumed.tail()
    assert finals(tmp_path / "cut") == want


def main() -> None:
    import torch
    import pytorch_lightning as pl
    sys.path.insert(0, os.path.join(os.path.dirname(SCRIPT), "..", "..", "examples"))
    import lightning_loop as example
    from ckptfmt.lightning import CheckpointIO, Checkpointing

    ap = argparse.ArgumentParser()
    ap.add_argument("--output", required=True)
    ap.add_argument("--sigterm-at", type=int)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.output, exist_ok=True)

    class Net(example.Net):
        def setup(self, stage):                   # before a checkpoint is restored: each rank its own RNG
            torch.manual_seed(100 + self.global_rank)

    class Shard(example.ShuffleSampler):
        def __iter__(self):                       # this rank's share of the epoch's permutation
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
            mine = perm[rank::world]
            while self.cursor < len(mine):
                self.cursor += 1
                yield mine[self.cursor - 1]

    class SigtermAt(pl.Callback):
        def on_train_batch_end(self, trainer, *_):
            if trainer.global_step == args.sigterm_at and trainer.global_rank == 0:
                os.kill(os.getpid(), 15)          # SIGTERM, to rank 0 only

    pl.seed_everything(0, verbose=False)
    model, dataset = Net(), example.data()
    loader = example.ResumableLoader(dataset, 12, Shard(len(dataset)))
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=2, strategy="ddp", use_distributed_sampler=False,
                         deterministic=True, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=args.output, plugins=[CheckpointIO()],
                         callbacks=[SigtermAt(), Checkpointing(signals=True),
                                    pl.callbacks.ModelCheckpoint(dirpath=args.output, every_n_train_steps=1000)])
    trainer.fit(model, loader, ckpt_path="last" if args.resume else None)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    final = {"step": trainer.global_step, "weights": weights.tolist(), "draws": torch.rand(3).tolist()}
    with open(os.path.join(args.output, f"final-rank{trainer.global_rank}.json"), "w") as f:
        json.dump(final, f)


if __name__ == "__main__":
    main()
    from ckptfmt.torch.distributed import exit_worker
    exit_worker(0)       # not through finalization, where a gloo rank can abort (exit_worker says when)
