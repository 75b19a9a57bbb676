"""A training loop on Hugging Face accelerate whose every stop is resumable bit-exactly (ckptfmt).

    python examples/accelerate_loop.py --steps 300 --output runs/acc          # SIGTERM: commits, exits 0
    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --steps 300 --output runs/acc2
    #   (or: accelerate launch --multi_gpu --num_processes 2 ... on a CPU host: MULTI_CPU on gloo)
    ckptfmt verify-resume --output proof --trainer command \\
        --command 'python examples/accelerate_loop.py --updates {steps} --output {output} {resume} {omit_rng}'

What ``Accelerator.prepare`` returns goes to the manager as it is: the prepared model (DDP-wrapped
under several processes, so its names start with ``module.``), the ``AcceleratedOptimizer`` (the
AdamW inside is what is mapped) and the ``AcceleratedScheduler``. RNGs (spec/RUN.md §12.1):
``set_seed`` seeds every generator at the start, then ``mgr.restore()`` puts back each rank's
saved states, so a resumed run draws what the straight run drew; accelerate restores nothing.
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed

from ckptfmt.torch import CheckpointManager, ResumeRecord
from ckptfmt.torch.distributed import exit_worker


class ShardSampler:
    """Rank r takes its slice of one shuffled order per epoch; its position is checkpointed."""

    def __init__(self, n: int, batch: int, rank: int, world: int, seed: int):
        self.n, self.batch, self.rank, self.world, self.seed = n, batch, rank, world, seed
        self.epoch, self.cursor = 0, 0

    def next(self) -> np.ndarray:
        if self.cursor + self.batch * self.world > self.n:
            self.epoch, self.cursor = self.epoch + 1, 0
        order = np.random.default_rng(self.seed + self.epoch).permutation(self.n)
        start = self.cursor + self.rank * self.batch
        self.cursor += self.batch * self.world
        return order[start:start + self.batch]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True, help="run directory")
    ap.add_argument("--steps", type=int, help="train until this global step")
    ap.add_argument("--updates", type=int, help="or: this many more steps (verify-resume)")
    ap.add_argument("--every", type=int, default=50, help="checkpoint cadence")
    ap.add_argument("--resume", help="start from this checkpoint instead of the run's newest")
    ap.add_argument("--omit-rng-restore", action="store_true", help="negative control")
    args = ap.parse_args()
    if (args.steps is None) == (args.updates is None):
        ap.error("give one of --steps N or --updates N")
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    set_seed(0)                                            # the same initial weights on every rank
    x = torch.randn(256, 8)
    y = torch.sin(x @ torch.linspace(-1, 1, 8)).unsqueeze(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    set_seed(100 + rank)                                   # each rank's own dropout and noise
    sampler, noise = ShardSampler(len(x), 16, rank, world, seed=1), np.random.default_rng(10 + rank)
    mgr = CheckpointManager(args.output, model, opt, sched, state={"data": sampler},
                            generators={"noise": noise}, every=args.every)
    step = start = mgr.restore(args.resume, restore_rng=not args.omit_rng_restore)
    record = ResumeRecord()
    for step in range(start + 1, (args.steps or start + args.updates) + 1):
        ids = sampler.next()
        target = y[ids] + torch.from_numpy(noise.normal(0, 0.01, (len(ids), 1)).astype(np.float32))
        lr = sched.get_last_lr()[0]
        loss = F.mse_loss(model(x[ids]), target)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        sched.step()
        record.step(step, ids=ids, lr=lr, loss=loss.item())
        if mgr.step(step, loss=loss.item()):
            break
    mgr.close(step)                                        # every rank; a sharded generation: step_N.json
    record.write(args.output, checkpoint=f"step_{step:06d}.{'json' if world > 1 else 'bin'}", model=model,
                 optimizer=opt, scheduler=sched, progress=sampler.state_dict(), generators={"noise": noise},
                 step=step)
    accelerator.end_training()
    if world > 1:
        exit_worker(0)


if __name__ == "__main__":
    main()
