"""The Checkpointing callback on the run layer's Session (spec/RUN.md §11.8), with real Lightning:
under gradient accumulation the history holds each optimizer step once and a signal at a batch
that ends no step still commits last.ckpt; the session writes nothing of a run directory's own
in ModelCheckpoint's directory (no policy record); it stays open until the plugin's teardown,
so a checkpoint ModelCheckpoint saves as training ends reaches the mirror; and with
``digests=True`` a resumed fit records the straight fit's state digests step for step, so
``bisect`` of the two ModelCheckpoint directories names an RNG a resume did not put back."""
from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

pl = pytest.importorskip("pytorch_lightning")

from test_lightning_options import example, kill                              # noqa: E402

from conftest import cli                                                      # noqa: E402

from ckptfmt.errors import UnsupportedSetupError                              # noqa: E402
from ckptfmt.lightning import CheckpointIO, Checkpointing, generation_in      # noqa: E402
from ckptfmt.run import timeline                                            # noqa: E402
from ckptfmt.run.history import read as read_history                        # noqa: E402

STEPS = 6
CUT = 3                    # the interrupted fit's last step, mid-epoch (8 steps an epoch)


class AtBatch(pl.Callback):
    """Does ``act(module)`` once, as batch ``index`` of the fit ends (before the Checkpointing callback)."""

    def __init__(self, index: int, act):
        self.index, self.act, self.seen = index, act, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        if self.seen == self.index + 1:
            self.act(pl_module)


def train(root, ours, *, checkpoint, at=None, accumulate: int = 1, steps: int = STEPS, ckpt_path=None):
    """The example's module and resumable loader to ``steps`` optimizer steps, ModelCheckpoint in ``root``."""
    pl.seed_everything(0, verbose=False)
    loader = example.ResumableLoader(example.data(), 12, example.ShuffleSampler(len(example.data())))
    saver = pl.callbacks.ModelCheckpoint(dirpath=root, filename="step={step}", auto_insert_metric_name=False,
                                         **checkpoint)
    trainer = pl.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, deterministic=True, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         default_root_dir=str(root), plugins=[CheckpointIO()],
                         callbacks=[*([at] if at else []), ours, saver])
    trainer.fit(example.Net(), loader, ckpt_path=ckpt_path)
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
    assert [(e["event"], e["step"]) for e in history.events()] == [("start", 0)]
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


def digests(run) -> dict[int, dict]:
    """step -> the state digests of the canonical history's record of it."""
    return {r["step"]: r["state"] for r in timeline.plan(run / ".loss.json").records()}


def test_a_resumed_fit_records_the_straight_fits_digests_and_bisect_names_an_rng_not_put_back(tmp_path):
    """A fit cut at step 3 and resumed from step=3.ckpt records, step for step, the digests the
    straight fit records (both directories' generations compared too); resumed with
    ``restore_rng=False`` instead, bisect of the two ModelCheckpoint directories names torch's
    RNG at the resumed fit's first step, every other piece identical."""
    straight, resumed, unrestored = tmp_path / "straight", tmp_path / "resumed", tmp_path / "unrestored"
    every = {"every_n_train_steps": CUT, "save_top_k": -1}
    train(straight, Checkpointing(history=True, digests=True), checkpoint=every)
    train(resumed, Checkpointing(history=True, digests=True), checkpoint=every, steps=CUT)
    shutil.copytree(resumed, unrestored)
    for run, restore_rng in ((resumed, True), (unrestored, False)):
        train(run, Checkpointing(history=True, digests=True, restore_rng=restore_rng), checkpoint=every,
              ckpt_path=str(run / f"step={CUT}.ckpt"))
    want = digests(straight)
    assert sorted(want) == list(range(1, STEPS + 1))
    assert {"rng.torch", "scheduler", "state.train_loader", "lr.0", "optimizer.step"} <= set(want[1])
    assert len({d["state.train_loader"] for d in want.values()}) == STEPS      # the loader moves every step
    assert digests(resumed) == want
    done = cli("bisect", str(straight), str(resumed))
    assert done.returncode == 0 and done.stdout.splitlines() == ["generations: identical; history: identical",
                                                                 "identical"], done.stdout
    found = json.loads(cli("bisect", str(straight), str(unrestored), "--json").stdout)
    d = found["diagnosis"]
    assert found["common_generations"] == [CUT, STEPS] and found["first_generation_difference"] == STEPS
    assert (d["step"], d["component"], d["before"]) == (CUT + 1, "rng.torch", CUT), d["message"]
    assert {"state.train_loader", "scheduler", "lr.0", "optimizer.step"} <= set(d["equal"]), d["message"]


def test_digests_without_the_history_are_refused_in_one_line():
    with pytest.raises(UnsupportedSetupError, match=r"^Checkpointing\(digests=True\) records the state digests in "
                                                    r"the history: give history=True too$"):
        Checkpointing(digests=True)


def test_a_second_fit_from_scratch_in_the_same_directory_begins_a_new_timeline(tmp_path):
    """Two fits without ckpt_path, one after the other, in one ModelCheckpoint directory: the
    second's ``start`` event makes the first's records a lost timeline, so the canonical history
    is the second fit's alone (never the first's steps beyond the second's end)."""
    train(tmp_path, Checkpointing(history=True), checkpoint={"every_n_train_steps": 1000})
    first = read_history(tmp_path / ".loss.json").canonical()
    assert [r["step"] for r in first] == list(range(1, STEPS + 1))
    train(tmp_path, Checkpointing(history=True), checkpoint={"every_n_train_steps": 1000}, steps=STEPS - 2)
    history = read_history(tmp_path / ".loss.json")
    assert [r["step"] for r in history.canonical()] == list(range(1, STEPS - 1))
    assert [r["loss"] for r in history.canonical()] == [r["loss"] for r in first][:STEPS - 2]
    assert [(e["event"], e["step"]) for e in history.events()] == [("start", 0), ("start", 0)]
