"""The model and loop the tests of runs on object storage train: a small model with BatchNorm
(its running statistics make each generation carry a companion file) and AdamW, and steps that
draw from torch's RNG and the loop's NumPy generator, so a resume must bring back both.

Import torch first (``pytest.importorskip("torch")``): this module imports it."""
from __future__ import annotations

import numpy as np
import torch


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.Linear(12, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(mgr, model: torch.nn.Module, opt: torch.optim.Optimizer, start: int, stop: int,
          noise: np.random.Generator) -> None:
    """Steps start+1..stop through ``mgr``, each drawing from torch's RNG and ``noise``; ends
    early where the manager says to stop (a signal)."""
    for step in range(start + 1, stop + 1):
        x = torch.randn(5, 6) + float(noise.standard_normal())
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if mgr.step(step, loss=loss.item()):
            break
