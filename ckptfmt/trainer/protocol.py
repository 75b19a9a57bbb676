"""Hooks that let ``ckptfmt verify-resume --trainer andrea`` observe the reference trainer.

Options of ``ckptfmt train`` (hidden from its --help: the verifier passes them on the command
line; ``trainer.entry.train`` takes them as arguments), single process only:

  --summary PATH                 write the verifier's summary.json at exit (``summary=``)
  --pause-at-step N MARKER       after step N, create MARKER and wait for a signal, so an external
                                 SIGTERM lands exactly at step N (``pause_at=(N, MARKER)``)
  --omit-rng-restore             the negative control: resume without restoring any RNG
                                 (``omit_rng_restore=True``, a Trainer option)

One more hidden option, a test hook of the divergence guard (tests/run/test_divergence.py), also
under torchrun:

  --force-nonfinite-at STEP      multiply the loss by NaN at STEP, so the weights, m and v turn
                                 NaN as in a real divergence (``force_nonfinite_at=STEP``, a
                                 Trainer option); the trainer commits STEP and exits 3
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import manifest as mf
from .. import torch as ct


class Observer:
    """Records each step's ids, lr and loss; ``pause_at=(N, MARKER)``: pause after step N."""

    def __init__(self, trainer: Any, pause_at: "tuple[int, str | Path] | None" = None):
        self.trainer = trainer
        self.records: list[dict[str, Any]] = []
        self.pause_step, self.marker = (None, None)
        if pause_at is not None:
            self.pause_step, self.marker = int(pause_at[0]), Path(pause_at[1])

    def on_step(self, record: dict[str, Any]) -> None:
        self.records.append({k: record[k] for k in ("step", "ids", "lr", "loss")})
        if record["step"] == self.pause_step:
            self.marker.write_text(str(os.getpid()))
            deadline = time.monotonic() + 600
            while not self.trainer.flags.stop and time.monotonic() < deadline:
                time.sleep(0.005)

    def write(self, path: str) -> None:
        t = self.trainer
        ms, vs, opt_step = ct.moments(t.model, t.opt)
        gen = t.run.latest()
        summary = {"trainer": "andrea", "steps": self.records, "checkpoint": gen.path.name if gen else None,
                   "final": {"step": t.data_step,
                             "parameters": torch.cat([p.detach().reshape(-1) for p in t.model.parameters()]).tolist(),
                             "optimizer": {"step": opt_step, "m": torch.cat([x.reshape(-1) for x in ms]).tolist(),
                                           "v": torch.cat([x.reshape(-1) for x in vs]).tolist()},
                             "scheduler": mf.json_fields(t.sched.state_dict()),
                             "progress": {"data": t.data.state()["positions"], "bandit": t.bandit.state()},
                             "next_draws": ct.next_draws({"numpy": self.trainer.bandit.rng}, numpy_global=False), "eval": {"loss": self.eval_loss()}}}
        Path(path).write_text(json.dumps(summary))

    def eval_loss(self) -> float:
        """Loss on a fixed batch (the first windows of each source), in eval mode: no RNG used."""
        t = self.trainer
        rows = []
        for name in t.cfg.sources:
            arr = t.data.arrays[name]
            rows += [arr[i * t.cfg.ctx:i * t.cfg.ctx + t.cfg.ctx + 1] for i in range(2)]
        batch = torch.from_numpy(np.stack(rows).astype("int64")).to(t.device)
        t.model.eval()
        with torch.no_grad():
            _, loss = t.model(batch[:, :-1], batch[:, 1:])
        t.model.train()
        return float(loss.item())
