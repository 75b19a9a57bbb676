"""Run examples/plain_loop.py with one piece of its state lost after every restore, as a loop
that forgot that piece would: verify-resume must catch it and name it (tests/manager/test_manager.py).

    python tests/manager_faults.py PIECE <plain_loop.py arguments>
"""
import copy
import random
import runpy
import sys
from pathlib import Path

import numpy as np
import torch

from ckptfmt.torch.manager import CheckpointManager

PIECE = sys.argv.pop(1)
init, restore = CheckpointManager.__init__, CheckpointManager.restore


def remember(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self._fresh = {"optimizer": copy.deepcopy(self.optimizer.state_dict()),
                   "scheduler": copy.deepcopy(self.scheduler.state_dict()),
                   "buffers": {k: v.clone() for k, v in self.model.state_dict().items() if "running" in k
                               or "num_batches" in k},
                   "data": copy.deepcopy(self.state["data"].state_dict()),
                   "generators": {k: copy.deepcopy(g.bit_generator.state) for k, g in self.generators.items()}}


def forget(self, *args, **kwargs):
    step = restore(self, *args, **kwargs)
    if step == 0:                     # a fresh start loses nothing
        return step
    fresh = self._fresh
    if PIECE == "optimizer":
        self.optimizer.load_state_dict(fresh["optimizer"])
    elif PIECE == "scheduler":
        self.scheduler.load_state_dict(fresh["scheduler"])
    elif PIECE == "buffers":
        self.model.load_state_dict(fresh["buffers"], strict=False)
    elif PIECE == "sampler-state":
        self.state["data"].load_state_dict(fresh["data"])
    elif PIECE.startswith("generator-"):
        name = PIECE.split("-", 1)[1]
        self.generators[name].bit_generator.state = fresh["generators"][name]
    elif PIECE == "rng-python":
        random.seed(12345)
    elif PIECE == "rng-numpy":
        np.random.seed(12345)
    elif PIECE == "rng-torch":
        torch.manual_seed(12345)
    else:
        raise SystemExit(f"unknown piece {PIECE}")
    return step


CheckpointManager.__init__, CheckpointManager.restore = remember, forget
sys.argv[0] = str(Path(__file__).resolve().parent.parent / "examples" / "plain_loop.py")
runpy.run_path(sys.argv[0], run_name="__main__")
