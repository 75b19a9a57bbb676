"""A plain PyTorch training loop whose every stop is resumable bit-exactly (ckptfmt).

    python examples/plain_loop.py --steps 300 --output runs/plain      # Ctrl-C / kill: commits, exits 0
    python examples/plain_loop.py --steps 300 --output runs/plain      # goes on where it stopped
    ckptfmt verify-resume --output proof --trainer command \\
        --command 'python examples/plain_loop.py --updates {steps} --output {output} {resume} {omit_rng}'
"""
import argparse
import random

import numpy as np
import torch
import torch.nn.functional as F

from ckptfmt.torch import CheckpointManager, ResumeRecord


class Sampler:
    """Shuffles the dataset each epoch; its position is part of the checkpoint."""

    def __init__(self, n: int, batch: int, seed: int):
        self.n, self.batch, self.gen = n, batch, np.random.default_rng(seed)
        self.epoch, self.cursor, self.perm = 0, 0, self.gen.permutation(n)

    def next(self) -> np.ndarray:
        if self.cursor + self.batch > self.n:
            self.epoch, self.cursor, self.perm = self.epoch + 1, 0, self.gen.permutation(self.n)
        self.cursor += self.batch
        return self.perm[self.cursor - self.batch:self.cursor]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "perm": self.perm}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor, self.perm = state["epoch"], state["cursor"], state["perm"]


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
    random.seed(0), np.random.seed(0), torch.manual_seed(0)   # every RNG: a run is reproducible
    torch.use_deterministic_algorithms(True)
    x = torch.randn(256, 8)
    y = torch.sin(x @ torch.linspace(-1, 1, 8)).unsqueeze(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)
    sampler, noise = Sampler(len(x), 16, seed=1), np.random.default_rng(2)
    mgr = CheckpointManager(args.output, model, opt, sched, state={"data": sampler},
                            generators={"sampler": sampler.gen, "noise": noise}, every=args.every)
    step = start = mgr.restore(args.resume, restore_rng=not args.omit_rng_restore)
    record = ResumeRecord()
    for step in range(start + 1, (args.steps or start + args.updates) + 1):
        ids = sampler.next()
        target = y[ids] + torch.from_numpy(noise.normal(0, 0.01, (len(ids), 1)).astype(np.float32))
        lr = sched.get_last_lr()[0]
        loss = F.mse_loss(model(x[ids]), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        record.step(step, ids=ids, lr=lr, loss=loss.item())
        if mgr.step(step, loss=loss.item()):
            break
    mgr.close(step)
    model.eval()
    with torch.no_grad():
        mse = F.mse_loss(model(x), y).item()
    record.write(args.output, checkpoint=f"step_{step:06d}.bin", model=model, optimizer=opt,
                 scheduler=sched, progress=sampler.state_dict(),
                 generators={"sampler": sampler.gen, "noise": noise}, evaluation={"mse": mse}, step=step)


if __name__ == "__main__":
    main()
