"""Foreign checkpoints come in: a real ``torch.save`` of a small model with
BatchNorm + Adam/AdamW after a few steps, and a real ``safetensors.torch.save_file`` of
weights, convert into a committed .bin and back, bit-identical where the form holds the data;
what cannot be mapped is refused in one line naming it (spec/FORMAT.md §10.7)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckptfmt
import ckptfmt.torch as ct
from ckptfmt import reader
from ckptfmt.cli import main
from ckptfmt.tools.convert import convert
from ckptfmt.torch.torchsave import difference
from models import train_steps, two_layer_adamw


def run(runner, *args):
    return runner.invoke(main, list(map(str, args)), catch_exceptions=False)


def model_and_optimizer(kind=torch.optim.AdamW, seed=0, steps=3, **options):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 4, 3), torch.nn.BatchNorm1d(4), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(24, 3))
    opt = kind(model.parameters(), lr=1e-2, **options)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 2, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


def assert_same(a, b):
    assert difference(a, b) is None, difference(a, b)


@pytest.mark.parametrize("keys", [("model", "optimizer"), ("state_dict", "optimizer"),
                                  ("model_state_dict", "optimizer_state_dict")])
def test_torch_save_comes_in_and_goes_back_bit_identical(tmp_path, keys):
    model, opt = model_and_optimizer()
    obj = {keys[0]: model.state_dict(), keys[1]: opt.state_dict(), "epoch": 3, "note": "seed 0"}
    torch.save(obj, tmp_path / "ck.pt")
    rep = convert(str(tmp_path / "ck.pt"), str(tmp_path / "step_000003.bin"))
    assert (rep.round_trip, rep.verified) == ("bytes", "unverified-source")
    assert ckptfmt.validate(tmp_path / "step_000003.bin").ok
    with ckptfmt.open(tmp_path / "step_000003.bin", verify=True) as ck:
        doc = ck.manifest
        assert ck.step == 3 and [e["name"] for e in ck.layout] == [n for n, _ in model.named_parameters()]
        assert doc["optimizer"]["type"] == "AdamW" and doc["optimizer"]["step"] == 3
        assert doc["optimizer"]["hyperparams"][0]["lr"] == 1e-2 and doc["optimizer"]["hyperparams"][0]["betas"] == [0.9, 0.999]
        extra = ck.companion()
        for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            np.testing.assert_array_equal(extra.tensor(f"buffers/{name}"), model.state_dict()[name].numpy())
        assert doc["companion"]["file"] == "step_000003.extra.safetensors"
        np.testing.assert_array_equal(ck.tensor("4.weight", "m"), opt.state_dict()["state"][4]["exp_avg"].numpy())
    rep = convert(str(tmp_path / "step_000003.bin"), str(tmp_path / "back.pt"), to="torch")
    assert rep.verified == "values"
    assert_same(torch.load(tmp_path / "ck.pt", weights_only=True), torch.load(tmp_path / "back.pt", weights_only=True))


def test_an_imported_checkpoint_resumes_exactly_where_the_original_would(tmp_path):
    model, opt = model_and_optimizer(torch.optim.Adam, steps=4)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ck.pt")
    convert(str(tmp_path / "ck.pt"), str(tmp_path / "step_000004.bin"))
    twin, twin_opt = model_and_optimizer(torch.optim.Adam, seed=1, steps=1)      # different state
    ct.load(str(tmp_path / "step_000004.bin"), twin, twin_opt)
    twin.load_state_dict({**twin.state_dict(), **{k: v for k, v in model.state_dict().items() if "running" in k or "batches" in k}})
    batch = torch.randn(5, 2, 8)
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m(batch).pow(2).mean().backward()
        o.step()
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_ddp_and_compile_prefixes_are_stripped_and_restored(tmp_path, prefix):
    model, opt = model_and_optimizer()
    sd = {prefix + k: v for k, v in model.state_dict().items()}
    torch.save({"model": sd, "optimizer": opt.state_dict()}, tmp_path / "ck.pt")
    convert(str(tmp_path / "ck.pt"), str(tmp_path / "step_000003.bin"))
    layout = ckptfmt.open(tmp_path / "step_000003.bin").layout
    assert layout[0]["name"] == "0.weight"
    convert(str(tmp_path / "step_000003.bin"), str(tmp_path / "back.pt"), to="torch")
    assert_same(torch.load(tmp_path / "ck.pt", weights_only=True), torch.load(tmp_path / "back.pt", weights_only=True))


def _prefixed(sd, prefix):
    return {prefix + k: v for k, v in sd.items()}


@pytest.mark.parametrize("model_prefix,opt_prefix", [("", ""), ("module.", ""), ("", "module._orig_mod."),
                                                     ("_orig_mod.", "_orig_mod.")])
def test_an_optimizer_state_keyed_by_parameter_name_maps_by_name(runner, tmp_path, model_prefix, opt_prefix):
    """``get_state_dict``'s optimizer (state under each parameter's name, groups listing names) in a
    torch.save file: each moment lands on its parameter, wrapper prefixes on either side or both,
    and the way back writes the same names."""
    model, opt = model_and_optimizer()
    msd, osd = get_state_dict(model, opt)
    osd = {"state": _prefixed(osd["state"], opt_prefix),
           "param_groups": [dict(g, params=[opt_prefix + n for n in g["params"]]) for g in osd["param_groups"]]}
    torch.save({"model": _prefixed(msd, model_prefix), "optimizer": osd}, tmp_path / "ck.pt")
    for command in ("inspect", "validate"):
        result = run(runner, command, tmp_path / "ck.pt")
        assert result.exit_code == 0 and "unverified" in result.output, (command, result.output)
    rep = convert(str(tmp_path / "ck.pt"), str(tmp_path / "step_000003.bin"))
    assert rep.round_trip == "bytes"
    with ckptfmt.open(tmp_path / "step_000003.bin", verify=True) as ck:
        assert [e["name"] for e in ck.layout] == [n for n, _ in model.named_parameters()]
        imported = ck.manifest["imported"]          # the file's own names, never as index lists
        assert imported["indices"] == [g["params"] for g in osd["param_groups"]] and imported["param_groups"] is None
        for name, state in osd["state"].items():
            np.testing.assert_array_equal(ck.tensor(name.removeprefix(opt_prefix), "m"), state["exp_avg"].numpy())
            np.testing.assert_array_equal(ck.tensor(name.removeprefix(opt_prefix), "v"), state["exp_avg_sq"].numpy())
    convert(str(tmp_path / "step_000003.bin"), str(tmp_path / "back.pt"), to="torch")
    assert_same(torch.load(tmp_path / "ck.pt", weights_only=True), torch.load(tmp_path / "back.pt", weights_only=True))


def test_groups_beside_an_optimizer_that_names_its_parameters_must_agree(runner, tmp_path):
    model, opt = model_and_optimizer()
    msd, osd = get_state_dict(model, opt)
    torch.save({"model": msd, "optimizer": osd}, tmp_path / "ck.pt")
    names = osd["param_groups"][0]["params"]
    (tmp_path / "same.json").write_text(json.dumps([names]))
    (tmp_path / "other.json").write_text(json.dumps([list(reversed(names))]))
    same = run(runner, "convert", tmp_path / "ck.pt", tmp_path / "step_000003.bin", "--groups", tmp_path / "same.json")
    assert same.exit_code == 0, same.output
    other = run(runner, "convert", tmp_path / "ck.pt", tmp_path / "x.bin", "--groups", tmp_path / "other.json")
    assert other.exit_code == 2 and "disagrees with the optimizer's param groups" in other.stderr
    assert not (tmp_path / "x.bin").exists()


def test_a_bare_state_dict_comes_in_without_optimizer(tmp_path):
    model, _ = model_and_optimizer()
    torch.save(model.state_dict(), tmp_path / "w.pt")
    convert(str(tmp_path / "w.pt"), str(tmp_path / "step_000000.bin"))
    with ckptfmt.open(tmp_path / "step_000000.bin", verify=True) as ck:
        assert "optimizer" not in ck.manifest and ck.manifest["imported"]["optimizer_state"] == "absent"
        assert not ck.m.any() and not ck.v.any() and len(ck.layout) == 6      # BatchNorm buffers excluded
    convert(str(tmp_path / "step_000000.bin"), str(tmp_path / "back.pt"), to="torch")
    assert_same(torch.load(tmp_path / "w.pt", weights_only=True), torch.load(tmp_path / "back.pt", weights_only=True))


def test_bfloat16_parameters_and_tied_weights_survive(tmp_path):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(7, 4)
    head = torch.nn.Linear(4, 7, bias=False)
    head.weight = emb.weight                                   # tied
    model = torch.nn.ModuleDict({"emb": emb, "head": head}).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model["head"](model["emb"](torch.tensor([1, 2, 3]))).float().pow(2).mean().backward()
        opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ck.pt")
    convert(str(tmp_path / "ck.pt"), str(tmp_path / "step_000002.bin"))
    layout = ckptfmt.open(tmp_path / "step_000002.bin").layout
    assert layout == [{"name": "emb.weight", "shape": [7, 4], "offset": 0, "dtype": "bfloat16"}]
    convert(str(tmp_path / "step_000002.bin"), str(tmp_path / "back.pt"), to="torch")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert_same(torch.load(tmp_path / "ck.pt", weights_only=True), back)
    assert back["model"]["head.weight"].data_ptr() == back["model"]["emb.weight"].data_ptr()


def test_a_safetensors_file_of_weights_comes_in_with_zero_moments_and_goes_back(tmp_path):
    model, _ = model_and_optimizer()
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(tmp_path / "w.safetensors"), metadata={"format": "pt", "source": "test"})
    rep = convert(str(tmp_path / "w.safetensors"), str(tmp_path / "step_000000.bin"))
    assert rep.round_trip == "bytes" and rep.n_params == sum(p.numel() for p in model.parameters())
    with ckptfmt.open(tmp_path / "step_000000.bin", verify=True) as ck:
        assert ck.manifest["imported"]["optimizer_state"] == "absent" and "optimizer" not in ck.manifest
        assert not ck.m.any() and not ck.v.any()
        assert ck.companion().tensor("buffers/1.num_batches_tracked").tolist() == 3
    rep = convert(str(tmp_path / "step_000000.bin"), str(tmp_path / "back.safetensors"), to="weights")
    back = load_file(str(tmp_path / "back.safetensors"))
    assert set(back) == set(weights)
    for name, t in weights.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "back.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "source": "test"}


def _refused(runner, tmp_path, obj, text):
    torch.save(obj, tmp_path / "bad.pt")
    result = run(runner, "convert", tmp_path / "bad.pt", tmp_path / "step_000001.bin")
    assert result.exit_code == 2, result.output
    assert text in result.stderr and result.stderr.count("\n") == 1 and str(tmp_path / "bad.pt") in result.stderr
    assert "metadata lacks format=ckptfmt" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt"]


def test_what_cannot_be_mapped_is_refused_by_name(runner, tmp_path):
    model, adagrad = model_and_optimizer(torch.optim.Adagrad)
    _refused(runner, tmp_path, {"model": model.state_dict(), "optimizer": adagrad.state_dict()}, "is not Adam/AdamW")
    model, ams = model_and_optimizer(torch.optim.Adam, amsgrad=True)
    _refused(runner, tmp_path, {"model": model.state_dict(), "optimizer": ams.state_dict()}, "without amsgrad")
    model, opt = model_and_optimizer()
    sd = opt.state_dict()
    sd["param_groups"][0]["params"] = list(reversed(sd["param_groups"][0]["params"]))
    _refused(runner, tmp_path, {"model": model.state_dict(), "optimizer": sd}, "0.weight: shape [4, 2, 3] in the model")
    _refused(runner, tmp_path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "ema": {"w": torch.ones(2, dtype=torch.complex64)}},
             "top-level entry imported/ema/w: a torch.complex64 tensor cannot be checkpointed")
    _refused(runner, tmp_path, [torch.ones(2)], "a torch.save of a list")
    _refused(runner, tmp_path, {"config": {"lr": 1}}, "no model state dict found")
    _refused(runner, tmp_path, torch.nn.Linear(2, 2), "holds a pickled torch.nn.modules.linear.Linear")


def test_a_foreign_file_goes_to_bin_only(runner, tmp_path):
    model, opt = model_and_optimizer()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ck.pt")
    result = run(runner, "convert", tmp_path / "ck.pt", tmp_path / "x.safetensors")
    assert result.exit_code == 2 and "converts to .bin only" in result.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_cli_reports_an_unverified_source_and_a_checked_round_trip(runner, tmp_path):
    model, opt = model_and_optimizer()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ck.pt")
    result = run(runner, "convert", tmp_path / "ck.pt", tmp_path / "step_000003.bin", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verified"] == "unverified-source" and doc["round_trip"] == "bytes"
    assert doc["source_check"].startswith("unverified: a foreign file")


def test_a_bin_saved_by_ckptfmt_torch_goes_out_as_a_torch_checkpoint(tmp_path):
    model, opt = two_layer_adamw(lr=3e-3)
    train_steps(model, opt, 2)
    ct.save(str(tmp_path / "step_000002.bin"), model, opt)
    convert(str(tmp_path / "step_000002.bin"), str(tmp_path / "out.pt"), to="torch")
    obj = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_same(obj["model"], model.state_dict())
    fresh, fresh_opt = two_layer_adamw(seed=1, lr=1.0)
    fresh.load_state_dict(obj["model"])
    fresh_opt.load_state_dict(obj["optimizer"])
    assert_same(fresh_opt.state_dict(), opt.state_dict())


class _Shell:
    """Pickles as a call of os.system: a .pt that is not weights_only-safe, from a blocked module."""

    def __reduce__(self):
        import os
        return (os.system, ("true",))


def test_a_pickle_calling_a_blocked_module_is_refused_by_name_not_with_torchs_advice(runner, tmp_path):
    """torch words a blocked module ("unsupported GLOBAL posix.system whose module posix is
    blocked") unlike a plain unsupported global; the message was torch's first line, which tells
    the user to re-run with weights_only=False, and the exit code was 1 instead of 2."""
    import pickle
    torch.save({"model": {"w": torch.ones(2)}, "x": _Shell()}, tmp_path / "zip.pt")
    with open(tmp_path / "plain.pt", "wb") as f:
        pickle.dump({"model": _Shell()}, f)
    result = run(runner, "convert", tmp_path / "zip.pt", tmp_path / "step_000000.bin")
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith(f"ckptfmt: {tmp_path / 'zip.pt'}: holds a pickled posix.system, which "
                                    "torch.load(weights_only=True) refuses to run"), result.stderr
    result = run(runner, "convert", tmp_path / "plain.pt", tmp_path / "step_000000.bin")   # not torch.save's
    assert result.exit_code == 1 and result.stderr == (f"ckptfmt: {tmp_path / 'plain.pt'}: cannot load with "
                                                       "torch.load(weights_only=True): Unsupported operand 149\n")
    assert not list(tmp_path.glob("step_*"))


def test_a_legacy_non_zip_torch_save_comes_in(runner, tmp_path):
    """torch.save(..., _use_new_zipfile_serialization=False) loads with torch.load(weights_only=True),
    but not with mmap=True: convert refused it with torch's advice to re-save it."""
    model, opt = model_and_optimizer()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(state, tmp_path / "new.pt")
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    for name in ("new", "old"):
        result = run(runner, "convert", tmp_path / f"{name}.pt", tmp_path / name / "step_000003.bin")
        assert result.exit_code == 2 and "directory" in result.stderr   # the destination directory must exist
        (tmp_path / name).mkdir()
        result = run(runner, "convert", tmp_path / f"{name}.pt", tmp_path / name / "step_000003.bin")
        assert result.exit_code == 0, result.stderr
    assert (tmp_path / "old" / "step_000003.bin").read_bytes() == (tmp_path / "new" / "step_000003.bin").read_bytes()


def test_a_state_dict_without_a_floating_parameter_is_refused_naming_the_source(runner, tmp_path):
    """A safetensors file of int8 tensors only (or buffers only, or nothing) was written, then
    refused while checking the result: the message named the destination ("the manifest has no
    layout"), not the source and what it lacks."""
    cases = {"i8": {"q": torch.zeros(4, dtype=torch.int8)}, "buffers": {"bn.running_mean": torch.zeros(3)},
             "empty": {}}
    holds = {"i8": "int8", "buffers": "float32", "empty": "none"}
    for name, tensors in cases.items():
        save_file(tensors, tmp_path / f"{name}.safetensors")
        result = run(runner, "convert", tmp_path / f"{name}.safetensors", tmp_path / "step_000000.bin")
        assert result.exit_code == 2 and result.stderr == (
            f"ckptfmt: {tmp_path / name}.safetensors: no floating-point parameter tensor (it holds "
            f"{holds[name]}): nothing to put in the weights\n"), result.stderr
        assert not list(tmp_path.glob("step_*"))


@pytest.mark.parametrize("key", ["step", "global_step", "iter_num"])
def test_the_step_a_foreign_checkpoint_records_beside_its_state_is_the_step_every_command_reports(runner, tmp_path, key):
    """A loop that saves ``{"model": ..., "step": 5}`` (nanoGPT: ``iter_num``) with SGD, which
    counts no step of its own, or with no optimizer: inspect and validate report 5, as a torch
    DCP directory of the same dict does; an optimizer's own count wins where it keeps one."""
    import torch.distributed.checkpoint as dcp
    model, sgd = model_and_optimizer(torch.optim.SGD)
    torch.save({"model": model.state_dict(), "optimizer": sgd.state_dict(), key: 5}, tmp_path / "sgd.pt")
    torch.save({"model": model.state_dict(), key: 5}, tmp_path / "bare.pt")
    dcp.save({"model": model.state_dict(), key: 5}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for name in ("sgd.pt", "bare.pt", "dcp"):
        doc = json.loads(run(runner, "inspect", tmp_path / name, "--json").output)
        assert doc["step"] == 5, (name, doc["step"])
        report = json.loads(run(runner, "validate", tmp_path / name, "--json").output)
        assert report["step"] == 5, (name, report)
    adamw, _ = model_and_optimizer(steps=3)
    _, opt = model_and_optimizer(steps=3)
    torch.save({"model": adamw.state_dict(), "optimizer": opt.state_dict(), key: 5}, tmp_path / "adamw.pt")
    assert json.loads(run(runner, "inspect", tmp_path / "adamw.pt", "--json").output)["step"] == 3


def test_one_step_rule_for_what_inspect_reports_and_what_convert_writes(runner, tmp_path):
    """The step beside the state may be a 0-d integer tensor; a bool, a float, a negative
    number or one past the header's range is no step (0); an Adam that never stepped counts 0
    whatever the container says; and the ``.bin`` convert writes records the step inspect
    reported, for each case."""
    model, sgd = model_and_optimizer(torch.optim.SGD)
    cases = {"tensor": (torch.tensor(5), 5), "bool": (True, 0), "float": (5.0, 0), "negative": (-5, 0),
             "huge": (1 << 40, 0)}
    for name, (value, step) in cases.items():
        torch.save({"model": model.state_dict(), "optimizer": sgd.state_dict(), "step": value},
                   tmp_path / f"{name}.pt")
    fresh, adam = model_and_optimizer(steps=0)
    torch.save({"model": fresh.state_dict(), "optimizer": adam.state_dict(), "iter_num": 5}, tmp_path / "unstepped.pt")
    cases["unstepped"] = (None, 0)
    for name, (_, step) in cases.items():
        doc = json.loads(run(runner, "inspect", tmp_path / f"{name}.pt", "--json").output)
        assert doc["step"] == step, (name, doc["step"])
        assert run(runner, "convert", tmp_path / f"{name}.pt", tmp_path / f"{name}.bin").exit_code == 0
        assert reader.read_header(tmp_path / f"{name}.bin")[0] == step, name
