"""The reference trainer's check for ``ckptfmt export``: load the exported generation into a
fresh model + AdamW built from its manifest's config, so an export proves it can be resumed.

The export library knows no model; the CLI passes this function as its ``check``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import generation
from .. import manifest as mf
from .. import torch as ct
from .config import from_dict
from .model import GPT


def export_check(path: "str | Path") -> str:
    """Load the generation ``path`` names (its ``.bin``, or a sharded one's manifest), verified,
    into a fresh model + optimizer; one line saying what happened."""
    doc = mf.read(mf.path_for(path))
    if not isinstance(doc.get("config"), dict) or "ctx" not in doc["config"]:
        return "skipped: not a reference-trainer checkpoint (validated fully instead)"
    cfg = from_dict(doc["config"])
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    with generation.at(path).open(verify=True) as ck:     # whatever its shape
        ct.load(ck, model, opt)
    return f"loaded into a fresh {cfg.name} model + AdamW at step {doc['optimizer']['step']}"
