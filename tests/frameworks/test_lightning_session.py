"""The Checkpointing callback on the run layer's Session (spec/RUN.md §11.8), with real Lightning:
under gradient accumulation the history holds each optimizer step once and a signal at a batch
that ends no step still commits last.ckpt; the session writes nothing of a run directory's own
in ModelCheckpoint's directory (no policy record); and it stays open until the plugin's
teardown, so a checkpoint ModelCheckpoint saves as training ends reaches the mirror."""
from __future__ import annotations

import json
import os
import signal

import pytest

pl = pytest.importorskip("pytorch_lightning")

from test_lightning_options import example, kill                              # noqa: E402

from ckptfmt.lightning import CheckpointIO, Checkpointing, generation_in      # noqa: E402
from ckptfmt.run.history import read as read_history                        # noqa: E402

STEPS = 6


class AtBatch(pl.Callback):
    """Does ``act(module)`` once, as batch ``index`` of the fit ends (before the Checkpointing callback)."""

    def __init__(self, index: int, act):
        self.index, self.act, self.seen = index, act, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        if self.seen == self.index + 1:
            self.act(pl_module)


def train(root, ours, *, checkpoint, at=None, accumulate: int = 1):
    """The example's module and resumable loader to STEPS optimizer steps, ModelCheckpoint in ``root``."""
    pl.seed_everything(0, verbose=False)
    loader = example.ResumableLoader(example.data(), 12, example.ShuffleSampler(len(example.data())))
    saver = pl.callbacks.ModelCheckpoint(dirpath=root, filename="step={step}", auto_insert_metric_name=False,
                                         **checkpoint)
    trainer = pl.Trainer(max_steps=STEPS, accumulate_grad_batches=accumulate, deterministic=True, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         default_root_dir=str(root), plugins=[CheckpointIO()],
                         callbacks=[*([at] if at else []), ours, saver])
    trainer.fit(example.Net(), loader)
    return trainer


def test_under_gradient_accumulation_each_step_is_recorded_once_and_a_signal_between_steps_saves(tmp_path):
    """Two batches a step: the fifth batch (index 4) ends none, global_step still 2 there."""
    calls = []
    before = signal.signal(signal.SIGUSR1, lambda *_: calls.append(1))
    try:
        trainer = train(tmp_path, Checkpointing(history=True, signals=True), checkpoint={"every_n_train_steps": 1000},
                        accumulate=2, at=AtBatch(4, kill(signal.SIGUSR1)))
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert trainer.global_step == STEPS and calls == [1]
    history = read_history(tmp_path / ".loss.json")
    assert [r["step"] for r in history.records if "event" not in r] == list(range(1, STEPS + 1))
    assert history.events() == []
    doc = json.loads(open(generation_in(tmp_path / "last.ckpt")[:-4] + ".json").read())
    assert doc["lightning"]["global_step"] == 2
    assert sorted(os.listdir(tmp_path)) == [".loss.json", "last.ckpt"]       # no policy record


def test_a_checkpoint_modelcheckpoint_saves_as_training_ends_reaches_the_mirror(tmp_path):
    """save_last with no save during training: ModelCheckpoint saves last.ckpt in its
    on_train_end, after the callback's; the session (and its mirror) closes at teardown."""
    root, there = tmp_path / "ckpt", tmp_path / "bucket"
    ours = Checkpointing(mirror=f"file://{there}")
    train(root, ours, checkpoint={"every_n_train_steps": 1000, "save_last": True})
    assert sorted(os.listdir(root)) == ["last.ckpt"] and sorted(os.listdir(there)) == ["last.ckpt"]
    assert ours.mirroring.report["errors"] == [] and ours.session.closed
    assert generation_in(there / "last.ckpt").endswith(f"step_{STEPS:06d}.bin")
