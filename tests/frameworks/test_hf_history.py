"""A Hugging Face Trainer run keeps the run's history in its output directory (``.loss.json``,
spec/RUN.md §3, §12), written by the session ``ckptfmt.hf.Checkpointing`` runs on: one record per
step holding what the Trainer logged at that step (logged after ``on_step_end``, so the record
waits for it), a ``checkpoint`` event per commit with its reason and directory, and after a
resume from a checkpoint earlier than the history's last step, a ``resume`` event that leaves
the lost timeline's records out of the canonical history, the steps going on from there. With
the history there, ``validate``, ``ls`` and ``resume_path`` of the output directory say what
they said without it. With ``Checkpointing(digests=True)`` a resumed ``train()`` records the
straight run's state digests step for step, and ``bisect`` of two output directories, which
compares no checkpoint-N, names from the histories alone a reseed after the restore."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402
from conftest import cli  # noqa: E402

from ckptfmt.cli import main  # noqa: E402
from ckptfmt.hf import Checkpointing, resume_path  # noqa: E402
from ckptfmt.run import history, timeline  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from hf_trainer import Tokens, tiny_gpt2  # noqa: E402


class TermAt(transformers.TrainerCallback):
    """SIGTERM to this process at the end of step ``at``, as a cluster's would arrive during it."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def trainer(out: Path, callbacks: list) -> transformers.Trainer:
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=4,
                                          save_steps=2, save_total_limit=None, logging_steps=1, report_to=[],
                                          use_cpu=True, seed=0, disable_tqdm=True)
    return transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=callbacks)


def losses(tr: transformers.Trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in tr.state.log_history if "loss" in e}


def listing(out: Path) -> tuple[int, list]:
    result = CliRunner().invoke(main, ["ls", str(out), "--json"])
    return result.exit_code, [(g["step"], g["status"]) for g in json.loads(result.output)["generations"]]


def test_the_history_records_each_logged_step_its_checkpoints_and_a_resume_from_an_earlier_one(tmp_path):
    out = tmp_path / "out"
    first = trainer(out, [TermAt(3), Checkpointing()])
    first.train()
    ckpt = Checkpointing()
    resumed = trainer(out, [ckpt])
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))   # earlier than step 3, recorded
    assert resumed.state.global_step == 4 and ckpt.stopped_by_signal is None

    events = [(e["event"], e["step"], e.get("reason"), e.get("path")) for e in history.read(out / history.NAME).events()]
    assert events == [("start", 0, None, None), ("checkpoint", 2, "framework", "checkpoint-2"),
                      ("checkpoint", 3, "SIGTERM", "checkpoint-3"), ("resume", 2, None, None),
                      ("checkpoint", 4, "framework", "checkpoint-4")]
    plan = timeline.plan(out / history.NAME)
    assert plan.forward and plan.last_step == 4          # forward between resumes: no step-order trip
    canonical = list(plan.records())
    logged = {**losses(first), **losses(resumed)}       # the resumed run's step 3 replaces the first's
    assert [r["step"] for r in canonical] == list(range(1, 5))
    assert {r["step"]: r["loss"] for r in canonical} == logged
    assert all("learning_rate" in r and "time" in r for r in canonical)

    bare = tmp_path / "bare"                             # the same directory without the history
    shutil.copytree(out, bare, ignore=shutil.ignore_patterns(".loss.json", ".policy.json"))
    assert listing(out) == listing(bare) == (0, [(2, "committed"), (3, "committed"), (4, "committed")])
    assert CliRunner().invoke(main, ["validate", str(out)]).exit_code == 0
    assert resume_path(out) == str(out / "checkpoint-4") and resume_path(bare) == str(bare / "checkpoint-4")



class Reseed(transformers.TrainerCallback):
    """``torch.manual_seed`` as the first step of this ``train()`` begins: after the Trainer put
    the checkpoint's RNG states back (a user's ``set_seed`` in the wrong place)."""

    def __init__(self):
        self.seeded = False

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.seeded:
            torch.manual_seed(1)
            self.seeded = True


def test_a_resumed_train_records_the_straight_runs_digests_and_bisect_names_a_reseed_after_restore(tmp_path):
    straight, resumed, reseeded = tmp_path / "straight", tmp_path / "resumed", tmp_path / "reseeded"
    trainer(straight, [Checkpointing(digests=True)]).train()
    trainer(resumed, [TermAt(3), Checkpointing(digests=True)]).train()
    shutil.copytree(resumed, reseeded)
    for run, more in ((resumed, []), (reseeded, [Reseed()])):
        trainer(run, [*more, Checkpointing(digests=True)]).train(resume_from_checkpoint=resume_path(run))
    digests = lambda run: {r["step"]: r["state"] for r in timeline.plan(run / history.NAME).records()}  # noqa: E731
    want = digests(straight)
    assert sorted(want) == [1, 2, 3, 4]
    assert {"rng.python", "rng.numpy", "rng.torch", "scheduler", "state.trainer_state", "lr.0", "optimizer.step"} \
        <= set(want[1]) and [want[s]["optimizer.step"] for s in want] == [1, 2, 3, 4]
    assert digests(resumed) == want                      # step 4: the resumed train()'s, after checkpoint-3
    done = cli("bisect", str(straight), str(resumed))
    assert done.returncode == 0 and done.stdout.splitlines() == [
        "generations: not compared (A and B: a Hugging Face Trainer's output directory: its checkpoint-N hold "
        "the Trainer's own files (weights, a torch.save of the optimizer and of the RNG states), not generations "
        "whose content ckptfmt compares); history: identical", "identical"], done.stdout
    done = cli("bisect", str(straight), str(reseeded))
    assert done.returncode == 1
    assert done.stdout.splitlines()[1].startswith("step 4: rng.torch differs (also: loss"), done.stdout
    assert "generations not compared: from the histories alone" in done.stdout and "B resumed at step 3" in done.stdout
