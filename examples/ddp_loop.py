"""The same kind of loop under torchrun with DDP (or FSDP2): every rank resumes bit-exactly.

    torchrun --standalone --nproc-per-node 2 examples/ddp_loop.py --steps 300 --output runs/ddp [--fsdp] [--device cuda]
    ckptfmt verify-resume --output proof --trainer command --command \\
      'torchrun --standalone --nproc-per-node 2 examples/ddp_loop.py --updates {steps} --output {output} {resume} {omit_rng}'
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from ckptfmt.torch import CheckpointManager, ResumeRecord
from ckptfmt.torch.distributed import backend_for, exit_worker


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
    ap.add_argument("--output", required=True)
    ap.add_argument("--steps", type=int, help="train until this global step")
    ap.add_argument("--updates", type=int, help="or: this many more steps (verify-resume)")
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--resume", help="a generation (step_N.json) to start from")
    ap.add_argument("--omit-rng-restore", action="store_true")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 shards instead of DDP replicas")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: GPU LOCAL_RANK per rank")
    args = ap.parse_args()
    if (args.steps is None) == (args.updates is None):
        ap.error("give one of --steps N or --updates N")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)                # before the group: NCCL uses the current device
    dist.init_process_group(backend_for(args.device, torch.cuda.is_available()))   # GPUs: cpu:gloo,cuda:nccl
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(rank), np.random.seed(rank), torch.manual_seed(0)        # same initial weights
    x = torch.randn(256, 8)
    y = torch.sin(x @ torch.linspace(-1, 1, 8)).unsqueeze(1)
    x, y = x.to(device), y.to(device)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 1)).to(device)
    torch.manual_seed(100 + rank)                                        # each rank's own dropout
    net = fully_shard(model) if args.fsdp else DistributedDataParallel(model)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)
    sampler, noise = ShardSampler(len(x), 16, rank, world, seed=1), np.random.default_rng(10 + rank)
    mgr = CheckpointManager(args.output, model, opt, sched, state={"data": sampler},
                            generators={"noise": noise}, every=args.every)
    step = start = mgr.restore(args.resume, restore_rng=not args.omit_rng_restore)
    record = ResumeRecord()
    for step in range(start + 1, (args.steps or start + args.updates) + 1):
        ids = sampler.next()
        target = y[ids] + torch.from_numpy(noise.normal(0, 0.01, (len(ids), 1)).astype(np.float32)).to(device)
        lr = sched.get_last_lr()[0]
        loss = F.mse_loss(net(x[ids]), target)
        opt.zero_grad(), loss.backward(), opt.step(), sched.step()
        record.step(step, ids=ids, lr=lr, loss=loss.item())
        if mgr.step(step, loss=loss.item()):
            break
    mgr.close(step)                                                      # every rank; rank 0 writes:
    record.write(args.output, checkpoint=f"step_{step:06d}.json", model=model, optimizer=opt,
                 scheduler=sched, progress=sampler.state_dict(), generators={"noise": noise}, step=step)
    dist.destroy_process_group()
    exit_worker(0)


if __name__ == "__main__":
    main()
