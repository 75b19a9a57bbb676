"""A Lightning training loop whose checkpoints resume bit-exactly, mid-epoch too (ckptfmt).

    python examples/lightning_loop.py --steps 60 --output runs/pl            # checkpoints in runs/pl
    python examples/lightning_loop.py --steps 90 --output runs/pl --resume runs/pl/step=60.ckpt
    ckptfmt verify-resume --output proof --steps 18 --cut 11 --trainer command \\
        --command 'python examples/lightning_loop.py --updates {steps} --output {output} {resume} {omit_rng}'

Two lines make Lightning's checkpoints durable, verified and bit-exact: the ``CheckpointIO``
plugin and its ``Checkpointing`` callback. The third piece is the data: a mid-epoch checkpoint
resumes where the epoch stopped only if the DataLoader keeps its position (Lightning saves the
``state_dict`` of a loader that has one, under ``loops``); a loader without one restarts the
epoch. ``--io torch`` trains with Lightning's own ``TorchCheckpointIO`` instead (no RNG states:
its resume diverges, which is what ``verify-resume`` shows).
"""
import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import pytorch_lightning as pl
from ckptfmt.lightning import CheckpointIO, Checkpointing, read
from ckptfmt.torch import ResumeRecord


class Net(pl.LightningModule):
    """BatchNorm (buffers that a resume must carry), dropout (draws from torch's RNG every step),
    AdamW with a per-step schedule."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.record = ResumeRecord()

    def training_step(self, batch, _):
        x, y, ids = batch
        loss = F.mse_loss(self.net(x), y)
        lr = self.lr_schedulers().get_last_lr()[0]
        self.record.step(self.global_step + 1, ids=ids, lr=lr, loss=loss.item())
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ShuffleSampler(Sampler):
    """A new permutation each epoch (from seed + epoch, so it holds no RNG of its own) and the
    position in it, which is what a mid-epoch resume needs."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch, self.cursor = n, seed, 0, 0

    def set_epoch(self, epoch: int) -> None:       # Lightning calls it as each epoch starts
        if epoch != self.epoch:
            self.epoch, self.cursor = epoch, 0

    def __iter__(self):                            # lazy: a state loaded before the first batch counts
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        while self.cursor < self.n:
            self.cursor += 1
            yield perm[self.cursor - 1]

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


class ResumableLoader(DataLoader):
    """A DataLoader Lightning treats as stateful (it has ``state_dict`` and ``load_state_dict``):
    its sampler's position goes into the checkpoint. Its own generator keeps ``iter()`` from
    drawing the base seed from torch's global RNG, which a resume would otherwise shift."""

    def __init__(self, dataset, batch_size: int, sampler: ShuffleSampler):
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator())

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=g)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)), torch.arange(96))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True, help="checkpoint directory (and summary.json)")
    ap.add_argument("--steps", type=int, help="train until this global step")
    ap.add_argument("--updates", type=int, help="or: this many more steps (verify-resume)")
    ap.add_argument("--every", type=int, help="checkpoint every N steps (default: at the last step only)")
    ap.add_argument("--resume", help="a checkpoint to resume from (fit(ckpt_path=...))")
    ap.add_argument("--omit-rng-restore", action="store_true", help="negative control")
    ap.add_argument("--io", choices=("ckptfmt", "torch"), default="ckptfmt", help="checkpoint plugin")
    args = ap.parse_args()
    if (args.steps is None) == (args.updates is None):
        ap.error("give one of --steps N or --updates N")
    start = read(args.resume)["global_step"] if args.resume else 0
    target = args.steps or start + args.updates
    pl.seed_everything(0, verbose=False)
    model, dataset = Net(), data()
    loader = ResumableLoader(dataset, 12, ShuffleSampler(len(dataset)))     # 8 steps an epoch
    saver = pl.callbacks.ModelCheckpoint(dirpath=args.output, filename="step={step}", auto_insert_metric_name=False,
                                         every_n_train_steps=args.every or target, save_top_k=-1)
    ours = args.io == "ckptfmt"
    trainer = pl.Trainer(max_steps=target, deterministic=True, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", default_root_dir=args.output,
                         plugins=[CheckpointIO()] if ours else None,
                         callbacks=[saver, *([Checkpointing(restore_rng=not args.omit_rng_restore)] if ours else [])])
    trainer.fit(model, loader, ckpt_path=args.resume)
    model.eval()
    with torch.no_grad():
        x, y, _ = dataset.tensors
        mse = F.mse_loss(model.net(x), y).item()
    saved = [n for n in os.listdir(args.output) if n.startswith("step=") and n.endswith(".ckpt")]
    newest = max(saved, key=lambda n: int(n[5:-5]), default="")
    model.record.write(args.output, checkpoint=newest,
                       model=model, optimizer=trainer.optimizers[0], scheduler=trainer.lr_scheduler_configs[0].scheduler,
                       progress=loader.state_dict(), evaluation={"mse": mse}, step=trainer.global_step)


if __name__ == "__main__":
    main()
