"""The Checkpointing callback's options (spec/RUN.md §11.8), with real Lightning and real signals
in one process: SIGUSR1 commits last.ckpt and training goes on unchanged, chaining the handler
it found; SIGTERM commits last.ckpt and stops, and ckpt_path="last" resumes bit-exactly mid-epoch
(the example's resumable loader); the run layer's retention over the checkpoint directories,
its divergence guard included; the .loss.json history of the logged metrics."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import signal

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from test_lightning import differing, invoke, state_bytes                    # noqa: E402

from ckptfmt.errors import UnsupportedSetupError                              # noqa: E402
from ckptfmt.lightning import CheckpointIO, Checkpointing, generation_in      # noqa: E402
from ckptfmt.run import Policy                                              # noqa: E402
from ckptfmt.run.history import read as read_history                        # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "lightning_loop", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "lightning_loop.py"))
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)
STEPS = 20                  # 8 steps an epoch


class At(pl.Callback):
    """Does ``act(module)`` once, as step ``step`` ends (before the Checkpointing callback)."""

    def __init__(self, step: int, act):
        self.step, self.act = step, act

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.act(pl_module)


def kill(signum):
    return lambda module: os.kill(os.getpid(), signum)


def train(root, ckpt_path=None, *, at=None, every: int = 1000, io=None, **options):
    """The example's module and resumable loader to STEPS; ModelCheckpoint every ``every`` steps."""
    pl.seed_everything(0, verbose=False)
    model, dataset = example.Net(), example.data()
    loader = example.ResumableLoader(dataset, 12, example.ShuffleSampler(len(dataset)))
    saver = pl.callbacks.ModelCheckpoint(dirpath=root, filename="step={step}", auto_insert_metric_name=False,
                                         every_n_train_steps=every, save_top_k=-1)
    trainer = pl.Trainer(max_steps=STEPS, deterministic=True, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", default_root_dir=str(root),
                         plugins=[io or CheckpointIO()], callbacks=[*([at] if at else []), Checkpointing(**options), saver])
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model, trainer


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return state_bytes(*train(tmp_path_factory.mktemp("straight")))


def test_sigusr1_commits_last_and_training_goes_on_unchanged(straight, tmp_path):
    calls = []
    before = signal.signal(signal.SIGUSR1, lambda *_: calls.append(1))      # the user's own handler
    try:
        got = state_bytes(*train(tmp_path / "a", at=At(5, kill(signal.SIGUSR1)), signals=True))
        assert calls == [1]                                                  # chained, not replaced
        assert signal.getsignal(signal.SIGUSR1) not in (None, signal.SIG_DFL) and \
            signal.getsignal(signal.SIGUSR1)(signal.SIGUSR1, None) is None and calls == [1, 1]   # given back
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert differing(got, straight) == []
    assert generation_in(tmp_path / "a" / "last.ckpt").endswith("step_000005.bin")
    assert differing(state_bytes(*train(tmp_path / "b", str(tmp_path / "a" / "last.ckpt"))), straight) == []


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigterm_commits_last_and_stops_and_last_resumes_bit_exactly_mid_epoch(straight, tmp_path, async_save):
    with pytest.raises(SystemExit) as stopped:                               # Lightning's SIGTERMException
        train(tmp_path, at=At(11, kill(signal.SIGTERM)), io=CheckpointIO(async_save=async_save), signals=True,
              history=True)
    assert stopped.value.code in (None, 0)
    assert generation_in(tmp_path / "last.ckpt").endswith("step_000011.bin")
    model, trainer = train(tmp_path, "last", history=True)
    assert differing(state_bytes(model, trainer), straight) == []
    history = read_history(tmp_path / ".loss.json")
    assert [r["step"] for r in history.canonical()] == list(range(1, STEPS + 1))
    assert [(e["event"], e["step"]) for e in history.events()] == [("start", 0), ("resume", 11)]
    assert all(isinstance(r["loss"], float) for r in history.canonical())


def test_retention_keeps_what_the_policy_says_and_each_kept_one_validates(tmp_path):
    train(tmp_path, every=2, retention=Policy(keep_last=2, keep_every=8))
    assert sorted(os.listdir(tmp_path)) == ["step=16.ckpt", "step=18.ckpt", "step=20.ckpt", "step=8.ckpt"]
    for name in os.listdir(tmp_path):
        assert invoke("validate", tmp_path / name).exit_code == 0


def poison(module):
    with torch.no_grad():
        module.net[0].weight.fill_(math.nan)


def test_diverged_checkpoints_never_push_out_the_newest_finite_one(tmp_path):
    train(tmp_path, at=At(15, poison), every=2, retention=Policy(keep_last=2))
    assert sorted(os.listdir(tmp_path)) == ["step=14.ckpt", "step=18.ckpt", "step=20.ckpt"]
    doc = json.loads(open(generation_in(tmp_path / "step=14.ckpt")[:-4] + ".json").read())
    assert doc["metrics"]["loss"]["step"] == 14 and isinstance(doc["created"], float)


def test_keep_best_ranks_the_metric_the_module_logged(tmp_path):
    train(tmp_path, every=4, history=True, retention=Policy(keep_best=1, metric="loss", keep_last=1))
    loss = {r["step"]: r["loss"] for r in read_history(tmp_path / ".loss.json").canonical()}
    best = min((4, 8, 12, 16, 20), key=lambda s: (loss[s], -s))
    assert sorted(os.listdir(tmp_path)) == sorted({".loss.json", f"step={best}.ckpt", "step=20.ckpt"})
    doc = json.loads(open(generation_in(tmp_path / f"step={best}.ckpt")[:-4] + ".json").read())
    assert doc["metrics"]["loss"] == {"value": loss[best], "step": best}


def written(root) -> dict[str, bytes]:
    """Each checkpoint directory's .bin and companion bytes (the manifest's commit time differs)."""
    out = {}
    for name in sorted(os.listdir(root)):
        for f in sorted(os.listdir(root / name)):
            if not f.endswith(".json"):
                out[f"{name}/{f}"] = (root / name / f).read_bytes()
    return out


def test_an_async_save_writes_what_a_sync_save_writes_while_training_goes_on(tmp_path):
    """The background save writes the copy taken at the step; retention waits for its commit."""
    io = CheckpointIO(async_save=True)
    got = train(tmp_path / "async", every=2, io=io, retention=Policy(keep_last=3))
    want = train(tmp_path / "sync", every=2, retention=Policy(keep_last=3))
    assert differing(state_bytes(*got), state_bytes(*want)) == []
    assert sorted(os.listdir(tmp_path / "async")) == ["step=16.ckpt", "step=18.ckpt", "step=20.ckpt"]
    assert written(tmp_path / "async") == written(tmp_path / "sync") and io._pending is None


def test_a_failed_background_save_is_raised_at_the_next_call(tmp_path):
    io = CheckpointIO(async_save=True)
    io.save_checkpoint({"global_step": 1, "state_dict": {}, "optimizer_states": []}, tmp_path / "a.ckpt")
    with pytest.raises(UnsupportedSetupError, match=r"add ckptfmt\.lightning\.Checkpointing\(\)"):
        io.teardown()
    io.teardown()                                          # raised once
    assert os.listdir(tmp_path) == []


def test_the_tutorials_lightning_script_runs_as_written_on_a_fresh_run_and_resumes(tmp_path, monkeypatch):
    """docs/tutorials/lightning.md's script, pasted into an empty directory as it is: the history
    is opened before Lightning has made ModelCheckpoint's directory, so on a fresh run it must
    make it; run again with ``max_steps`` raised, as the page says, it resumes from the checkpoint
    the first fit left, and the directory validates."""
    import re
    from pathlib import Path
    from conftest import cli
    text = (Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "lightning.md").read_text()
    block = re.search(r"## 1\. .*?```python\n(.*?)```", text, re.S).group(1)
    assert "max_steps=64," in block
    monkeypatch.chdir(tmp_path)
    for steps in (64, 74):
        exec(compile(block.replace("max_steps=64,", f"max_steps={steps},"), "lightning.md", "exec"),
             {"__name__": "__main__"})
    history = read_history(tmp_path / "ckpt" / ".loss.json")
    assert [e["event"] for e in history.events()] == ["start", "resume"] and history.canonical()[-1]["step"] == 74
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.endswith(".ckpt"))
    # every 10 steps, Policy(keep_last=3): 50, 60, 70 and the link save_last="link" makes
    assert names == ["epoch=3-step=50.ckpt", "epoch=3-step=60.ckpt", "epoch=4-step=70.ckpt", "last.ckpt"], names
    proc = cli("validate", str(tmp_path / "ckpt" / "epoch=3-step=50.ckpt"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # ModelCheckpoint's directory as a whole: each checkpoint judged as alone, the link listed as one
    assert cli("validate", "ckpt").returncode == 0
    listed = json.loads(cli("ls", "ckpt", "--json").stdout)["generations"]
    links = [r for r in listed if r["status"].startswith("link to ")]
    assert [r["status"] for r in links] == ["link to epoch=4-step=70.ckpt"], listed
    assert {r["status"].split(" ")[0] for r in listed if r not in links} == {"committed"}, listed
    assert (listed[0]["step"], listed[-1]["step"]) == (50, 70)
    inspected = cli("inspect", "ckpt")
    assert inspected.returncode == 0 and "latest valid generation:" in inspected.stdout
    payload = tmp_path / "ckpt" / "epoch=3-step=50.ckpt" / "step_000050.bin"
    data = bytearray(payload.read_bytes())
    data[-1] ^= 1
    payload.write_bytes(bytes(data))
    proc = cli("validate", "ckpt")
    assert proc.returncode == 1 and "ckpt/epoch=3-step=50.ckpt/step_000050.bin: blake3 mismatch" in proc.stdout, proc.stdout
    data[-1] ^= 1
    payload.write_bytes(bytes(data))
    newest = tmp_path / "ckpt" / "epoch=4-step=70.ckpt"
    manifest = next(newest.glob("step_*.json"))
    kept = manifest.read_bytes()
    manifest.write_text("garbage")                       # no longer reads as a Lightning checkpoint: still judged
    proc = cli("validate", "ckpt")
    assert proc.returncode == 1 and f"{newest.name}/{manifest.name}" in proc.stdout, proc.stdout
    manifest.write_bytes(kept)
    (tmp_path / "ckpt" / "gone.ckpt").symlink_to(tmp_path / "nowhere")
    proc = cli("validate", "ckpt")
    assert proc.returncode == 0 and "gone.ckpt: a link to nothing" in proc.stdout, proc.stdout


def test_a_retention_that_is_not_a_policy_is_refused_before_training():
    with pytest.raises(TypeError, match="retention must be a ckptfmt.run.Policy, got dict"):
        Checkpointing(retention={"keep_last": 3})
    assert Checkpointing(retention=Policy.KEEP_ALL).retention is Policy.KEEP_ALL
