"""The Lightning integration (ckptfmt.lightning, spec/RUN.md §11), with real Lightning on tiny
models on the CPU: a resume through the plugin is bit-identical to a straight run and one through
Lightning's own TorchCheckpointIO is not; ckpt_path="last" (save_last True and "link"); a damaged
checkpoint refused before training, naming blake3; top-k removal; the pair refused apart; the
directories it writes read by validate, inspect, diff and convert."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("pytorch_lightning")

from ckptfmt import kinds, seal                                      # noqa: E402
from ckptfmt.cli import main                                         # noqa: E402
from ckptfmt.errors import (FingerprintMismatchError, NotACheckpointError, SaveError,  # noqa: E402
                            UnsupportedOptimizerError, UnsupportedSetupError)
from ckptfmt.lightning import CheckpointIO, Checkpointing, generation_in, remove  # noqa: E402

STEPS_PER_EPOCH = 8
warnings.filterwarnings("ignore", module="pytorch_lightning")


class Net(pl.LightningModule):
    """BatchNorm (buffers), dropout (draws from torch's RNG), AdamW + StepLR."""

    def __init__(self, optimizer: str = "adamw"):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def training_step(self, batch, _):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", ((self.net(x) - y) ** 2).mean())

    def configure_optimizers(self):
        if self.hparams.optimizer == "adagrad":
            return torch.optim.Adagrad(self.parameters())
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)}


def loaders():
    g = torch.Generator().manual_seed(1)             # the data itself draws nothing from the global RNG
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
    return (DataLoader(TensorDataset(x, y), batch_size=64 // STEPS_PER_EPOCH, shuffle=True),
            DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8))


def fit(root, epochs: int, ckpt_path=None, *, ours: bool = True, checkpoint: dict | None = None,
        plugins=None, callbacks=None, optimizer: str = "adamw"):
    """seed_everything(0), a fresh module, fit to ``epochs`` (saving each epoch into root/ckpt)."""
    pl.seed_everything(0, verbose=False)
    model = Net(optimizer)
    saver = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), **(checkpoint or {"save_top_k": -1}))
    trainer = pl.Trainer(max_epochs=epochs, deterministic=True, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", default_root_dir=str(root),
                         plugins=plugins if plugins is not None else [CheckpointIO()] if ours else None,
                         callbacks=[saver, *(callbacks if callbacks is not None else [Checkpointing()] if ours else [])])
    train, val = loaders()
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    return model, trainer


def ckpt(root, epoch: int) -> str:
    return os.path.join(root, "ckpt", f"epoch={epoch}-step={(epoch + 1) * STEPS_PER_EPOCH}.ckpt")


def state_bytes(model, trainer) -> dict[str, bytes]:
    """Every weight, buffer and optimizer tensor (and setting) of a finished run, as bytes."""
    out = {f"model/{k}": v.detach().contiguous().numpy().tobytes() for k, v in model.state_dict().items()}
    opt = trainer.optimizers[0].state_dict()
    for i, st in opt["state"].items():
        out.update({f"opt/{i}/{k}": v.numpy().tobytes() for k, v in st.items()})
    out["opt/groups"] = repr([sorted(g.items()) for g in opt["param_groups"]]).encode()   # values and types
    return out


def differing(a: dict[str, bytes], b: dict[str, bytes]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def invoke(*args):
    from click.testing import CliRunner
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Four epochs straight through the plugin, a checkpoint directory at every epoch."""
    root = tmp_path_factory.mktemp("straight")
    model, trainer = fit(root, 4)
    return root, state_bytes(model, trainer)


def test_a_resume_through_the_plugin_is_bit_identical_to_a_straight_run(straight, tmp_path):
    root, want = straight
    model, trainer = fit(tmp_path, 4, ckpt(root, 1))
    assert trainer.global_step == 4 * STEPS_PER_EPOCH
    assert differing(state_bytes(model, trainer), want) == []


def test_a_resume_through_lightnings_own_checkpoint_io_differs(tmp_path):
    """The negative control: the same runs with TorchCheckpointIO (no RNG states) diverge."""
    model, trainer = fit(tmp_path / "a", 4, ours=False)
    want = state_bytes(model, trainer)
    model, trainer = fit(tmp_path / "b", 4, os.path.join(tmp_path, "a", "ckpt", "epoch=1-step=16.ckpt"), ours=False)
    assert trainer.global_step == 4 * STEPS_PER_EPOCH
    assert {"model/net.0.weight", "model/net.4.weight"} <= set(differing(state_bytes(model, trainer), want))


def test_each_checkpoint_is_a_directory_of_one_committed_generation(straight):
    root, _ = straight
    path = ckpt(root, 1)
    assert sorted(os.listdir(path)) == ["step_000016.bin", "step_000016.extra.safetensors", "step_000016.json"]
    assert generation_in(path) == os.path.join(path, "step_000016.bin")
    assert not [n for n in os.listdir(os.path.join(root, "ckpt")) if n.startswith(".")]    # no temp left


@pytest.mark.parametrize("save_last", [True, "link"])
def test_ckpt_path_last_resumes_from_the_newest_checkpoint(tmp_path, save_last):
    root = tmp_path / "run"
    fit(root, 2, checkpoint={"save_top_k": 1, "monitor": "val_loss", "save_last": save_last})
    last = root / "ckpt" / "last.ckpt"
    assert last.is_symlink() == (save_last == "link")
    assert generation_in(last).endswith("step_000016.bin")
    model, trainer = fit(root, 3, "last", checkpoint={"save_top_k": 1, "monitor": "val_loss", "save_last": save_last})
    assert trainer.global_step == 3 * STEPS_PER_EPOCH          # resumed at step 16, not from scratch
    assert generation_in(last).endswith("step_000024.bin")     # last.ckpt replaced whole
    assert invoke("validate", last).exit_code == 0


def copy_of(src: str, dst) -> None:
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).write_bytes(open(os.path.join(src, name), "rb").read())


@pytest.mark.parametrize("damaged", ["step_000016.bin", "step_000016.extra.safetensors"])
def test_a_damaged_checkpoint_is_refused_before_training(straight, tmp_path, damaged):
    root, _ = straight
    copy = tmp_path / "epoch=1-step=16.ckpt"
    copy_of(ckpt(root, 1), copy)
    blob = bytearray((copy / damaged).read_bytes())
    blob[-5] ^= 0x01
    (copy / damaged).write_bytes(bytes(blob))
    with pytest.raises(FingerprintMismatchError, match="blake3 mismatch") as caught:
        fit(tmp_path / "resume", 4, str(copy))
    assert "\n" not in str(caught.value) and damaged in str(caught.value)
    assert not (tmp_path / "resume" / "ckpt").exists()       # no step was trained, nothing saved


def test_a_torch_save_file_that_is_not_lightnings_is_refused_through_the_plugin_in_one_line(tmp_path):
    torch.save({"state_dict": {}, "epoch": 0}, tmp_path / "plain.ckpt")
    with pytest.raises(NotACheckpointError, match="not a Lightning checkpoint") as caught:
        fit(tmp_path / "resume", 2, str(tmp_path / "plain.ckpt"))
    assert "\n" not in str(caught.value)


def test_a_weights_only_checkpoint_is_written_without_rng_or_optimizer(tmp_path):
    fit(tmp_path, 1, checkpoint={"save_top_k": -1, "save_weights_only": True})
    doc = json.loads(open(generation_in(ckpt(tmp_path, 0))[:-4] + ".json").read())
    assert "rng" not in doc and "optimizer" not in doc and doc["imported"]["optimizer_state"] == "absent"
    assert invoke("validate", ckpt(tmp_path, 0)).exit_code == 0


def test_top_k_leaves_exactly_k_checkpoints_each_valid(tmp_path):
    fit(tmp_path, 4, checkpoint={"save_top_k": 2, "monitor": "val_loss"})
    kept = sorted(os.listdir(tmp_path / "ckpt"))
    assert len(kept) == 2, kept
    for name in kept:
        result = invoke("validate", tmp_path / "ckpt" / name)
        assert result.exit_code == 0, result.output


def test_the_plugin_without_its_callback_refuses_to_save_in_one_line(tmp_path):
    with pytest.raises(UnsupportedSetupError, match=r"add ckptfmt\.lightning\.Checkpointing\(\)") as caught:
        fit(tmp_path, 1, callbacks=[])
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "ckpt").exists()                   # refused before anything was made


def test_the_callback_without_its_plugin_is_refused_before_training(tmp_path):
    with pytest.raises(UnsupportedSetupError, match=r"add ckptfmt\.lightning\.CheckpointIO\(\)"):
        fit(tmp_path, 1, plugins=[])


def test_an_optimizer_the_layout_cannot_hold_is_refused_before_the_first_step(tmp_path):
    with pytest.raises(UnsupportedOptimizerError, match="Adagrad"):
        fit(tmp_path, 1, optimizer="adagrad")
    assert not (tmp_path / "ckpt").exists()


def test_convert_to_torch_gives_lightnings_entries_to_torch_load(straight, tmp_path):
    root, _ = straight
    out = tmp_path / "epoch1.pt"
    result = invoke("convert", ckpt(root, 1), out, "--to", "torch")
    assert result.exit_code == 0, result.output
    loaded = torch.load(out, weights_only=True)
    assert loaded["global_step"] == 16 and loaded["epoch"] == 1
    assert set(loaded["state_dict"]) >= {"net.0.weight", "net.1.running_mean", "net.1.num_batches_tracked"}
    assert loaded["optimizer_states"][0]["state"][0]["step"].item() == 16.0
    assert loaded["lr_schedulers"][0]["last_epoch"] == 2


def test_inspect_and_diff_read_the_checkpoint_directories(straight):
    root, _ = straight
    result = invoke("inspect", ckpt(root, 1), "--json")
    assert result.exit_code == 0, result.output
    assert "step_000016" in result.output
    assert invoke("diff", ckpt(root, 1), ckpt(root, 1)).exit_code == 0
    assert invoke("diff", ckpt(root, 1), ckpt(root, 2)).exit_code == 1


def test_the_directory_is_its_own_kind_and_a_run_stays_a_run(straight, tmp_path):
    root, _ = straight
    assert kinds.sniff(ckpt(root, 1)).name == "lightning"
    copy_of(ckpt(root, 1), tmp_path / "run")
    manifest = tmp_path / "run" / "step_000016.json"
    doc = json.loads(manifest.read_text())
    del doc["lightning"]
    manifest.write_text(json.dumps(seal.apply(doc)))    # a run's manifest, sealed as written
    assert kinds.sniff(tmp_path / "run").name == "run"


def test_remove_takes_exactly_the_path_and_refuses_a_directory_it_did_not_write(straight, tmp_path):
    root, _ = straight
    copy_of(ckpt(root, 1), tmp_path / "a.ckpt")
    (tmp_path / "b.ckpt").symlink_to("a.ckpt")
    remove(tmp_path / "b.ckpt")                                # a link goes, its target stays
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt"]
    remove(tmp_path / "a.ckpt")
    assert os.listdir(tmp_path) == []
    (tmp_path / "mine.ckpt").mkdir()
    (tmp_path / "mine.ckpt" / "notes.txt").write_text("keep")
    with pytest.raises(SaveError, match="refusing to delete"):
        remove(tmp_path / "mine.ckpt")
    assert (tmp_path / "mine.ckpt" / "notes.txt").read_text() == "keep"


def test_the_cli_reads_the_directories_without_importing_lightning(straight):
    root, _ = straight
    code = ("import sys; from click.testing import CliRunner; from ckptfmt.cli import main; "
            f"r = CliRunner().invoke(main, ['validate', {ckpt(root, 1)!r}]); "
            "print(r.exit_code, sorted(m for m in sys.modules if 'lightning' in m.split('.')[0]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[-2] == "0 []", out.stdout + out.stderr


NAMESPACES = ["pytorch_lightning", "lightning.pytorch"]


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_trainer_of_either_namespace_takes_the_pair_and_sgd_resumes(tmp_path, namespace):
    """One class derives from both namespaces' bases (each Trainer checks its own); SGD's
    momentum goes to m, v stays zero."""
    ns = pytest.importorskip(namespace)

    class Line(ns.LightningModule):
        def __init__(self):
            super().__init__()
            self.line = nn.Linear(4, 1)

        def training_step(self, batch, _):
            return ((self.line(batch[0]) - batch[1]) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def run(epochs, ckpt_path=None):
        trainer = ns.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             accelerator="cpu", default_root_dir=str(tmp_path), plugins=[CheckpointIO()],
                             callbacks=[Checkpointing(), ns.callbacks.ModelCheckpoint(dirpath=tmp_path / "c", save_last=True)])
        trainer.fit(Line(), loaders()[0], ckpt_path=ckpt_path)
        return trainer
    run(2)
    doc = json.loads(open(generation_in(tmp_path / "c" / "last.ckpt")[:-4] + ".json").read())
    assert doc["optimizer"]["type"] == "SGD" and doc["lightning"]["namespace"] == namespace.split(".")[0]
    assert run(3, "last").global_step == 3 * STEPS_PER_EPOCH


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "no-exchange"])
def test_a_checkpoint_saved_again_at_its_path_is_replaced_whole(tmp_path, monkeypatch, exchange):
    """save_last=True saves last.ckpt again and again: the new directory replaces the old in one
    exchange (or, on a filesystem without one, after the old was moved aside); no temp stays."""
    from ckptfmt.lightning import files, read, write
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    net = nn.Linear(3, 2)
    path = tmp_path / "ckpt" / "last.ckpt"
    for step in (3, 7):
        with torch.no_grad():
            net.weight.fill_(step)
        assert write({"global_step": step, "state_dict": net.state_dict()}, path).endswith(f"step_{step:06d}.bin")
    assert sorted(os.listdir(path)) == ["step_000007.bin", "step_000007.json"]
    assert os.listdir(tmp_path / "ckpt") == ["last.ckpt"]
    assert torch.equal(read(path)["state_dict"]["weight"], torch.full((2, 3), 7.0))


def test_every_n_epochs_and_trainer_save_checkpoint_write_directories_that_validate_and_resume(tmp_path):
    """ModelCheckpoint(every_n_epochs=2) and a checkpoint the user asks for with
    ``trainer.save_checkpoint`` go through the plugin as every other save does: directories of
    one committed generation, valid, and a fit resumes from them."""
    _, trainer = fit(tmp_path, 4, checkpoint={"save_top_k": -1, "every_n_epochs": 2})
    made = sorted(os.listdir(tmp_path / "ckpt"))
    assert made == ["epoch=1-step=16.ckpt", "epoch=3-step=32.ckpt"]
    asked = tmp_path / "asked.ckpt"
    trainer.save_checkpoint(str(asked))
    assert asked.is_dir() and generation_in(asked).endswith("step_000032.bin")
    for path in (tmp_path / "ckpt" / made[0], asked):
        result = invoke("validate", path)
        assert result.exit_code == 0, result.output
    model, _ = fit(tmp_path / "again", 5, str(asked))
    assert model.trainer.global_step == 40
