"""The seed-001 exercise as a ckptfmt trainer: 24 synthetic rows, a 2-8-1 network with dropout
0.25 (33 parameters), batch 4, Adam lr 0.03, StepLR(3, 0.5), CPU, one thread, float32.

Three RNGs drive it: Python ``random`` (a gain on the inputs), a NumPy PCG64 generator (target
noise and the epoch permutations) and torch (dropout). Checkpoints are ckptfmt generations;
everything beyond weights, m and v is in the manifest, and nothing is unpickled on load.

    python -B -m ckptfmt.trainer.mini --steps 10 --output runs/continu
    python -B -m ckptfmt.trainer.mini --steps 5 --output runs/coupure
    python -B -m ckptfmt.trainer.mini --steps 5 --resume runs/coupure/step_000005.bin --output runs/reprise

``--fault`` breaks one piece of the resume on purpose, to show the verifier catches it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Any

import numpy as np
import torch

from .. import atomic, fingerprint, reader
from .. import format as fmt
from .. import manifest as mf
from .. import torch as ct
from ..errors import CheckpointError, ConfigMismatchError, ManifestError

ROWS, BATCH, HIDDEN = 24, 4, 8
DATA_IDENTITY = {"rows": ROWS, "seed": 20260924}
CONFIG = {"trainer": "mini", "batch": BATCH, "hidden": HIDDEN, "dropout": 0.25, "lr": 0.03,
          "step_size": 3, "gamma": 0.5, "dtype": "float32", "threads": 1}
FAULTS = ("optimizer", "scheduler", "cursor", "rng-python", "rng-numpy", "rng-torch")


def dataset() -> tuple[np.ndarray, np.ndarray]:
    """A fixed synthetic relation y = sin(x1) + 0.5 x2^2 - 0.3 x1 x2 (float32)."""
    rng = np.random.default_rng(20260924)
    x = rng.uniform(-2, 2, size=(ROWS, 2)).astype(np.float32)
    y = (np.sin(x[:, 0]) + 0.5 * x[:, 1] ** 2 - 0.3 * x[:, 0] * x[:, 1]).astype(np.float32)[:, None]
    return x, y


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, HIDDEN), torch.nn.Tanh(), torch.nn.Dropout(0.25),
                                torch.nn.Linear(HIDDEN, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    return model, opt


class Mini:
    def __init__(self, fault: str | None = None):
        self.fault = fault
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        self.x, self.y = dataset()
        self.model, self.opt = build()
        self.sched = None if fault == "scheduler" else torch.optim.lr_scheduler.StepLR(self.opt, 3, 0.5)
        random.seed(1)
        self.np_rng = np.random.Generator(np.random.PCG64(2))
        self.step, self.epoch, self.cursor = 0, 0, 0
        self.perm = self.np_rng.permutation(ROWS)
        self.history: list[dict[str, Any]] = []

    def update(self) -> dict[str, Any]:
        if self.cursor == ROWS:
            self.epoch, self.cursor = self.epoch + 1, 0
            self.perm = self.np_rng.permutation(ROWS)
        ids = self.perm[self.cursor:self.cursor + BATCH].tolist()
        self.cursor += BATCH
        gain = 1.0 + 0.05 * random.uniform(-1, 1)
        noise = self.np_rng.normal(0, 0.01, size=(BATCH, 1)).astype(np.float32)
        xb = torch.from_numpy(self.x[ids] * np.float32(gain))
        yb = torch.from_numpy(self.y[ids] + noise)
        lr = self.opt.param_groups[0]["lr"]
        loss = torch.nn.functional.mse_loss(self.model(xb), yb)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.step += 1
        rec = {"step": self.step, "ids": ids, "lr": lr, "loss": float(loss.item())}
        self.history.append(rec)
        return rec

    def eval_mse(self) -> float:
        self.model.eval()
        with torch.no_grad():
            mse = torch.nn.functional.mse_loss(self.model(torch.from_numpy(self.x)), torch.from_numpy(self.y))
        self.model.train()
        return float(mse.item())

    def manifest(self) -> dict[str, Any]:
        return {"scheduler": mf.json_fields(self.sched.state_dict()),
                "rng": ct.rng_state({"pcg64": self.np_rng}),
                "data": {"identity": DATA_IDENTITY, "epoch": self.epoch,
                         "cursor": self.cursor, "permutation": self.perm.tolist()},
                "progress": {"step": self.step, "epoch": self.epoch, "cursor": self.cursor},
                "history": self.history,
                "config": CONFIG,
                "bandit": None, "versions": ct.versions(), "code": {"mini": _code_id()}}

    def save(self, output: str) -> str:
        path = os.path.join(output, fmt.checkpoint_name(self.step))
        result = ct.save(path, self.model, self.opt, self.step, manifest=self.manifest())
        # the seed's checkpoint.pt.sha256, as b3sum prints it: "DIGEST  NAME"
        atomic.write_bytes(path + ".b3", f"{result.blake3}  {os.path.basename(path)}\n".encode())
        return path

    def resume(self, path: str, omit_rng: bool) -> None:
        ck = reader.open(path, manifest="require", verify=True, copy_on_write=True)
        doc = ck.manifest
        mf.require(path, doc, ("layout", "optimizer.step", "scheduler", "rng.python", _pcg64_key(doc),
                               "rng.torch_cpu", "data.identity", "data.epoch", "data.cursor",
                               "data.permutation", "progress", "config", "history", "versions", "code"))
        check_identity(path, doc)
        check_progress(path, ck.step, doc)
        ct.load(ck, self.model, None)
        if self.fault == "scheduler":   # built after the optimizer, state never restored
            self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 3, 0.5)
        else:
            self.sched.load_state_dict(doc["scheduler"])
        if self.fault != "optimizer":
            ct.load_optimizer(ck, self.model, self.opt)
        self.step, self.epoch = doc["progress"]["step"], doc["data"]["epoch"]
        self.cursor = 0 if self.fault == "cursor" else doc["data"]["cursor"]
        self.perm = np.array(doc["data"]["permutation"])
        self.history = list(doc["history"])
        if not omit_rng:
            self._restore_rng(doc["rng"])

    def _restore_rng(self, rng: dict[str, Any]) -> None:
        """Every RNG back (``ct.restore_rng``, as the manager does), but the one ``--fault`` breaks."""
        skip = {"rng-python": {"python"}, "rng-numpy": {"generators.pcg64"}, "rng-torch": {"torch_cpu"}}
        ct.restore_rng(rng, {"pcg64": self.np_rng}, skip=skip.get(self.fault or "", set()))

    def summary(self, records: list[dict[str, Any]], checkpoint: str) -> dict[str, Any]:
        ms, vs, opt_step = ct.moments(self.model, self.opt)
        return {"trainer": "mini", "steps": records, "checkpoint": os.path.basename(checkpoint),
                "final": {"step": self.step,
                          "parameters": {n: p.detach().reshape(-1).tolist() for n, p in self.model.named_parameters()},
                          "optimizer": {"step": opt_step, "m": [t.reshape(-1).tolist() for t in ms],
                                        "v": [t.reshape(-1).tolist() for t in vs]},
                          "scheduler": mf.json_fields(self.sched.state_dict()),
                          "progress": {"step": self.step, "epoch": self.epoch, "cursor": self.cursor},
                          "next_draws": ct.next_draws({"numpy": self.np_rng}, numpy_global=False),
                          "eval": {"mse": self.eval_mse()}}}


def check_identity(path: str, doc: dict[str, Any]) -> None:
    """Seed 001: the loader checks the versions and the identity of code and data (and the
    config): a checkpoint of another experiment is refused by name, never resumed."""
    for name, here in (("versions", ct.versions()), ("code", {"mini": _code_id()}),
                       ("config", CONFIG)):
        if doc[name] != here:
            raise ConfigMismatchError(path, f"cannot resume: {name} differs: checkpoint {doc[name]}, here {here}")
    if doc["data"]["identity"] != DATA_IDENTITY:
        raise ConfigMismatchError(path, f"cannot resume: data.identity differs: checkpoint "
                                        f"{doc['data']['identity']}, here {DATA_IDENTITY}")


def check_progress(path: str, step: int, doc: dict[str, Any]) -> None:
    """The progress must be one consistent point: the header's step, the data position after
    ``step`` batches (epoch, cursor) and a permutation of the rows; else ``ManifestError``."""
    data, progress, history = doc["data"], doc["progress"], doc["history"]
    epoch, cursor, perm = data["epoch"], data["cursor"], data["permutation"]
    whole = all(type(x) is int for x in (epoch, cursor, *(perm if isinstance(perm, list) else [None])))
    problems = [p for p, bad in (
        (f"progress {progress} is not the header's step {step} at epoch {epoch}, cursor {cursor}",
         progress != {"step": step, "epoch": epoch, "cursor": cursor}),
        (f"data cursor {cursor!r} at epoch {epoch!r} is not where {step} batches of {BATCH} end",
         not whole or not 0 <= cursor <= ROWS or epoch * ROWS + cursor != step * BATCH),
        (f"data permutation is not a permutation of the {ROWS} rows",
         not whole or sorted(perm) != list(range(ROWS))),
        (f"history does not hold steps 1..{step}",
         not isinstance(history, list) or [r.get("step") if isinstance(r, dict) else None
                                             for r in history] != list(range(1, step + 1))))
        if bad]
    if problems:
        raise ManifestError(path, "cannot resume: inconsistent state: " + "; ".join(problems))


def _pcg64_key(doc: dict[str, Any]) -> str:
    """Where the manifest holds the PCG64 generator: ``rng.generators.pcg64`` (``ct.rng_state``),
    ``rng.numpy.pcg64`` in the shape this trainer wrote before."""
    rng = doc.get("rng")
    return "rng.numpy.pcg64" if isinstance(rng, dict) and "numpy" in rng else "rng.generators.pcg64"


def _code_id() -> str:
    return fingerprint.of_bytes(open(__file__, "rb").read())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckptfmt.trainer.mini", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, required=True, help="additional updates to run")
    ap.add_argument("--output", required=True, help="new directory for this run")
    ap.add_argument("--resume", help="checkpoint (.bin with manifest) to resume from")
    ap.add_argument("--omit-rng-restore", action="store_true", help="negative control: skip RNG restore")
    ap.add_argument("--fault", choices=FAULTS, help="break one piece of the resume (verifier tests)")
    args = ap.parse_args(argv)
    if os.path.exists(args.output):
        print(f"mini: {args.output}: exists already; choose a new output directory", file=sys.stderr)
        return 2
    mini = Mini(fault=args.fault if args.resume else None)
    try:
        if args.resume:
            mini.resume(args.resume, args.omit_rng_restore)
    except CheckpointError as exc:              # refused before the output directory exists
        print(f"mini: {exc}", file=sys.stderr)
        return 2
    os.makedirs(args.output)
    records = [mini.update() for _ in range(args.steps)]
    path = mini.save(args.output)
    with open(os.path.join(args.output, "summary.json"), "w") as f:
        json.dump(mini.summary(records, path), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
