"""``ckptfmt.hf.Checkpointing`` in a real transformers Trainer (a tiny GPT-2 built from a config,
CPU): SIGTERM at step 12 of 20 commits checkpoint-12 and ``train()`` returns; every checkpoint-N
is committed and validates; a flipped byte makes ``resume_path`` take the one before; the resume
ends bit-identical to a straight run; a save requested while ``save_strategy="best"`` overwrites
``should_save`` is not lost; ``save_total_limit`` is refused; the example exits 0 on SIGTERM,
and under two processes the signal to one rank stops both at one step."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402

from ckptfmt.cli import main  # noqa: E402
from ckptfmt.errors import UnsupportedSetupError  # noqa: E402
from ckptfmt.hf import Checkpointing, resume_path  # noqa: E402
from ckptfmt import fingerprint, hfcheckpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
sys.path.insert(0, str(ROOT / "examples"))
from hf_trainer import Tokens, tiny_gpt2  # noqa: E402
from torchrun import worker_of_rank  # noqa: E402
import warm  # noqa: E402

FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt")


class SignalAt(transformers.TrainerCallback):
    """Sends ``sig`` to this process at the end of step ``at`` (a real signal, delivered before
    the next hook runs), like a cluster's SIGTERM arriving during that step."""

    def __init__(self, at: int, sig: int = signal.SIGTERM):
        self.at, self.sig = at, sig

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            os.kill(os.getpid(), self.sig)


def trainer(out: Path, callbacks: list, steps: int = 20, eval_dataset=None, **more) -> transformers.Trainer:
    args = dict(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, save_steps=5,
                save_total_limit=None, logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    return transformers.Trainer(model=tiny_gpt2(), args=transformers.TrainingArguments(**{**args, **more}),
                                train_dataset=Tokens(), eval_dataset=eval_dataset, callbacks=callbacks)


def cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "straight"
    trainer(out, [Checkpointing()]).train()
    return out


@pytest.fixture(scope="module")
def cut(tmp_path_factory) -> tuple[Path, Checkpointing, int]:
    out = tmp_path_factory.mktemp("hf") / "cut"
    ckpt = Checkpointing()
    tr = trainer(out, [SignalAt(12), ckpt])
    tr.train()
    return out, ckpt, tr.state.global_step


def test_sigterm_at_step_12_commits_checkpoint_12_and_train_returns(cut):
    out, ckpt, step = cut
    assert step == 12 and ckpt.stopped_by_signal == "SIGTERM"
    assert sorted(hfcheckpoint.step_of_dir(p) for p in out.glob("checkpoint-*")) == [5, 10, 12]
    record = json.loads((out / "checkpoint-12" / hfcheckpoint.RECORD).read_text())
    assert record["step"] == 12 and "loss" in record["metrics"]
    assert set(FILES) <= set(record["files"]) and record["facts"]["weights"]["non_finite"] == 0
    assert "transformer.wte.weight" in record["param_groups"][0]     # tied lm_head: stored once
    weights = out / "checkpoint-12" / "model.safetensors"
    assert record["files"]["model.safetensors"]["blake3"] == fingerprint.of_file(weights)


def test_every_checkpoint_and_the_output_directory_validate_ls_and_inspect(cut):
    out = cut[0]
    for path in [out, *sorted(out.glob("checkpoint-*"))]:
        for command in ("validate", "ls", "inspect"):
            code, text = cli(command, path)
            assert code == 0, (command, path, text)
    code, text = cli("ls", out, "--json")
    assert [(g["step"], g["status"]) for g in json.loads(text)["generations"]] == \
        [(5, "committed"), (10, "committed"), (12, "committed")]


def test_a_flipped_byte_is_a_defect_and_resume_path_takes_the_one_before(cut, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(cut[0], copy)
    weights = copy / "checkpoint-12" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    code, text = cli("validate", copy / "checkpoint-12")
    assert code == 1 and "model.safetensors: blake3 mismatch" in text
    assert cli("validate", copy)[0] == 1
    with pytest.warns(UserWarning, match=r"checkpoint-12: skipped for resume: model.safetensors: blake3 mismatch"):
        assert resume_path(copy) == str(copy / "checkpoint-10")


def test_a_torn_checkpoint_without_its_record_is_skipped_with_the_reason(cut, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(cut[0], copy)
    (copy / "checkpoint-12" / hfcheckpoint.RECORD).unlink()
    with pytest.warns(UserWarning, match=r"checkpoint-12: skipped for resume: no ckptfmt-commit.json: an incomplete"):
        assert resume_path(copy) == str(copy / "checkpoint-10")
    code, text = cli("ls", copy, "--json")
    assert json.loads(text)["generations"][-1]["status"] == "incomplete"


def test_resuming_from_resume_path_ends_bit_identical_to_a_straight_run(straight, cut, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(cut[0], out)
    ckpt = Checkpointing()
    trainer(out, [ckpt]).train(resume_from_checkpoint=resume_path(out))
    assert ckpt.stopped_by_signal is None
    for name in FILES:
        assert (out / "checkpoint-20" / name).read_bytes() == (straight / "checkpoint-20" / name).read_bytes(), name
    assert cli("validate", out)[0] == 0


def test_a_requested_save_survives_save_strategy_best_overwriting_should_save(tmp_path):
    ckpt = Checkpointing()
    tr = trainer(tmp_path / "best", [SignalAt(3, signal.SIGUSR1), ckpt], steps=4, save_strategy="best",
                 eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_loss", learning_rate=0.0,
                 greater_is_better=True, eval_dataset=Tokens(n=4))   # lr 0: one eval_loss, no new best after 1
    tr.train()
    assert tr.state.global_step == 4 and ckpt.stopped_by_signal is None
    assert sorted(hfcheckpoint.step_of_dir(p) for p in (tmp_path / "best").glob("checkpoint-*")) == [1, 3]
    assert not hfcheckpoint.problems(tmp_path / "best" / "checkpoint-3")


def test_save_total_limit_is_refused_naming_it(tmp_path):
    with pytest.raises(UnsupportedSetupError, match=r"save_total_limit=2: .*set save_total_limit=None"):
        trainer(tmp_path / "r", [Checkpointing()], save_total_limit=2)


def test_the_example_exits_0_on_sigterm_with_its_newest_checkpoint_committed(tmp_path):
    out = tmp_path / "example"
    proc = warm.Popen([sys.executable, str(EXAMPLE), "--output", str(out), "--steps", "400"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "checkpoint-5" / hfcheckpoint.RECORD).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    newest = max(out.glob("checkpoint-*"), key=hfcheckpoint.step_of_dir)
    assert f"stopped by SIGTERM: {newest.name} committed" in err and 5 <= hfcheckpoint.step_of_dir(newest) < 400
    assert not hfcheckpoint.problems(newest)


@pytest.mark.xdist_group("torchrun")     # two ranks: never beside another multi-rank job
@pytest.mark.timeout(90)
def test_under_two_processes_a_sigterm_to_one_rank_stops_both_at_one_committed_step(tmp_path):
    out = tmp_path / "ddp"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(EXAMPLE), "--output", str(out), "--steps", "400"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rank1 = worker_of_rank(proc.pid, 1)
    deadline = time.monotonic() + 120
    while not (out / "checkpoint-5" / hfcheckpoint.RECORD).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(rank1, signal.SIGTERM)                 # rank 1 alone: the decision is all-reduced
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    newest = max(out.glob("checkpoint-*"), key=hfcheckpoint.step_of_dir)
    assert err.count(f"stopped by SIGTERM: {newest.name} committed") == 2      # both ranks, one step
    record = json.loads((newest / hfcheckpoint.RECORD).read_text())
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(record["files"]) and not hfcheckpoint.problems(newest)


def test_the_trainers_checkpoint_12_converts_into_step_12_bin_that_loads_into_the_model(cut, tmp_path):
    import torch

    import ckptfmt.torch as ct
    dst = tmp_path / "run" / "step_000012.bin"
    dst.parent.mkdir()
    code, text = cli("convert", cut[0] / "checkpoint-12", dst)
    assert code == 0 and "verified: round-trip" in text, text
    record = hfcheckpoint.read_record(cut[0] / "checkpoint-12")
    model = tiny_gpt2()
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [named[n] for n in g]} for g in record["param_groups"]])
    ct.load(str(dst), model, opt)
    saved = torch.load(cut[0] / "checkpoint-12" / "optimizer.pt", weights_only=True)
    flat = [named[n] for g in record["param_groups"] for n in g]
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], saved["state"][i]["exp_avg_sq"]) for i, p in enumerate(flat))
    assert opt.state[flat[0]]["step"].item() == 12


def test_retention_keeps_the_last_checkpoint_and_the_trainers_best_one(tmp_path):
    from ckptfmt.run import Policy
    ckpt = Checkpointing(retention=Policy(keep_last=1))
    tr = trainer(tmp_path / "kept", [ckpt], steps=6, save_steps=2, eval_strategy="steps", eval_steps=2,
                 metric_for_best_model="eval_loss", greater_is_better=True, learning_rate=0.0,
                 eval_dataset=Tokens(n=4))                  # lr 0: checkpoint-2's eval_loss stays the best
    tr.train()
    assert tr.state.best_model_checkpoint == str(tmp_path / "kept" / "checkpoint-2")
    assert sorted(hfcheckpoint.step_of_dir(p) for p in (tmp_path / "kept").glob("checkpoint-*")) == [2, 6]
    assert ckpt.deleted == [4] and not list((tmp_path / "kept").glob(".ckptfmt-deleting.*"))


class CountSaves(transformers.TrainerCallback):
    def __init__(self):
        self.saves = []

    def on_save(self, args, state, control, **kwargs):
        self.saves.append(state.global_step)


def test_with_save_strategy_epoch_a_sigterm_saves_its_step_once_and_the_control_pickles(tmp_path):
    import copy
    import pickle
    counted, ckpt = CountSaves(), Checkpointing()
    tr = trainer(tmp_path / "epoch", [SignalAt(3), ckpt, counted], steps=8, save_strategy="epoch")
    tr.train()
    assert counted.saves == [3] and ckpt.stopped_by_signal == "SIGTERM"    # on_epoch_end asked again: refused
    assert not hfcheckpoint.problems(tmp_path / "epoch" / "checkpoint-3")
    for copied in (pickle.loads(pickle.dumps(tr.control)), copy.deepcopy(tr.control)):
        assert type(copied) is transformers.TrainerControl and copied.should_training_stop


def test_a_resume_saving_into_a_lost_timelines_checkpoint_records_none_of_its_files(cut, tmp_path):
    out = tmp_path / "lost"
    shutil.copytree(cut[0], out)
    (out / "checkpoint-10" / "rng_state_7.pth").write_bytes(b"of another run")   # a lost timeline's file
    ckpt = Checkpointing()
    with pytest.warns(UserWarning, match="checkpoint-10: there before this save"):
        trainer(out, [ckpt], steps=10).train(resume_from_checkpoint=str(out / "checkpoint-5"))
    record = hfcheckpoint.read_record(out / "checkpoint-10")
    assert "rng_state_7.pth" not in record["files"] and not hfcheckpoint.problems(out / "checkpoint-10")


class RaiseAt(transformers.TrainerCallback):
    """A SIGTERM during step ``at``, then the step fails: ``train()`` raises before on_train_end."""

    def __init__(self, at: int):
        self.at = at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
            raise RuntimeError("the step failed")


def test_after_train_raised_the_next_train_runs_to_its_end_and_signals_reach_the_previous_handler(tmp_path):
    seen = []
    handler = lambda signum, frame: seen.append(signum)         # noqa: E731
    original = signal.signal(signal.SIGTERM, handler)
    try:
        ckpt = Checkpointing()
        with pytest.raises(RuntimeError, match="the step failed"):
            trainer(tmp_path / "a", [RaiseAt(2), ckpt], steps=3, save_strategy="no").train()
        tr = trainer(tmp_path / "b", [ckpt], steps=3, save_strategy="no")
        tr.train()                                          # the pending stop of the first is gone
        assert tr.state.global_step == 3 and ckpt.stopped_by_signal is None
        assert signal.getsignal(signal.SIGTERM) is handler  # the one from before both, never our own
        with pytest.raises(RuntimeError, match="the step failed"):
            trainer(tmp_path / "c", [RaiseAt(2), ckpt], steps=3, save_strategy="no").train()
        os.kill(os.getpid(), signal.SIGTERM)                # no train() runs: not ours to take
        assert seen == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, original)


def hooks(output_dir) -> tuple:
    from types import SimpleNamespace
    args = SimpleNamespace(save_total_limit=None, output_dir=str(output_dir), save_strategy="steps")
    state = SimpleNamespace(is_hyper_param_search=False, global_step=1, is_world_process_zero=True)
    return args, state, transformers.TrainerControl()


def test_a_sigterm_after_the_last_step_is_reported_and_a_handler_from_outside_python_is_not_restored(tmp_path):
    ckpt, (args, state, control) = Checkpointing(), hooks(tmp_path)
    ckpt.on_train_begin(args, state, control)
    ckpt._handlers.replaced[signal.SIGUSR1] = None                   # what signal() returns for a handler set in C
    ckpt.request_stop()
    ckpt.on_train_end(args, state, control)                 # no TypeError
    assert ckpt.stopped_by_signal == "SIGTERM"
    assert signal.getsignal(signal.SIGUSR1) == ckpt._handlers.handle
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_a_signal_during_the_all_reduce_counts_at_the_next_step(monkeypatch, tmp_path):
    from ckptfmt.torch import ranks
    ckpt, (args, state, control) = Checkpointing(signals=()), hooks(tmp_path)
    ckpt.on_train_begin(args, state, control)

    def during(*flags):
        ckpt.request_save()                                 # arrives while the ranks agree
        monkeypatch.setattr(ranks, "any_rank", lambda *f: f)
        return flags
    monkeypatch.setattr(ranks, "any_rank", during)
    ckpt.on_step_begin(args, state, control)
    ckpt.on_step_end(args, state, control)
    assert not control.should_save
    ckpt.on_step_end(args, state, control)
    assert control.should_save


def test_retention_keeping_everything_is_taken_and_a_hyperparameter_search_is_refused(tmp_path):
    from ckptfmt.run import Policy
    assert Checkpointing(retention=Policy.KEEP_ALL).retention is Policy.KEEP_ALL
    args, state, control = hooks(tmp_path)
    state.is_hyper_param_search = True
    with pytest.raises(UnsupportedSetupError, match="hyperparameter_search"):
        Checkpointing(signals=()).on_train_begin(args, state, control)
