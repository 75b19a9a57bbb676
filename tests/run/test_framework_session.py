"""A framework that saves on its own (as Lightning's ModelCheckpoint and the Hugging Face Trainer
do) runs on the same session: the session says when a save is due, the framework writes and
commits its checkpoint, and the session then records it and applies retention through the
framework's own directory rule, the hook and the mirror, in that order."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptfmt import reader
from ckptfmt.run import Policy, Run, SavePolicy
from ckptfmt.run.hooks import Hooks
from ckptfmt.run.session import Session


class CheckpointDirs:
    """A framework's own layout: one directory per checkpoint (``ckpt-N/``), each holding one
    generation, written when the framework decides; its retention keeps the newest two."""

    def __init__(self, root: Path):
        self.root = root

    def save(self, step: int) -> dict[str, Any]:
        manifest = {"progress": {"step": step}}
        weights = np.full(3, step, dtype=np.float32)
        Run(self.root / f"ckpt-{step}", create=True).commit(step, weights, weights * 0, weights * 0,
                                                             manifest=manifest, n_params=3)
        return manifest

    def held(self) -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in self.root.glob("ckpt-*"))

    def keep_two(self) -> list[int]:
        gone = self.held()[:-2]
        for step in gone:
            for f in (self.root / f"ckpt-{step}").iterdir():
                f.unlink()
            (self.root / f"ckpt-{step}").rmdir()
        return gone


def test_a_framework_saves_and_the_session_records_retains_hooks(tmp_path):
    root, order = tmp_path / "dirpath", []
    dirs = CheckpointDirs(root)
    hooks = Hooks(on_commit=lambda step, doc: order.append(("hook", step, dirs.held())), log=lambda m: None)
    session = Session(root, write=None, writer=None, saving=SavePolicy(every=3), retention=Policy.by_count(2),
                      hooks=hooks, lock=False, handle_signals=False, retain=dirs.keep_two)
    with pytest.raises(RuntimeError, match="the framework saves"):
        session.save(1)
    for step in range(1, 8):
        if step == 5:
            session.request_save()               # what SIGUSR1 sets
        stop, due = session.step(step, {"loss": 1.0 / step})
        assert not stop
        if due:
            order.append(("save", step, dirs.held()))
            session.framework_saved(step, dirs.save(step), path=f"ckpt-{step}")
    session.framework_saved(8, dirs.save(8))       # the framework's own schedule
    assert [(kind, step) for kind, step, _ in order] == [
        ("save", 3), ("hook", 3), ("save", 5), ("hook", 5), ("save", 6), ("hook", 6), ("hook", 8)]
    assert dict(((k, s), h) for k, s, h in order)[("hook", 6)] == [5, 6]    # retention before the hook
    assert dirs.held() == [6, 8]
    session.request_stop("SIGTERM")
    assert session.requests() == (True, False)     # between steps: agreed, no record
    session.close()
    events = [(e["step"], e["reason"], e.get("path")) for e in session.run.history.read().events()
              if e["event"] == "checkpoint"]
    assert events == [(3, "cadence", "ckpt-3"), (5, "SIGUSR1", "ckpt-5"), (6, "cadence", "ckpt-6"),
                      (8, "framework", None)]
    assert [r["step"] for r in session.run.history.read().canonical()] == list(range(1, 8))
    with reader.open(root / "ckpt-8" / "step_000008.bin", verify=True) as ckpt:
        assert ckpt.weights.tolist() == [8.0, 8.0, 8.0]
