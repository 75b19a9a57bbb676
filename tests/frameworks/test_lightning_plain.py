"""Plain Lightning checkpoints (a torch.save .ckpt from TorchCheckpointIO) and the plugin's
directories, both ways (spec/RUN.md §11.7): the plugin resumes a plain .ckpt as Lightning's own
CheckpointIO does, convert takes one in (its one optimizer by parameter name, everything else
kept) and refuses in one line what it cannot map, and convert --to torch of a plugin checkpoint
gives Lightning's own shape, which TorchCheckpointIO resumes."""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from test_lightning import STEPS_PER_EPOCH, ckpt, differing, fit, invoke, state_bytes  # noqa: E402

from ckptfmt.errors import UnsupportedConversionError                   # noqa: E402
from ckptfmt.lightning import Checkpointing, CheckpointIO, generation_in  # noqa: E402
from ckptfmt.lightning.plugin import PlainCheckpointWarning              # noqa: E402
from ckptfmt.torch import torchsave                                      # noqa: E402
from models import tiny_adamw, train_steps                               # noqa: E402


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Two epochs through Lightning's own TorchCheckpointIO: its epoch=1 .ckpt (top-1 by val_loss)."""
    root = tmp_path_factory.mktemp("plain")
    fit(root, 2, ours=False, checkpoint={"save_top_k": 1, "monitor": "val_loss"})
    return ckpt(root, 1)


def test_a_plain_ckpt_resumes_through_the_plugin_as_through_torch_checkpoint_io(plain, tmp_path):
    """Weights, optimizer, scheduler, loops: all as Lightning resumes them (no RNG states there,
    said in a warning); the checkpoints after it are ckptfmt directories."""
    with pytest.warns(PlainCheckpointWarning, match="holds no RNG states"):
        model, trainer = fit(tmp_path / "ours", 3, plain)
    assert trainer.global_step == 3 * STEPS_PER_EPOCH
    theirs = fit(tmp_path / "theirs", 3, plain, ours=False)
    assert differing(state_bytes(model, trainer), state_bytes(*theirs)) == []
    assert generation_in(ckpt(tmp_path / "ours", 2)).endswith("step_000024.bin")


def namespace_ckpt(path, **extra) -> str:
    net, opt = tiny_adamw()
    train_steps(net, opt, 1)
    torch.save({"epoch": 0, "global_step": 1, "pytorch-lightning_version": "2.6.6", "state_dict": net.state_dict(),
                "optimizer_states": [opt.state_dict()], **extra}, path)
    return str(path)


def test_a_pickled_namespace_is_refused_in_one_line_naming_it(tmp_path):
    path = namespace_ckpt(tmp_path / "ns.ckpt", hyper_parameters=argparse.Namespace(lr=0.1))
    with pytest.raises(UnsupportedConversionError, match="argparse.Namespace") as caught:
        fit(tmp_path / "resume", 1, path)
    assert "\n" not in str(caught.value) and "weights_only=True" in str(caught.value)
    (tmp_path / "run").mkdir()
    result = invoke("convert", path, tmp_path / "run" / "step_000001.bin")
    assert result.exit_code == 2 and "argparse.Namespace" in result.output          # could not run
    assert len(result.output.strip().splitlines()) == 1 and os.listdir(tmp_path / "run") == []


def test_several_optimizers_are_refused_by_convert_in_one_line(tmp_path):
    path = namespace_ckpt(tmp_path / "two.ckpt")
    obj = torch.load(path, weights_only=True)
    obj["optimizer_states"] *= 2
    torch.save(obj, path)
    result = invoke("convert", path, tmp_path / "step_000001.bin")
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [f"ckptfmt: {path}: 2 optimizers in optimizer_states: the seed "
                                                  "layout holds one optimizer's moments"]


def test_convert_takes_a_plain_ckpt_in_with_its_optimizer_by_name(plain, tmp_path):
    out = tmp_path / "run" / "step_000016.bin"
    out.parent.mkdir()
    result = invoke("convert", plain, out)
    assert result.exit_code == 0 and "round trip: bytes identical" in result.output, result.output
    doc = json.loads((tmp_path / "run" / "step_000016.json").read_text())
    assert doc["optimizer"]["type"] == "AdamW" and doc["imported"]["keys"]["optimizer"] == "optimizer_states"
    assert doc["optimizer"]["members"] == [["net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias",
                                            "net.4.weight", "net.4.bias"]]
    assert {"callbacks", "loops", "lr_schedulers", "hyper_parameters", "epoch"} <= set(doc["imported"]["other"])
    assert invoke("validate", tmp_path / "run").exit_code == 0
    back = tmp_path / "back.ckpt"
    assert invoke("convert", out, back, "--to", "torch").exit_code == 0
    original, again = torch.load(plain, weights_only=True), torch.load(back, weights_only=True)
    assert torchsave.difference(original, again) is None         # every entry, ModelCheckpoint's 0-d kth_value too
    state = next(v for k, v in again["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert state["kth_value"].dim() == 0 and list(again) == list(original)


def test_convert_to_torch_of_a_plugin_checkpoint_resumes_with_torch_checkpoint_io(tmp_path):
    """Lightning's own shape (optimizer_states a list): TorchCheckpointIO resumes it exactly as
    the plugin resumes the directory when it leaves the RNGs alone."""
    root = tmp_path / "run"
    fit(root, 2)
    out = tmp_path / "epoch1.ckpt"
    assert invoke("convert", ckpt(root, 1), out, "--to", "torch").exit_code == 0
    loaded = torch.load(out, weights_only=True)
    assert isinstance(loaded["optimizer_states"], list) and "optimizer" not in loaded
    theirs = fit(tmp_path / "theirs", 4, str(out), ours=False)
    assert theirs[1].global_step == 4 * STEPS_PER_EPOCH
    ours = fit(tmp_path / "ours", 4, ckpt(root, 1), plugins=[CheckpointIO()], callbacks=[Checkpointing(restore_rng=False)])
    assert differing(state_bytes(*ours), state_bytes(*theirs)) == []
