"""Mapping a training loop's real state onto the seed layout, as a new user tries it: layer-wise
LR decay param groups, nanoGPT's decay/no-decay groups and tied weights, SGD momentum, NumPy
and tensor hyper-parameters, a nanoGPT ``ckpt.pt``, and the refusals that must name what they
refuse (a shape match alone never proves which parameter an optimizer index is).

Everything is real: tiny torch models trained a few steps, real files, the real CLI."""
from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import ckptfmt
import ckptfmt.torch as ct
from ckptfmt import errors as E
from ckptfmt.cli import main
from ckptfmt.torch import CheckpointManager
from models import inputs, tiny_adamw, tiny_linear, two_layer, two_layer_adamw
from conftest import without_root_digests  # noqa: E402


# ---------------------------------------------------------------- helpers
def cli(runner, *args):
    return runner.invoke(main, list(map(str, args)), catch_exceptions=False)


def one_line(result):
    """The command's error: exactly one line on stderr."""
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def train(model, opt, batch, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        model(batch).float().pow(2).mean().backward()
        opt.step()


def as_torch(array):
    return torch.from_numpy(np.array(array))


def step_files(run):
    """What a save leaves in a run directory: generations, manifests, temps (none if no directory)."""
    if not run.exists():
        return []
    return sorted(p.name for p in run.iterdir() if p.name.startswith(("step_", ".ckptfmt-tmp")))


def manager(run, model, opt, **kw):
    return CheckpointManager(run, model, opt, every=None, keep_last=None, **kw)


# Layer-wise LR decay: 4 Linear layers, one group per layer, listed top layer down.
def llrd_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])


def llrd_groups(model, names=False):
    groups = []
    for i in reversed(range(4)):
        group = {"params": [model[i].weight, model[i].bias], "lr": 1e-2 * 0.5 ** (3 - i)}
        if names:
            group["param_names"] = [f"{i}.weight", f"{i}.bias"]
        groups.append(group)
    return groups


LLRD_GROUPS = [[f"{i}.weight", f"{i}.bias"] for i in reversed(range(4))]


def llrd_checkpoint(path, names=False):
    model = llrd_model()
    opt = torch.optim.AdamW(llrd_groups(model, names))
    torch.manual_seed(1)
    train(model, opt, torch.randn(5, 4))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return model, opt


def assert_moments_on_their_layers(path, model, opt):
    with ckptfmt.open(path) as ck:
        for i in range(4):
            for part in ("weight", "bias"):
                p = getattr(model[i], part)
                name = f"{i}.{part}"
                assert torch.equal(as_torch(ck.tensor(name)), p.detach()), name
                assert torch.equal(as_torch(ck.tensor(name, region="m")), opt.state[p]["exp_avg"]), name
                assert torch.equal(as_torch(ck.tensor(name, region="v")), opt.state[p]["exp_avg_sq"]), name


# nanoGPT-style: embedding, a block, a head tied (or not) to the embedding.
class TinyGPT(nn.Module):
    def __init__(self, tie=True):
        super().__init__()
        self.wte = nn.Embedding(8, 4)
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        return self.lm_head(x + self.fc(self.ln(x)))


def gpt(seed=0, tie=True):
    torch.manual_seed(seed)
    return TinyGPT(tie)


def decay_groups(model):
    """nanoGPT's configure_optimizers."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def decay_group_names(model):
    return [[n for n, p in model.named_parameters() if p.dim() >= 2],
            [n for n, p in model.named_parameters() if p.dim() < 2]]


TOKENS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])


def trained_gpt(tie=True, steps=3):
    model = gpt(tie=tie)
    opt = torch.optim.AdamW(decay_groups(model), lr=1e-2, betas=(0.9, 0.95))
    train(model, opt, TOKENS, steps)
    return model, opt


def assert_same_optimizer_state(a, b):
    """Two optimizer state dicts: same indices, same tensors bit for bit, same groups."""
    assert sorted(a["state"]) == sorted(b["state"])
    for i in a["state"]:
        assert sorted(a["state"][i]) == sorted(b["state"][i]), i
        for key, value in a["state"][i].items():
            other = b["state"][i][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), (i, key)
            else:
                assert value == other, (i, key)
    assert [dict(g) for g in a["param_groups"]] == [dict(g) for g in b["param_groups"]]


# ---------------------------------------------------------------- 1. layer-wise LR decay
def assert_refused_naming_the_groups_option(runner, source, run, name):
    """Several param groups without names: exit 2, one line naming --groups, nothing written."""
    run.mkdir()
    result = cli(runner, "convert", source, run / name)
    assert result.exit_code == 2, result.output
    assert "--groups" in one_line(result)
    assert step_files(run) == []


def test_llrd_groups_without_names_are_refused_naming_the_groups_option(runner, tmp_path):
    llrd_checkpoint(tmp_path / "llrd.pt")
    assert_refused_naming_the_groups_option(runner, tmp_path / "llrd.pt", tmp_path / "run", "step_000003.bin")


def test_llrd_groups_with_param_names_convert_with_moments_on_their_layers(runner, tmp_path):
    model, opt = llrd_checkpoint(tmp_path / "llrd.pt", names=True)
    (tmp_path / "run").mkdir()
    result = cli(runner, "convert", tmp_path / "llrd.pt", tmp_path / "run" / "step_000003.bin")
    assert result.exit_code == 0, result.output
    assert_moments_on_their_layers(tmp_path / "run" / "step_000003.bin", model, opt)


def test_llrd_groups_with_a_groups_file_convert_with_moments_on_their_layers(runner, tmp_path):
    model, opt = llrd_checkpoint(tmp_path / "llrd.pt")
    (tmp_path / "groups.json").write_text(json.dumps(LLRD_GROUPS))
    (tmp_path / "run").mkdir()
    result = cli(runner, "convert", tmp_path / "llrd.pt", tmp_path / "run" / "step_000003.bin",
                 "--groups", tmp_path / "groups.json")
    assert result.exit_code == 0, result.output
    assert_moments_on_their_layers(tmp_path / "run" / "step_000003.bin", model, opt)


@pytest.mark.parametrize("groups", [
    [["3.weight", "3.bias"], ["2.weight", "2.bias"], ["1.weight", "1.bias"], ["0.weight", "0.bais"]],
    [["3.weight", "3.bias", "2.weight"], ["2.bias"], ["1.weight", "1.bias"], ["0.weight", "0.bias"]],
    [["3.weight", "3.bias", "2.weight", "2.bias"], ["1.weight", "1.bias", "0.weight", "0.bias"]],
], ids=["unknown_name", "group_sizes_disagree", "too_few_groups"])
def test_a_groups_file_that_does_not_fit_is_refused_naming_the_file(runner, tmp_path, groups):
    llrd_checkpoint(tmp_path / "llrd.pt")
    (tmp_path / "groups.json").write_text(json.dumps(groups))
    (tmp_path / "run").mkdir()
    result = cli(runner, "convert", tmp_path / "llrd.pt", tmp_path / "run" / "step_000003.bin",
                 "--groups", tmp_path / "groups.json")
    assert result.exit_code == 2, result.output
    assert str(tmp_path / "groups.json") in one_line(result)
    assert step_files(tmp_path / "run") == []


@pytest.mark.parametrize("names", [True, False], ids=["param_names", "groups_file"])
def test_llrd_checkpoint_goes_back_to_torch_and_loads_into_the_same_groups(runner, tmp_path, names):
    model, opt = llrd_checkpoint(tmp_path / "llrd.pt", names=names)
    (tmp_path / "groups.json").write_text(json.dumps(LLRD_GROUPS))
    (tmp_path / "run").mkdir()
    binary = tmp_path / "run" / "step_000003.bin"
    extra = [] if names else ["--groups", tmp_path / "groups.json"]
    assert cli(runner, "convert", tmp_path / "llrd.pt", binary, *extra).exit_code == 0
    result = cli(runner, "convert", binary, tmp_path / "back.pt", "--to", "torch")
    assert result.exit_code == 0, result.output
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    fresh = llrd_model(seed=5)
    fresh_opt = torch.optim.AdamW(llrd_groups(fresh, names))
    fresh.load_state_dict(back["model"])
    fresh_opt.load_state_dict(back["optimizer"])
    for i in range(4):
        for part in ("weight", "bias"):
            p, q = getattr(model[i], part), getattr(fresh[i], part)
            assert torch.equal(q.detach(), p.detach())
            assert torch.equal(fresh_opt.state[q]["exp_avg"], opt.state[p]["exp_avg"]), f"{i}.{part}"
            assert torch.equal(fresh_opt.state[q]["exp_avg_sq"], opt.state[p]["exp_avg_sq"]), f"{i}.{part}"
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in opt.param_groups]


# ---------------------------------------------------------------- 2. NumPy and tensor hyper-parameters
def numpy_lr_model_and_optimizer(seed, lr, lr_scale):
    model = tiny_linear(seed)
    opt = torch.optim.AdamW([{"params": list(model.parameters()), "lr": np.float32(lr),
                              "lr_scale": np.float32(lr_scale)}])
    return model, opt


def assert_numpy_settings_restored(opt):
    group = opt.param_groups[0]
    assert "lr" in group and "lr_scale" in group
    assert float(group["lr"]) == float(np.float32(1e-3))
    assert float(group["lr_scale"]) == 0.5


def test_numpy_hyperparameters_survive_a_manager_save_and_restore(tmp_path):
    model, opt = numpy_lr_model_and_optimizer(0, 1e-3, 0.5)
    batch = inputs(4)
    train(model, opt, batch)
    mgr = manager(tmp_path / "run", model, opt)
    mgr.close(3)
    fresh, fresh_opt = numpy_lr_model_and_optimizer(7, 5e-2, 1.0)
    mgr = manager(tmp_path / "run", fresh, fresh_opt)
    assert mgr.restore() == 3
    mgr.close()
    assert_numpy_settings_restored(fresh_opt)
    train(fresh, fresh_opt, batch, steps=1)
    assert all(torch.isfinite(p).all() for p in fresh.parameters())


def test_numpy_hyperparameters_survive_ckptfmt_torch_save_and_load(tmp_path):
    model, opt = numpy_lr_model_and_optimizer(0, 1e-3, 0.5)
    batch = inputs(4)
    train(model, opt, batch)
    ct.save(str(tmp_path / "step_000003.bin"), model, opt)
    fresh, fresh_opt = numpy_lr_model_and_optimizer(7, 5e-2, 1.0)
    ct.load(str(tmp_path / "step_000003.bin"), fresh, fresh_opt)
    assert_numpy_settings_restored(fresh_opt)
    train(fresh, fresh_opt, batch, steps=1)
    assert all(torch.isfinite(p).all() for p in fresh.parameters())


def test_a_tensor_learning_rate_comes_back_as_a_tensor(tmp_path):
    model = tiny_linear()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3), foreach=False)
    batch = inputs(4)
    train(model, opt, batch)
    manager(tmp_path / "run", model, opt).close(3)
    fresh = tiny_linear(seed=7)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=torch.tensor(5e-2), foreach=False)
    mgr = manager(tmp_path / "run", fresh, fresh_opt)
    assert mgr.restore() == 3
    mgr.close()
    lr = fresh_opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dim() == 0
    assert torch.equal(lr, torch.tensor(1e-3))
    train(fresh, fresh_opt, batch, steps=1)


UNSTORABLE = [(lambda s: s, "lambda"), (object(), "object")]


def _group_and_key_named(message):
    assert "schedule" in message, message
    assert re.search(r"group\w*\W*1\b", message), message


@pytest.mark.parametrize("value", [v for v, _ in UNSTORABLE], ids=[i for _, i in UNSTORABLE])
def test_an_unstorable_group_setting_is_refused_by_the_manager_before_writing(tmp_path, value):
    model = two_layer()
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=1e-3)
    train(model, opt, inputs(4), steps=1)
    opt.param_groups[1]["schedule"] = value
    with pytest.raises(E.CheckpointError) as info:      # at construction or at the save: before a byte
        mgr = manager(tmp_path / "run", model, opt)
        try:
            mgr.save(1)
        finally:
            mgr.close()
    _group_and_key_named(str(info.value))
    assert step_files(tmp_path / "run") == []


@pytest.mark.parametrize("value", [v for v, _ in UNSTORABLE], ids=[i for _, i in UNSTORABLE])
def test_an_unstorable_group_setting_is_refused_by_torch_save_before_writing(tmp_path, value):
    model = two_layer()
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=1e-3)
    train(model, opt, inputs(4), steps=1)
    opt.param_groups[1]["schedule"] = value
    with pytest.raises(E.CheckpointError) as info:
        ct.save(str(tmp_path / "step_000001.bin"), model, opt)
    _group_and_key_named(str(info.value))
    assert step_files(tmp_path) == []


# ---------------------------------------------------------------- 3. SGD momentum
def sgd_model_and_optimizer(seed=0, **options):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **options)


@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_sgd_momentum_goes_out_to_torch_and_steps_like_the_live_optimizer(runner, tmp_path, nesterov):
    model, opt = sgd_model_and_optimizer(nesterov=nesterov)
    batch = torch.randn(5, 3)
    train(model, opt, batch)
    manager(tmp_path / "run", model, opt).close(3)
    result = cli(runner, "convert", tmp_path / "run" / "step_000003.bin", tmp_path / "out.pt", "--to", "torch")
    assert result.exit_code == 0, result.output
    obj = torch.load(tmp_path / "out.pt", weights_only=True)
    for i, p in enumerate(model.parameters()):
        assert torch.equal(obj["optimizer"]["state"][i]["momentum_buffer"], opt.state[p]["momentum_buffer"]), i
    fresh, fresh_opt = sgd_model_and_optimizer(seed=9, nesterov=nesterov)
    fresh.load_state_dict(obj["model"])
    fresh_opt.load_state_dict(obj["optimizer"])
    train(model, opt, batch, steps=1)
    train(fresh, fresh_opt, batch, steps=1)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name


def test_a_foreign_sgd_momentum_checkpoint_converts_and_goes_back(runner, tmp_path):
    model, opt = sgd_model_and_optimizer()
    train(model, opt, torch.randn(5, 3))
    original = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(original, tmp_path / "sgd.pt")
    binary = tmp_path / "sgd.bin"         # SGD keeps no step: the name does not claim one
    result = cli(runner, "convert", tmp_path / "sgd.pt", binary)
    assert result.exit_code == 0, result.output
    with ckptfmt.open(binary) as ck:
        for name, p in model.named_parameters():
            assert torch.equal(as_torch(ck.tensor(name, region="m")), opt.state[p]["momentum_buffer"]), name
    result = cli(runner, "convert", binary, tmp_path / "back.pt", "--to", "torch")
    assert result.exit_code == 0, result.output
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert list(back["model"]) == list(original["model"])
    for name, t in original["model"].items():
        assert torch.equal(back["model"][name], t), name
    assert_same_optimizer_state(original["optimizer"], back["optimizer"])


# ---------------------------------------------------------------- 4. groups and tied weights in a manager run
def test_decay_groups_of_a_manager_run_go_out_to_torch_and_weights(runner, tmp_path):
    model, opt = trained_gpt(tie=False)
    manager(tmp_path / "run", model, opt).close(3)
    binary = tmp_path / "run" / "step_000003.bin"
    result = cli(runner, "convert", binary, tmp_path / "out.pt", "--to", "torch")
    assert result.exit_code == 0, result.output
    result = cli(runner, "convert", binary, tmp_path / "out.safetensors", "--to", "weights")
    assert result.exit_code == 0, result.output
    obj = torch.load(tmp_path / "out.pt", weights_only=True)
    assert [g["weight_decay"] for g in obj["optimizer"]["param_groups"]] == [0.1, 0.0]
    fresh = gpt(seed=3, tie=False)
    fresh_opt = torch.optim.AdamW(decay_groups(fresh), lr=1e-2, betas=(0.9, 0.95))
    fresh.load_state_dict(obj["model"], strict=True)
    fresh_opt.load_state_dict(obj["optimizer"])
    live = dict(model.named_parameters())
    for name, q in fresh.named_parameters():
        group = next(g for g in fresh_opt.param_groups if any(x is q for x in g["params"]))
        assert group["weight_decay"] == (0.1 if q.dim() >= 2 else 0.0), name
        assert torch.equal(q.detach(), live[name].detach()), name
        assert torch.equal(fresh_opt.state[q]["exp_avg"], opt.state[live[name]]["exp_avg"]), name
        assert torch.equal(fresh_opt.state[q]["exp_avg_sq"], opt.state[live[name]]["exp_avg_sq"]), name
    from safetensors.torch import load_file
    weights = load_file(str(tmp_path / "out.safetensors"))
    for name, t in model.state_dict().items():
        assert torch.equal(weights[name], t), name


def test_tied_weights_of_a_manager_run_are_readable_and_exported_under_both_names(runner, tmp_path):
    model = gpt(tie=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, TOKENS)
    manager(tmp_path / "run", model, opt).close(3)
    binary = tmp_path / "run" / "step_000003.bin"
    with ckptfmt.open(binary) as ck:
        assert torch.equal(as_torch(ck.tensor("lm_head.weight")), as_torch(ck.tensor("wte.weight")))
        assert torch.equal(as_torch(ck.tensor("lm_head.weight")), model.wte.weight.detach())
    result = cli(runner, "convert", binary, tmp_path / "out.pt", "--to", "torch")
    assert result.exit_code == 0, result.output
    obj = torch.load(tmp_path / "out.pt", weights_only=True)
    assert {"wte.weight", "lm_head.weight"} <= set(obj["model"])
    fresh = gpt(seed=4, tie=True)
    fresh.load_state_dict(obj["model"], strict=True)
    assert torch.equal(fresh.lm_head.weight, model.wte.weight) and fresh.lm_head.weight is fresh.wte.weight
    result = cli(runner, "convert", binary, tmp_path / "out.safetensors", "--to", "weights")
    assert result.exit_code == 0, result.output
    from safetensors import safe_open
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        assert {"wte.weight", "lm_head.weight"} <= set(f.keys())
        assert torch.equal(f.get_tensor("lm_head.weight"), model.wte.weight.detach())
        assert torch.equal(f.get_tensor("wte.weight"), model.wte.weight.detach())


# ---------------------------------------------------------------- 5. a nanoGPT ckpt.pt
def nanogpt_checkpoint(path):
    model, opt = trained_gpt(tie=True, steps=7)
    obj = {"model": model.state_dict(), "optimizer": opt.state_dict(),
           "model_args": {"n_layer": 1, "n_head": 1, "n_embd": 4, "block_size": 4, "bias": True,
                          "vocab_size": 8, "dropout": 0.0},
           "iter_num": 7, "best_val_loss": torch.tensor(2.5),
           "config": {"out_dir": "out", "learning_rate": 1e-2, "weight_decay": 0.1, "compile": False}}
    torch.save(obj, path)
    return model, opt, obj


def test_a_nanogpt_checkpoint_without_groups_is_refused_naming_the_groups_option(runner, tmp_path):
    nanogpt_checkpoint(tmp_path / "ckpt.pt")
    assert_refused_naming_the_groups_option(runner, tmp_path / "ckpt.pt", tmp_path / "run", "step_000007.bin")


def test_a_nanogpt_checkpoint_with_groups_converts_and_goes_back_whole(runner, tmp_path):
    model, opt, original = nanogpt_checkpoint(tmp_path / "ckpt.pt")
    (tmp_path / "groups.json").write_text(json.dumps(decay_group_names(model)))
    (tmp_path / "run").mkdir()
    binary = tmp_path / "run" / "step_000007.bin"
    result = cli(runner, "convert", tmp_path / "ckpt.pt", binary, "--groups", tmp_path / "groups.json")
    assert result.exit_code == 0, result.output
    with ckptfmt.open(binary) as ck:
        for name, p in model.named_parameters():
            assert torch.equal(as_torch(ck.tensor(name, region="m")), opt.state[p]["exp_avg"]), name
    result = cli(runner, "convert", binary, tmp_path / "back.pt", "--to", "torch")
    assert result.exit_code == 0, result.output
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert isinstance(back["best_val_loss"], torch.Tensor) and back["best_val_loss"].dim() == 0
    assert torch.equal(back["best_val_loss"], torch.tensor(2.5))
    assert back["iter_num"] == 7 and type(back["iter_num"]) is int
    assert back["model_args"] == original["model_args"] and back["config"] == original["config"]
    assert {"wte.weight", "lm_head.weight"} <= set(back["model"])
    for name, t in original["model"].items():
        assert torch.equal(back["model"][name], t), name
    assert_same_optimizer_state(original["optimizer"], back["optimizer"])


# ---------------------------------------------------------------- 6. smaller
def lazy_model_and_optimizer():
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_an_unmaterialised_lazy_parameter_is_refused_by_the_manager_by_name(tmp_path):
    model, opt = lazy_model_and_optimizer()
    with pytest.raises(E.CheckpointError, match=r"0\.weight"):
        manager(tmp_path / "run", model, opt)
    assert step_files(tmp_path / "run") == []


def test_an_unmaterialised_lazy_parameter_is_refused_by_torch_save_by_name(tmp_path):
    model, opt = lazy_model_and_optimizer()
    with pytest.raises(E.CheckpointError, match=r"0\.weight"):
        ct.save(str(tmp_path / "step_000000.bin"), model, opt, step=0)
    assert step_files(tmp_path) == []


def test_a_data_parallel_run_restored_unwrapped_names_the_module_prefix_and_the_fix(tmp_path):
    wrapped = nn.DataParallel(tiny_linear())
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    train(wrapped, opt, inputs(4))
    manager(tmp_path / "run", wrapped, opt).close(3)
    fresh = tiny_linear(seed=1)
    mgr = manager(tmp_path / "run", fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    try:
        with pytest.raises(E.LayoutMismatchError) as info:
            mgr.restore()
    finally:
        mgr.close()
    message = str(info.value)
    assert "'module.'" in message, message
    assert any(word in message for word in ("DataParallel", ".module", "wrap")), message
    assert "\n" not in message


def foreign_adam_checkpoint(path):
    model, opt = two_layer_adamw(lr=1e-3)
    train(model, opt, inputs(5))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return model, opt


def test_a_converted_checkpoint_without_rng_restores_only_when_not_strict(runner, tmp_path):
    model, opt = foreign_adam_checkpoint(tmp_path / "foreign.pt")
    (tmp_path / "run").mkdir()
    result = cli(runner, "convert", tmp_path / "foreign.pt", tmp_path / "run" / "step_000003.bin")
    assert result.exit_code == 0, result.output
    fresh, fresh_opt = two_layer_adamw(seed=5, lr=1e-3)
    mgr = manager(tmp_path / "run", fresh, fresh_opt)
    try:
        with pytest.raises(E.IncompleteResumeStateError, match="rng"):
            mgr.restore()
        with warnings.catch_warnings(record=True):        # each piece that starts fresh is said
            warnings.simplefilter("always")
            assert mgr.restore(strict=False) == 3
        assert mgr.fresh and any("rng" in piece for piece in mgr.fresh), mgr.fresh
    finally:
        mgr.close()
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(opt.state[a]["exp_avg"], fresh_opt.state[b]["exp_avg"]), name


def test_a_converted_safetensors_file_loads_by_parameter_name_whatever_its_order(runner, tmp_path):
    """A safetensors file keeps its tensors sorted by name ('bias' before 'weight'), so the
    converted generation lists the model's parameters in another order: each is read by its name."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    trained = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    save_file(trained.state_dict(), str(tmp_path / "w.safetensors"))
    result = cli(runner, "convert", tmp_path / "w.safetensors", tmp_path / "step_000007.bin")
    assert result.exit_code == 0, result.output
    layout = json.loads((tmp_path / "step_000007.json").read_text())["layout"]
    assert [e["name"] for e in layout] == ["0.bias", "0.weight", "1.bias", "1.weight"]
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ct.load(str(tmp_path / "step_000007.bin"), model).close()
    for (name, a), b in zip(trained.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(E.LayoutMismatchError, match=r"the checkpoint has '1.bias' \(and 1 more\), which the model lacks"):
        ct.load(str(tmp_path / "step_000007.bin"), nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))


def test_the_managers_warnings_name_the_callers_line_not_the_librarys(runner, tmp_path):
    """A piece that starts fresh and a damaged generation passed over are warned from deep in
    the library's layers; each warning names the line of the user's program that called the
    manager."""
    model, opt = foreign_adam_checkpoint(tmp_path / "foreign.pt")
    (tmp_path / "run").mkdir()
    assert cli(runner, "convert", tmp_path / "foreign.pt", tmp_path / "run" / "step_000003.bin").exit_code == 0
    fresh, fresh_opt = two_layer_adamw(seed=5, lr=1e-3)
    with manager(tmp_path / "run", fresh, fresh_opt) as mgr, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert mgr.restore(strict=False) == 3
        mgr.save(4)
    bin4 = tmp_path / "run" / "step_000004.bin"
    bin4.write_bytes(bin4.read_bytes()[:-4] + b"\0\0\0\1")               # a committed generation, damaged
    again, again_opt = two_layer_adamw(seed=5, lr=1e-3)
    with manager(tmp_path / "run", again, again_opt) as mgr, warnings.catch_warnings(record=True) as passed_over:
        warnings.simplefilter("always")
        assert mgr.restore(strict=False) == 3
    said = [(w.filename, str(w.message)) for w in seen + passed_over]
    assert any("starts fresh" in m for _, m in said) and any("skipping generation 4" in m for _, m in said), said
    assert {f for f, _ in said} == {__file__}, said


class Pair(nn.Module):
    """Two layers registered in the order given: the same names, another parameter order."""
    def __init__(self, first: str):
        super().__init__()
        for name in (first, "b" if first == "a" else "a"):
            setattr(self, name, nn.Linear(3, 3))

    def forward(self, x):
        return self.b(self.a(x))


def test_a_run_restores_by_parameter_name_into_a_model_that_registers_its_layers_in_another_order(tmp_path):
    torch.manual_seed(0)
    saved = Pair("b")                                 # layout: b.weight, b.bias, a.weight, a.bias
    opt = torch.optim.AdamW(saved.parameters(), lr=0.1)
    for i in range(3):                                # a takes 3 updates, b 1: each has its own step
        opt.zero_grad(set_to_none=True)
        (saved(torch.ones(2, 3)) if i == 0 else saved.a(torch.ones(2, 3))).sum().backward()
        opt.step()
    with manager(tmp_path / "run", saved, opt) as m:
        m.save(3)
    model = Pair("a")
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    with manager(tmp_path / "run", model, fresh) as m:
        assert m.restore() == 3
    got = dict(model.named_parameters())
    for name, p in saved.named_parameters():
        assert torch.equal(got[name], p), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh.state[got[name]][key], opt.state[p][key]), (name, key)
    assert {n: int(fresh.state[p]["step"]) for n, p in got.items()} == \
        {"a.weight": 3, "a.bias": 3, "b.weight": 1, "b.bias": 1}
    other = Pair("a")
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    ct.load(str(tmp_path / "run" / "step_000003.bin"), other, other_opt).close()
    for name, p in other.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(other_opt.state[p][key], fresh.state[got[name]][key]), (name, key)
    assert [e["name"] for e in json.loads((tmp_path / "run" / "step_000003.json").read_text())["layout"]] == \
        ["b.weight", "b.bias", "a.weight", "a.bias"]



def test_the_tensors_that_differ_from_a_file_in_another_order_are_named_by_name(tmp_path):
    torch.manual_seed(0)
    saved = Pair("b")
    opt = torch.optim.AdamW(saved.parameters(), lr=0.1)
    saved(torch.ones(2, 3)).sum().backward()
    opt.step()
    ct.save(str(tmp_path / "step_000001.bin"), saved, opt, step=1)
    model = Pair("a")
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    ct.load(str(tmp_path / "step_000001.bin"), model, fresh).close()
    assert ct.differing_tensors(str(tmp_path / "step_000001.bin"), model, fresh) == []
    with torch.no_grad():
        model.a.bias.add_(1.0)
    assert ct.differing_tensors(str(tmp_path / "step_000001.bin"), model, fresh) == ["weights:a.bias"]


BY_NAME_SCRIPT = r"""
import os, sys, torch, torch.nn as nn, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.fsdp import fully_shard
import ckptfmt, ckptfmt.torch as ct
from ckptfmt.torch.distributed import load_into
class Pair(nn.Module):
    def __init__(self, first):
        super().__init__()
        for name in (first, "b" if first == "a" else "a"):
            setattr(self, name, nn.Linear(3, 3))
torch.manual_seed(0)
saved = Pair("b")                                   # the file lists b's parameters first
opt = torch.optim.AdamW(saved.parameters(), lr=0.1)
for _ in range(3):                                  # a's moments and b's differ: a swap shows
    opt.zero_grad()
    saved.b(saved.a(torch.randn(2, 3))).pow(2).sum().backward()
    opt.step()
ct.save(sys.argv[1], saved, opt, step=3)
model = Pair("a")
fully_shard(model)
fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
load_into(ckptfmt.open(sys.argv[1]), model, fresh)
got = dict(model.named_parameters())
for name, p in saved.named_parameters():
    assert torch.equal(got[name].full_tensor(), p), name
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(fresh.state[got[name]][key].full_tensor(), opt.state[p][key]), (name, key)
    assert int(fresh.state[got[name]]["step"]) == int(opt.state[p]["step"]), name
dist.destroy_process_group()
print("by name")
"""


def test_an_fsdp2_model_loads_each_parameter_and_its_moments_by_name_from_a_file_in_another_order(tmp_path):
    """One rank in its own process (its process group must not outlive the test)."""
    import os
    import subprocess
    import sys
    PY = sys.executable
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    done = subprocess.run([PY, "-c", BY_NAME_SCRIPT, str(tmp_path / "step_000003.bin")], capture_output=True,
                          text=True, timeout=80, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "by name", done.stdout + done.stderr


@pytest.mark.parametrize("region", ["weights", "m", "v"])
@pytest.mark.parametrize("given,words", [
    (lambda a: a.astype(np.float64), "float64"),
    (lambda a: a.tolist(), "list"),
    (lambda a: tuple(a.tolist()), "tuple"),
], ids=["float64", "list", "tuple"])
def test_core_save_refuses_a_region_that_is_not_float32_naming_it(tmp_path, region, given, words):
    regions = dict(zip(("weights", "m", "v"), (np.arange(4, dtype=np.float32) for _ in range(3))))
    regions[region] = given(regions[region])
    path = tmp_path / "a.bin"
    with pytest.raises(E.CheckpointError) as info:
        ckptfmt.save(path, 1, regions["weights"], regions["m"], regions["v"])
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert f"{region} is a" in message and words in message and "float32" in message, message
    assert list(tmp_path.iterdir()) == []
    # the same values as float32 arrays save
    regions[region] = np.asarray(regions[region], dtype=np.float32)
    ckptfmt.save(path, 1, regions["weights"], regions["m"], regions["v"])
    assert ckptfmt.validate(path).ok


# ---------------------------------------------------------------- groups matched by their members
def test_a_resume_whose_loop_lists_the_groups_in_another_order_gets_each_groups_settings(tmp_path):
    model, opt = trained_gpt(tie=False)
    manager(tmp_path / "run", model, opt, handle_signals=False).close(3)
    fresh = gpt(seed=5, tie=False)
    decay, rest = decay_groups(fresh)
    fresh_opt = torch.optim.AdamW([{**rest, "lr": 7.0}, {**decay, "lr": 7.0}], lr=1e-2, betas=(0.9, 0.95))
    with manager(tmp_path / "run", fresh, fresh_opt, handle_signals=False) as m:
        assert m.restore() == 3
    assert [g["weight_decay"] for g in fresh_opt.param_groups] == [0.0, 0.1]   # the live order stays
    assert [g["lr"] for g in fresh_opt.param_groups] == [1e-2, 1e-2]
    live = dict(model.named_parameters())
    for name, q in fresh.named_parameters():
        assert torch.equal(fresh_opt.state[q]["exp_avg"], opt.state[live[name]]["exp_avg"]), name
    train(model, opt, TOKENS, 1)
    train(fresh, fresh_opt, TOKENS, 1)
    for name, q in fresh.named_parameters():
        assert torch.equal(q.detach(), live[name].detach()), name


def test_a_resume_whose_groups_hold_other_parameters_is_refused_naming_one(tmp_path):
    model, opt = trained_gpt(tie=False)
    manager(tmp_path / "run", model, opt, handle_signals=False).close(3)
    fresh = gpt(seed=5, tie=False)
    named = dict(fresh.named_parameters())
    moved = [{"params": [named["wte.weight"], named["fc.weight"]]},        # lm_head.weight moved
             {"params": [named["lm_head.weight"], named["ln.weight"], named["ln.bias"], named["fc.bias"]]}]
    fresh_opt = torch.optim.AdamW(moved, lr=1e-2)
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    with manager(tmp_path / "run", fresh, fresh_opt, handle_signals=False) as m:
        with pytest.raises(E.OptimizerMismatchError, match=r"step_000003.bin: optimizer: the loop's param group 0 "
                                                            r"\(2 parameters\) is none of the checkpoint's groups: it "
                                                            r"lacks lm_head.weight"):
            m.restore()
    for name, p in fresh.named_parameters():
        assert torch.equal(p.detach(), before[name]), name      # refused before a value was copied


@pytest.mark.parametrize("content,words", [
    ("[[\"0.weight\"", "not valid JSON"),
    ('{"groups": []}', "expected a JSON list with one list of parameter names per param group"),
    ("[[1, 2]]", "expected a JSON list with one list of parameter names per param group"),
    (None, "cannot read the --groups file"),
], ids=["not_json", "an_object", "numbers", "missing"])
def test_a_groups_file_that_is_not_a_list_of_name_lists_is_refused_in_one_line(runner, tmp_path, content, words):
    llrd_checkpoint(tmp_path / "llrd.pt")
    if content is not None:
        (tmp_path / "groups.json").write_text(content)
    (tmp_path / "run").mkdir()
    result = cli(runner, "convert", tmp_path / "llrd.pt", tmp_path / "run" / "step_000003.bin",
                 "--groups", tmp_path / "groups.json")
    assert result.exit_code == 2, result.output
    line = one_line(result)
    assert str(tmp_path / "groups.json") in line and words in line, line
    assert step_files(tmp_path / "run") == []


def test_groups_for_anything_but_a_foreign_pt_into_a_bin_is_refused(runner, tmp_path):
    llrd_checkpoint(tmp_path / "llrd.pt")
    (tmp_path / "groups.json").write_text(json.dumps(LLRD_GROUPS))
    result = cli(runner, "convert", tmp_path / "llrd.pt", tmp_path / "x.safetensors", "--groups", tmp_path / "groups.json")
    assert result.exit_code == 2 and "--groups names the param groups of a foreign .pt" in one_line(result)
    assert not (tmp_path / "x.safetensors").exists()


# ---------------------------------------------------------------- names beside wrappers, and what earlier files lack
def llrd_state(wrap_names="", wrap_keys=""):
    """An LLRD checkpoint whose param_names and state-dict keys carry the given prefixes."""
    model = llrd_model()
    groups = llrd_groups(model, names=True)
    for g in groups:
        g["param_names"] = [wrap_names + n for n in g["param_names"]]
    opt = torch.optim.AdamW(groups)
    torch.manual_seed(1)
    train(model, opt, torch.randn(5, 4))
    sd = {wrap_keys + k: v for k, v in model.state_dict().items()}
    return model, opt, {"model": sd, "optimizer": opt.state_dict()}


@pytest.mark.parametrize("wrap_names,wrap_keys", [("module.", ""), ("", "module."), ("module.", "module."),
                                                  ("_orig_mod.", "")])
def test_param_names_and_keys_with_or_without_a_wrappers_prefix_put_moments_on_their_layers(
        runner, tmp_path, wrap_names, wrap_keys):
    model, opt, obj = llrd_state(wrap_names, wrap_keys)
    torch.save(obj, tmp_path / "llrd.pt")
    (tmp_path / "run").mkdir()
    result = cli(runner, "convert", tmp_path / "llrd.pt", tmp_path / "run" / "step_000003.bin")
    assert result.exit_code == 0, result.output
    assert_moments_on_their_layers(tmp_path / "run" / "step_000003.bin", model, opt)
    result = cli(runner, "convert", tmp_path / "run" / "step_000003.bin", tmp_path / "back.pt", "--to", "torch")
    assert result.exit_code == 0, result.output
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert [g["param_names"] for g in back["optimizer"]["param_groups"]] == \
        [g["param_names"] for g in obj["optimizer"]["param_groups"]]


def test_a_groups_file_may_name_the_parameters_with_the_files_own_prefix(runner, tmp_path):
    model, opt, obj = llrd_state("", "module.")
    for g in obj["optimizer"]["param_groups"]:
        del g["param_names"]
    torch.save(obj, tmp_path / "llrd.pt")
    (tmp_path / "groups.json").write_text(json.dumps([["module." + n for n in g] for g in LLRD_GROUPS]))
    (tmp_path / "run").mkdir()
    result = cli(runner, "convert", tmp_path / "llrd.pt", tmp_path / "run" / "step_000003.bin",
                 "--groups", tmp_path / "groups.json")
    assert result.exit_code == 0, result.output
    assert_moments_on_their_layers(tmp_path / "run" / "step_000003.bin", model, opt)


def test_param_names_that_name_no_key_are_not_used_but_come_back_on_the_way_back(runner, tmp_path):
    model = two_layer()
    opt = torch.optim.AdamW([{"params": list(model.parameters()), "param_names": ["w", "b", "w2", "b2"]}])
    train(model, opt, inputs(3))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "x.pt")
    (tmp_path / "run").mkdir()
    result = cli(runner, "convert", tmp_path / "x.pt", tmp_path / "run" / "step_000003.bin")
    assert result.exit_code == 0, result.output                # one group: the state dict's order
    with ckptfmt.open(tmp_path / "run" / "step_000003.bin") as ck:
        assert torch.equal(as_torch(ck.tensor("1.weight", region="m")), opt.state[model[1].weight]["exp_avg"])
    result = cli(runner, "convert", tmp_path / "run" / "step_000003.bin", tmp_path / "back.pt", "--to", "torch")
    assert result.exit_code == 0, result.output
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back["optimizer"]["param_groups"][0]["param_names"] == ["w", "b", "w2", "b2"]


def test_a_multi_group_import_leaves_released_readers_no_index_lists_to_misread(runner, tmp_path):
    """Released readers took ``imported.param_groups`` as index lists in layout order; a file whose
    groups are in another order writes them only as ``imported.indices``."""
    llrd_checkpoint(tmp_path / "llrd.pt", names=True)
    (tmp_path / "run").mkdir()
    assert cli(runner, "convert", tmp_path / "llrd.pt", tmp_path / "run" / "step_000003.bin").exit_code == 0
    doc = json.loads((tmp_path / "run" / "step_000003.json").read_text())
    assert doc["imported"]["param_groups"] is None
    assert doc["imported"]["indices"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert doc["optimizer"]["members"] == LLRD_GROUPS


def test_a_non_finite_group_setting_is_refused_by_name(tmp_path):
    model, opt = tiny_adamw()
    opt.param_groups[0]["max_norm"] = float("inf")
    with pytest.raises(E.CheckpointError, match=r"param group 0: setting 'max_norm' is inf: a manifest holds "
                                                r"finite numbers only"):
        manager(tmp_path / "run", model, opt, handle_signals=False)


def test_torch_save_refuses_an_optimizer_tensor_outside_the_model(tmp_path):
    model = tiny_linear()
    stray = nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([*model.parameters(), stray])
    with pytest.raises(E.UnsupportedSetupError, match="the optimizer holds 1 tensor"):
        ct.save(str(tmp_path / "step_000000.bin"), model, opt, step=0)
    assert step_files(tmp_path) == []


def test_a_resume_that_unfreezes_a_parameter_into_its_group_takes_the_groups_settings(tmp_path):
    model = two_layer()
    model[0].weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.2)
    train(model, opt, inputs(3))
    manager(tmp_path / "run", model, opt, handle_signals=False).close(3)
    fresh = two_layer(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)         # 0.weight trains from here on
    with manager(tmp_path / "run", fresh, fresh_opt, handle_signals=False) as m:
        assert m.restore() == 3
    assert (fresh_opt.param_groups[0]["lr"], fresh_opt.param_groups[0]["weight_decay"]) == (3e-3, 0.2)
    assert fresh[0].weight not in fresh_opt.state or not fresh_opt.state[fresh[0].weight]
    assert torch.equal(fresh_opt.state[fresh[1].weight]["exp_avg"], opt.state[model[1].weight]["exp_avg"])


def test_a_setting_an_earlier_writer_left_out_keeps_the_live_groups_value(tmp_path):
    model = tiny_linear()
    opt = torch.optim.AdamW(model.parameters(), lr=np.float32(1e-3))
    train(model, opt, inputs(3))
    manager(tmp_path / "run", model, opt, handle_signals=False).close(3)
    path = tmp_path / "run" / "step_000003.json"
    doc = json.loads(path.read_text())                  # as the release before this one wrote it:
    del doc["optimizer"]["hyperparams"][0]["lr"], doc["optimizer"]["setting_types"], doc["seal"]   # no seal either
    path.write_text(json.dumps(doc))
    without_root_digests(tmp_path / "run")              # nor root digests in its history
    fresh = tiny_linear(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=5e-2)
    with manager(tmp_path / "run", fresh, fresh_opt, handle_signals=False) as m:
        m.restore()
    assert fresh_opt.param_groups[0]["lr"] == 5e-2
    train(fresh, fresh_opt, inputs(3), 1)       # no KeyError: 'lr'


def test_a_manager_run_of_named_groups_exports_their_param_names(runner, tmp_path):
    model = llrd_model()
    opt = torch.optim.AdamW(llrd_groups(model, names=True))
    train(model, opt, torch.randn(5, 4))
    manager(tmp_path / "run", model, opt, handle_signals=False).close(3)
    result = cli(runner, "convert", tmp_path / "run" / "step_000003.bin", tmp_path / "out.pt", "--to", "torch")
    assert result.exit_code == 0, result.output
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert [g["param_names"] for g in back["optimizer"]["param_groups"]] == LLRD_GROUPS
    (tmp_path / "again").mkdir()
    result = cli(runner, "convert", tmp_path / "out.pt", tmp_path / "again" / "step_000003.bin")
    assert result.exit_code == 0, result.output          # its names say which group is which
    assert_moments_on_their_layers(tmp_path / "again" / "step_000003.bin", model, opt)
