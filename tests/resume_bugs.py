"""A small training loop on ``CheckpointManager`` with one resume bug put in on purpose, for the
tests of the resume diagnosis (tests/manager/test_resume_diagnosis.py): each bug is one a user
makes, and ``bisect`` of a straight and a resumed run must name the piece it breaks.

In process: ``train(run, until, bug=..., stop_at=C)`` trains steps 1..C and closes the manager
(an interruption), ``train(run, until, bug=...)`` again starts a fresh manager that restores and
goes on; every call seeds every RNG first, as a fresh process would. As a command (verify-resume's
trainer contract, without summary.json: the run's history is what is compared)::

    python tests/resume_bugs.py [--bug BUG] [--unseeded] --updates N --output DIR [--resume PATH] [--omit-rng-restore]

The loop: a ``two_layer()`` model (tests/models.py) under AdamW and an ExponentialLR, every step a
batch of 4 of 24 rows chosen by a sampler whose position is ``state.data``, input noise from
torch's RNG and target noise from a NumPy generator registered as ``noise``; a generation every
step, all kept; the state digests on (spec/RUN.md §3.9).
"""
from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import two_layer  # noqa: E402

from ckptfmt.torch import CheckpointManager  # noqa: E402

BUGS = ("reseed-torch", "unregistered-generator", "dataloader-without-state", "scheduler-after-restore",
        "scaler-not-given", "ema-outside-state", "moments-reset", "lr-overwritten", "cursor-off-by-one",
        "scheduler-loaded-after-restore")
ROWS, BATCH, LR = 24, 4, 1e-2


class Sampler:
    """Batches of a permutation per epoch (the permutation from the epoch number); its position
    is its state. ``skip``: its ``load_state_dict`` moves on one batch (the off-by-one bug)."""

    def __init__(self, skip: bool = False):
        self.epoch, self.cursor, self.skip = 0, 0, skip

    def next(self) -> torch.Tensor:
        if self.cursor == ROWS:
            self.epoch, self.cursor = self.epoch + 1, 0
        perm = np.random.default_rng(self.epoch).permutation(ROWS)
        self.cursor += BATCH
        return torch.from_numpy(perm[self.cursor - BATCH:self.cursor])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"] + (BATCH if self.skip else 0)


class SchedulerByHand:
    """A scheduler the loop saves as a state object and restores by hand: ``restore()`` hands its
    saved state here; the loop builds the scheduler afterwards and loads it (the constructor has
    written its first lr into the optimizer's param groups by then, and loading does not undo it)."""

    def __init__(self):
        self.sched, self.saved = None, None

    def state_dict(self) -> dict:
        if self.sched is None:                # asked before the loop built it (restore keeps a copy)
            return {}
        return {k: v for k, v in self.sched.state_dict().items() if k != "lr_lambdas"}

    def load_state_dict(self, state: dict) -> None:
        self.saved = {**state, "lr_lambdas": [None]} if state else None


class Loader:
    """A shuffling ``DataLoader`` without state, iterated across epochs (its iterator made when
    the loop starts, and again at each epoch's end)."""

    def __init__(self):
        self.loader = torch.utils.data.DataLoader(torch.arange(ROWS), batch_size=BATCH, shuffle=True)
        self.batches = None

    def next(self) -> torch.Tensor:
        batch = next(self.batches, None) if self.batches is not None else None
        if batch is None:
            self.batches = iter(self.loader)
            batch = next(self.batches)
        return batch


def train(run, until: int, *, bug: str | None = None, stop_at: int | None = None, resume: str | None = None,
          restore_rng: bool = True, unseeded: bool = False, every: int = 1) -> int:
    """Train ``run`` up to step ``until`` (or ``stop_at``, then close: an interruption), resuming
    from its newest generation (or ``resume``) as a fresh process would; the last step (a
    generation every ``every`` steps).
    ``unseeded``: a correct loop that never seeds Python's and NumPy's global RNGs (it never draws
    from them) and reports a metric that measures time, ``step_s``."""
    if not unseeded:
        random.seed(0), np.random.seed(0)
    torch.manual_seed(0)
    x = torch.randn(ROWS, 3)
    y = x.sum(1, keepdim=True)
    model = two_layer()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    by_hand = SchedulerByHand()
    sched = None if bug in ("scheduler-after-restore", "scheduler-loaded-after-restore") \
        else torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, backoff_factor=2.0 ** -8) \
        if bug == "scaler-not-given" else None
    data = Loader() if bug == "dataloader-without-state" else Sampler(skip=bug == "cursor-off-by-one")
    noise = np.random.default_rng(1)
    state = {} if bug == "dataloader-without-state" else {"data": data}
    if bug == "scheduler-loaded-after-restore":
        state["sched"] = by_hand
    mgr = CheckpointManager(run, model, opt, sched, state=state,
                            generators={} if bug == "unregistered-generator" else {"noise": noise},
                            every=every, keep_last=None, handle_signals=False, digests=True)
    start = mgr.restore(resume, restore_rng=restore_rng)
    ema = _after_restore(bug, model, opt, start)
    if bug == "scheduler-after-restore":        # a warm-up, built once the optimizer is restored
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    elif bug == "scheduler-loaded-after-restore":       # restored by hand: built, then loaded
        sched = by_hand.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        if by_hand.saved is not None:
            sched.load_state_dict(by_hand.saved)
    step = start
    for step in range(start + 1, (stop_at or until) + 1):
        began = time.perf_counter()
        ids = data.next()
        target = y[ids] + torch.from_numpy(noise.normal(0, 0.01, (len(ids), 1)).astype(np.float32))
        loss = (model(x[ids] + 0.01 * torch.randn(len(ids), 3)) - target).square().mean()
        opt.zero_grad()
        if scaler is None:
            loss.backward()
            opt.step()
        else:                                  # grads of about 2^10: the first scale overflows them
            scaler.scale(loss * 1e4).backward()
            scaler.step(opt)
            scaler.update()
        sched.step()
        metrics = {"step_s": time.perf_counter() - began} if unseeded else {}
        if ema is not None:
            ema = [0.9 * e + 0.1 * p.detach() for e, p in zip(ema, model.parameters())]
            metrics["ema_loss"] = _loss_of(model, ema, x, y)
        mgr.step(step, loss=loss.item(), **metrics)
    mgr.close(step)
    return step


def _after_restore(bug: str | None, model: torch.nn.Module, opt: torch.optim.Optimizer, start: int) -> list | None:
    """What the buggy loop does once ``restore()`` returned; the EMA's tensors where it keeps one."""
    if bug == "reseed-torch":
        torch.manual_seed(0)
    elif bug == "moments-reset" and start:
        for state in opt.state.values():
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
    elif bug == "lr-overwritten":
        for group in opt.param_groups:
            group["lr"] = LR
    return [copy.deepcopy(p.detach()) for p in model.parameters()] if bug == "ema-outside-state" else None


def _loss_of(model: torch.nn.Module, params: list, x: torch.Tensor, y: torch.Tensor) -> float:
    names = [name for name, _ in model.named_parameters()]
    with torch.no_grad():
        out = torch.func.functional_call(model, dict(zip(names, params)), (x,))
    return (out - y).square().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bug", choices=BUGS)
    ap.add_argument("--updates", type=int, required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--resume")
    ap.add_argument("--omit-rng-restore", action="store_true")
    ap.add_argument("--unseeded", action="store_true", help="no global Python/NumPy seed; a step_s metric")
    args = ap.parse_args()
    start = 0 if args.resume is None else int(Path(args.resume).name[5:11])
    train(args.output, start + args.updates, bug=args.bug, resume=args.resume, restore_rng=not args.omit_rng_restore,
          unseeded=args.unseeded)


if __name__ == "__main__":
    main()
