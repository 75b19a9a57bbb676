"""The small torch models the tests train and checkpoint, in one place.

Each is seeded (``torch.manual_seed(seed)`` before it is built), so the same seed builds the same
model, and a "fresh" model to restore into is built with another seed. Every model takes
``FEATURES`` inputs, so ``inputs()`` and ``train_steps()`` fit them all.

- ``tiny_linear()``: one ``Linear(3, 2)`` (weight and bias): a model whose layout does not
  matter to the test (a run to lock, interrupt, prune, mirror or refuse).
- ``tiny_adamw()``: ``tiny_linear()`` with its AdamW.
- ``two_layer()``: ``Sequential(Linear(3, 4), Linear(4, 1))``: four parameters in two modules,
  for a test that needs more than one (a parameter frozen or in a group of its own, a module
  prefix, parameters that took different numbers of steps). Tests name its parameters
  (``0.weight``, ``0.bias``, ``1.weight``, ``1.bias``) and count them: keep that layout.
- ``two_layer_adamw()``: ``two_layer()`` with its AdamW.
- ``inputs()``: a batch for any of them, from the global torch RNG or a generator.
- ``train_steps()``: optimizer steps on such batches (square-mean loss), which move every
  parameter and every piece of Adam/AdamW/SGD state (step, exp_avg, exp_avg_sq, momentum).

A test whose expected values depend on its model (a layout named in a message, a parameter
count, a tensor size, a golden file's layout, a model in a code string run by a subprocess)
keeps its own model.

Import torch first (``pytest.importorskip("torch")``): this module imports it.
"""
from __future__ import annotations

import torch

FEATURES = 3


def tiny_linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(FEATURES, 2)


def tiny_adamw(seed: int = 0, lr: float = 1e-2) -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    model = tiny_linear(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def two_layer(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 4), torch.nn.Linear(4, 1))


def two_layer_adamw(seed: int = 0, lr: float = 1e-2) -> tuple[torch.nn.Sequential, torch.optim.AdamW]:
    model = two_layer(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def inputs(rows: int = 5, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.randn(rows, FEATURES, generator=generator)


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``steps`` optimizer steps, each on a fresh batch of ``inputs()``; the last loss, detached."""
    for _ in range(steps):
        loss = model(inputs(generator=generator)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.detach()
