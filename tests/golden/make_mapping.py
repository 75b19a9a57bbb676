"""How the golden files in tests/golden/mapping/ were made: run once, by the commit that added
the mapping's manifest fields (``optimizer.members``, ``optimizer.setting_types``, ``aliases``;
spec/FORMAT.md §10.8), and never again. tests/format/test_golden.py must restore every one with the
code of every later commit, each tensor on its named parameter and each setting in its type.

    .venv/bin/python tests/golden/make_mapping.py
"""
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ckptfmt.torch import CheckpointManager

OUT = Path(__file__).resolve().parent / "mapping"


class TiedGPT(nn.Module):
    """An embedding, a block and a head tied to the embedding (``lm_head.weight is wte.weight``)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(8, 4)
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        return self.lm_head(x + self.fc(self.ln(x)))


def decay_groups(model):
    """nanoGPT's decay / no-decay groups; the first with a NumPy lr and a custom key."""
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for _, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1, "lr": np.float32(3e-3), "lr_scale": np.float32(0.5)},
            {"params": rest, "weight_decay": 0.0}]


def write(name, model, opt, steps, batch):
    with tempfile.TemporaryDirectory() as tmp:
        mgr = CheckpointManager(Path(tmp) / "run", model, opt, every=None, keep_last=None, handle_signals=False)
        for step in range(1, steps + 1):
            opt.zero_grad()
            model(batch).float().pow(2).mean().backward()
            opt.step()
            mgr.step(step, loss=0.0)
        mgr.close(steps)
        (OUT / name).mkdir(parents=True)
        for f in sorted((Path(tmp) / "run").glob("step_*")):
            shutil.copy(f, OUT / name / f.name)


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    torch.manual_seed(0)
    model = TiedGPT()
    write("adamw", model, torch.optim.AdamW(decay_groups(model), lr=1e-2, betas=(0.9, 0.95)), 3,
          torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]]))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    write("sgd", model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True), 2,
          torch.randn(3, 4))
    print(sorted(str(p.relative_to(OUT)) for p in OUT.rglob("*") if p.is_file()))


if __name__ == "__main__":
    sys.exit(main())
