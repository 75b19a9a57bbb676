"""Golden files of every earlier format keep loading (spec/FORMAT.md "Schema").

tests/golden/v1/ was written once by the code before the layout change (make_v1.py says how);
tests/golden/mapping/ by the code that added the mapping's fields (make_mapping.py).
Each file must be read by today's code through the public API and the CLI, and give the values
and bytes it was written with.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptfmt
from conftest import cli

V1 = Path(__file__).resolve().parents[1] / "golden" / "v1"
GOLDEN_BIN = V1 / "bin" / "step_000007.bin"


def regions(step: int):
    w = (np.arange(6, dtype="<f4") - 2.5) * step
    return w, w / 1000, np.abs(w) / 1e6


def test_v1_generation_opens_verifies_and_reads_by_name():
    with ckptfmt.open(GOLDEN_BIN, verify=True) as ck:
        assert ck.step == 7 and ck.n_params == 6
        for got, want in zip((ck.weights, ck.m, ck.v), regions(7)):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(ck.tensor("a.weight"), regions(7)[0][:4].reshape(2, 2))
        assert ck.manifest["optimizer"] == {"type": "AdamW", "step": 7}
    assert ckptfmt.validate(GOLDEN_BIN).ok


@pytest.mark.parametrize("source", ["sharded/step_000007.json", "zst/step_000007.zst",
                                    "dcp/step_000007.dcp"])
def test_v1_foreign_forms_convert_back_to_the_same_bytes(tmp_path, source):
    out = tmp_path / "step_000007.bin"
    proc = cli("convert", str(V1 / source), str(out), "--to", "bin")
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == GOLDEN_BIN.read_bytes()
    assert cli("validate", str(out)).returncode == 0


def test_v1_sharded_generation_validates():
    proc = cli("validate", str(V1 / "sharded"), "--json")   # a run holding one sharded generation
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_v1_export_archive_imports_verified(tmp_path):
    dest = tmp_path / "back"
    proc = cli("import", str(V1 / "export" / "run.tar.zst"), str(dest), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == [5, 7]
    for step in (5, 7):
        with ckptfmt.open(dest / f"step_{step:06d}.bin", verify=True) as ck:
            for got, want in zip((ck.weights, ck.m, ck.v), regions(step)):
                np.testing.assert_array_equal(got, want)
    assert cli("validate", str(dest)).returncode == 0
    assert sum(1 for _ in open(dest / ".loss.json")) == 7


# ---------------------------------------------------------------- the mapping's fields (make_mapping.py)
MAPPING = Path(__file__).resolve().parents[1] / "golden" / "mapping"


def _tied_gpt():
    import torch
    from torch import nn
    sys.path.insert(0, str(MAPPING.parent))
    try:
        from make_mapping import TiedGPT
    finally:
        sys.path.remove(str(MAPPING.parent))
    torch.manual_seed(7)
    return TiedGPT(), nn


def test_a_generation_with_members_aliases_and_setting_types_restores_by_name(tmp_path):
    """Groups listed the other way round and plain-float settings in the loop: each group gets
    its own saved settings in their saved types, each parameter its own moments."""
    torch = pytest.importorskip("torch")
    from ckptfmt.torch import CheckpointManager
    run = tmp_path / "run"
    shutil.copytree(MAPPING / "adamw", run)
    model, _ = _tied_gpt()
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [named[n] for n in ("ln.weight", "ln.bias", "fc.bias")]},
                             {"params": [named["wte.weight"], named["fc.weight"]], "lr_scale": 9.0}], lr=1.0)
    with CheckpointManager(run, model, opt, every=None, keep_last=None, handle_signals=False) as mgr:
        assert mgr.restore() == 3
    rest, decay = opt.param_groups
    assert (rest["lr"], rest["weight_decay"], decay["weight_decay"]) == (1e-2, 0.0, 0.1)
    assert type(decay["lr"]) is np.float32 and decay["lr"] == np.float32(3e-3)
    assert type(decay["lr_scale"]) is np.float32 and decay["lr_scale"] == np.float32(0.5)
    assert decay["betas"] == (0.9, 0.95) and isinstance(decay["betas"], tuple)
    with ckptfmt.open(run / "step_000003.bin") as ck:
        np.testing.assert_array_equal(ck.tensor("lm_head.weight"), ck.tensor("wte.weight"))
        for name, p in model.named_parameters():
            assert np.array_equal(ck.tensor(name), p.detach().numpy()), name
            assert np.array_equal(ck.tensor(name, "m"), opt.state[p]["exp_avg"].numpy()), name
            assert np.array_equal(ck.tensor(name, "v"), opt.state[p]["exp_avg_sq"].numpy()), name
    assert model.lm_head.weight is model.wte.weight


def test_a_generation_with_members_aliases_and_setting_types_exports_to_torch(tmp_path):
    torch = pytest.importorskip("torch")
    shutil.copytree(MAPPING / "adamw", tmp_path / "run")
    result = cli("convert", str(tmp_path / "run" / "step_000003.bin"), str(tmp_path / "out.pt"), "--to", "torch")
    assert result.returncode == 0, result.stderr
    obj = torch.load(tmp_path / "out.pt", weights_only=True)
    model, _ = _tied_gpt()
    model.load_state_dict(obj["model"], strict=True)
    assert [g["params"] for g in obj["optimizer"]["param_groups"]] == [[0, 1], [2, 3, 4]]
    assert obj["optimizer"]["param_groups"][0]["lr"] == pytest.approx(3e-3)


def test_an_sgd_generation_with_members_restores_its_momentum(tmp_path):
    torch = pytest.importorskip("torch")
    from ckptfmt.torch import CheckpointManager
    run = tmp_path / "run"
    shutil.copytree(MAPPING / "sgd", run)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5)
    with CheckpointManager(run, model, opt, every=None, keep_last=None, handle_signals=False) as mgr:
        assert mgr.restore() == 2
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["nesterov"] is True
    with ckptfmt.open(run / "step_000002.bin") as ck:
        for name, p in model.named_parameters():
            assert np.array_equal(ck.tensor(name, "m"), opt.state[p]["momentum_buffer"].numpy()), name
            assert not ck.tensor(name, "v").any(), name
