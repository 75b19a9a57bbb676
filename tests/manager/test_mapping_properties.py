"""Property tests of one faithful mapping between a PyTorch training state and a generation:
every tensor lands on the same *named* parameter and every param-group setting survives, on
each way in and out of the format.

* A ``CheckpointManager`` generation restored into a model and optimizer built the same way,
  the param groups listed in another order (groups are matched by their members' names), then
  one more training step beside the original gives the same parameters.
* ``ckptfmt.torch.save`` / ``load``: one optimizer step for every parameter (bf16/fp16
  parameters widened exactly, as the manager does), so a model whose parameters disagree on the
  step is refused by design.
* A foreign ``torch.save`` checkpoint converted into a ``.bin`` (its groups named by torch's
  ``param_names``, by ``groups=``, or a single unnamed group) and back to torch.
* A manager generation exported to a torch ``.pt`` and to safetensors weights.
* A group setting restored (manager, ``ct.load``) in the type it was saved in, whatever type
  the resuming loop built it in.

Hypothesis draws small models (Linear, Embedding, LayerNorm, BatchNorm1d with sizes of 2 and 3,
so shapes often agree and a position-based mapping would put state on the wrong parameter),
tied weights (an Embedding's weight given to a Linear), frozen parameters (left out of the
optimizer, or put in it where they never get state), bf16/fp16 modules, a branch that joins one
step late (parameters that took different numbers of steps), param groups from random
partitions in shuffled order or layer-wise LR decay (one group per layer, top layer first),
Adam, AdamW and SGD (no momentum, momentum, Nesterov), NumPy-scalar learning rates and a custom
``lr_scale`` key, trained 1-3 steps on seeded random data. Where the library refuses a case by
design, the test checks that it is a ``CheckpointError`` with a one-line message.

The default budget (25 examples per test, ``CKPTFMT_PROPERTY_EXAMPLES``) keeps the file within
CI's time; more run by hand:

    CKPTFMT_PROPERTY_EXAMPLES=500 .venv/bin/python -m pytest -q -n 2 tests/manager/test_mapping_properties.py
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import nn

import ckptfmt
import ckptfmt.torch as ct
from ckptfmt.errors import CheckpointError
from ckptfmt.tools.convert import convert
from ckptfmt.torch import CheckpointManager

PROPERTY = settings(max_examples=int(os.environ.get("CKPTFMT_PROPERTY_EXAMPLES", "25")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BATCH = 4
LATER = 99          # a step index every layer takes part in (the step after the restore)
NOT_SETTINGS = ("params", "param_names")


@pytest.fixture(autouse=True)
def one_thread():
    """Tensors of a few elements: torch's intra-op threads cost ten times what they give here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- what hypothesis draws
@dataclass(frozen=True)
class Layer:
    kind: str                   # linear, embedding, layernorm, batchnorm, or tied: a Linear whose
    sizes: tuple[int, ...]      # weight is the Embedding's at index sizes[0]
    bias: bool
    dtype: str
    joins: int                  # the first training step that uses the layer


@dataclass(frozen=True)
class Setup:
    layers: tuple[Layer, ...]
    frozen: tuple[str, ...]                 # per parameter name: "no", "outside" the optimizer, "inside" it
    groups: tuple[tuple[str, ...], ...]     # the optimizer's param groups by member names, in its order
    resume: tuple[tuple[str, ...], ...]     # the same groups as the resuming loop lists them
    optimizer: str                          # Adam, AdamW, SGD, SGD-momentum, SGD-nesterov
    lrs: tuple[float, ...]                  # per group (of ``groups``)
    numpy_lr: tuple[str | None, ...]        # per group: the lr as this NumPy type, or a float
    resume_numpy_lr: tuple[str | None, ...]  # what the resuming loop builds its lr as
    weight_decay: tuple[float, ...]
    lr_scale: str | None                    # a custom group key: absent, a float or a np.float32
    param_names: bool                       # the groups carry torch's ``param_names``
    steps: int
    seed: int

    @property
    def names(self) -> list[str]:
        return parameter_names(self.layers)

    @property
    def numpy_settings(self) -> bool:
        return any(self.numpy_lr) or self.lr_scale == "float32"


def parameter_names(layers: tuple[Layer, ...]) -> list[str]:
    """The model's ``named_parameters()`` names (a tied weight under its first name only)."""
    out = []
    for i, layer in enumerate(layers):
        if layer.kind != "tied":
            out.append(f"layers.{i}.weight")
        if layer.bias:
            out.append(f"layers.{i}.bias")
    return out


SIZE = st.integers(2, 3)
JOINS = st.sampled_from([0, 0, 0, 1])
NUMPY = st.sampled_from([None, None, "float32", "float64"])


@st.composite
def layer_lists(draw, float32: int = 3) -> tuple[Layer, ...]:
    """1-4 layers (and maybe a Linear tied to an Embedding); ``float32``: how many times more
    often a layer is float32 than bfloat16 or float16."""
    dtype = st.sampled_from(["float32"] * float32 + ["bfloat16", "float16"])
    layers = []
    kinds = st.sampled_from(["linear", "embedding", "layernorm", "batchnorm"])
    for kind in [draw(kinds) for _ in range(draw(st.sampled_from([1, 2, 2, 3, 3, 4])))]:
        if kind in ("linear", "embedding"):
            sizes = (draw(SIZE), draw(SIZE))
        else:
            sizes = (draw(SIZE),)
        bias = {"linear": None, "layernorm": None, "embedding": False, "batchnorm": True}[kind]
        layers.append(Layer(kind, sizes, draw(st.booleans()) if bias is None else bias, draw(dtype), draw(JOINS)))
    embeddings = [i for i, layer in enumerate(layers) if layer.kind == "embedding"]
    if embeddings and draw(st.booleans()):
        target = draw(st.sampled_from(embeddings))
        at = draw(st.integers(target + 1, len(layers)))
        layers.insert(at, Layer("tied", (target,), draw(st.booleans()), layers[target].dtype, draw(JOINS)))
    return tuple(layers)


@st.composite
def setups(draw, numpy: int = 1, float32: int = 3, trainable: int = 8, other_types: bool = False) -> Setup:
    """A model, how its parameters are frozen and grouped, the optimizer and its settings.
    The weights say how many times more often than the alternatives a setting is plain (not
    NumPy), a layer float32, a parameter trainable; ``other_types``: the resuming loop builds
    its learning rates in types of its own (else in the saved ones)."""
    layers = draw(layer_lists(float32))
    names = parameter_names(layers)
    frozen = [draw(st.sampled_from(["no"] * trainable + ["outside", "inside"])) for _ in names]
    if all(f == "outside" for f in frozen):
        frozen[0] = "no"
    members = [n for n, f in zip(names, frozen) if f != "outside"]
    mode = draw(st.sampled_from(["partition", "one", "llrd", "partition"]))
    if mode == "one":
        groups = [tuple(draw(st.permutations(members))) if draw(st.booleans()) else tuple(members)]
    elif mode == "partition":
        count = draw(st.integers(min(2, len(members)), min(4, len(members))))
        order = draw(st.permutations(members))
        label = {n: i if i < count else draw(st.integers(0, count - 1)) for i, n in enumerate(order)}
        order = draw(st.permutations(order))
        groups = [tuple(n for n in order if label[n] == j) for j in range(count)]
    else:                       # layer-wise LR decay: one group per layer, top layer first
        groups = [g for g in (tuple(n for n in members if n.startswith(f"layers.{i}."))
                              for i in reversed(range(len(layers)))) if g]
    if mode == "llrd":
        base = draw(st.sampled_from([1e-2, 3e-3]))
        lrs = tuple(base * 0.5 ** depth for depth in range(len(groups)))
    else:
        lrs = tuple(draw(st.sampled_from([1e-3, 1e-2, 0.05])) for _ in groups)
    order = draw(st.sampled_from(["reversed", "shuffled", "same"]))     # the resuming loop's group order
    listed = groups[::-1] if order == "reversed" else draw(st.permutations(groups)) if order == "shuffled" else groups
    resume = tuple(tuple(draw(st.permutations(g))) for g in listed)
    numpy_lr = st.sampled_from([None] * numpy * 2 + ["float32", "float64"])
    saved_types = tuple(draw(numpy_lr) for _ in groups)
    return Setup(
        layers=layers, frozen=tuple(frozen), groups=tuple(groups), resume=resume,
        optimizer=draw(st.sampled_from(["Adam", "AdamW", "SGD", "SGD-momentum", "SGD-nesterov"])),
        lrs=lrs, numpy_lr=saved_types,
        resume_numpy_lr=tuple(draw(NUMPY) for _ in groups) if other_types else saved_types,
        weight_decay=tuple(draw(st.sampled_from([0.0, 0.01, 0.1])) for _ in groups),
        lr_scale=draw(st.sampled_from([None] * numpy + ["float"] * numpy + ["float32"])),
        param_names=draw(st.booleans()), steps=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2 ** 16)))


# ---------------------------------------------------------------- building and training
class Net(nn.Module):
    def __init__(self, layers: tuple[Layer, ...]):
        super().__init__()
        self.joins = [layer.joins for layer in layers]
        self.layers = nn.ModuleList(_module(layer, layers) for layer in layers)
        for i, layer in enumerate(layers):
            if layer.kind == "tied":
                self.layers[i].weight = self.layers[layer.sizes[0]].weight
        for i, layer in enumerate(layers):
            if layer.dtype != "float32":
                self.layers[i].to(DTYPES[layer.dtype])

    def forward(self, inputs: list[torch.Tensor], step: int) -> torch.Tensor:
        loss = torch.zeros(())
        for layer, joins, x in zip(self.layers, self.joins, inputs):
            if step >= joins:
                loss = loss + layer(x).float().pow(2).mean()
        return loss


def _module(layer: Layer, layers: tuple[Layer, ...]) -> nn.Module:
    if layer.kind == "linear":
        return nn.Linear(*layer.sizes, bias=layer.bias)
    if layer.kind == "embedding":
        return nn.Embedding(*layer.sizes)
    if layer.kind == "layernorm":
        return nn.LayerNorm(layer.sizes[0], bias=layer.bias)
    if layer.kind == "batchnorm":
        return nn.BatchNorm1d(layer.sizes[0])
    rows, width = layers[layer.sizes[0]].sizes          # tied: the Embedding's (num, dim)
    return nn.Linear(width, rows, bias=layer.bias)


def inputs(setup: Setup) -> list[list[torch.Tensor]]:
    """One batch per training step and one for the step after the restore, from ``seed``."""
    gen = torch.Generator().manual_seed(setup.seed)
    batches = []
    for _ in range(setup.steps + 1):
        batch = []
        for layer in setup.layers:
            if layer.kind == "embedding":
                batch.append(torch.randint(0, layer.sizes[0], (BATCH,), generator=gen))
                continue
            width = setup.layers[layer.sizes[0]].sizes[1] if layer.kind == "tied" else layer.sizes[0]
            batch.append(torch.randn(BATCH, width, generator=gen).to(DTYPES[layer.dtype]))
        batches.append(batch)
    return batches


def build(setup: Setup, seed: int, groups: tuple[tuple[str, ...], ...], fresh: bool = False,
          param_names: bool | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer as the loop builds them; ``fresh``: another initialisation and
    other group settings (in the resuming loop's types), as a resume starts from."""
    torch.manual_seed(seed)
    model = Net(setup.layers)
    params = dict(model.named_parameters())
    assert list(params) == setup.names
    for name, how in zip(setup.names, setup.frozen):
        if how != "no":
            params[name].requires_grad_(False)
    rows = []
    for members in groups:
        g = next(j for j, saved in enumerate(setup.groups) if set(saved) == set(members))
        kind = (setup.resume_numpy_lr if fresh else setup.numpy_lr)[g]
        lr = setup.lrs[g] * (3 if fresh else 1)
        row: dict[str, Any] = {"params": [params[n] for n in members],
                               "lr": np.dtype(kind).type(lr) if kind else lr,
                               "weight_decay": setup.weight_decay[g] + (0.5 if fresh else 0.0)}
        if setup.lr_scale is not None:
            row["lr_scale"] = 2.0 if fresh else np.float32(0.5) if setup.lr_scale == "float32" else 0.5
        if setup.param_names if param_names is None else param_names:
            row["param_names"] = list(members)
        rows.append(row)
    if setup.optimizer in ("Adam", "AdamW"):          # eps 1e-8 is 0 in float16: 0/0 on a zero gradient
        return model, getattr(torch.optim, setup.optimizer)(rows, eps=1e-4)
    return model, torch.optim.SGD(rows, momentum=0.0 if setup.optimizer == "SGD" else 0.9,
                                  nesterov=setup.optimizer == "SGD-nesterov")


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        loss = model(batches[min(step, len(batches) - 1)], step)
        if loss.requires_grad:          # every layer of this step frozen: nothing to step
            loss.backward()
        opt.step()


def trained(setup: Setup, **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer, list]:
    model, opt = build(setup, 0, setup.groups, **kw)
    batches = inputs(setup)
    train(model, opt, batches, range(setup.steps))
    assume(all(torch.isfinite(t.float()).all() for t in model.state_dict().values()))  # NaN payloads are not the point
    return model, opt, batches


def step_after(pairs: list[tuple[nn.Module, torch.optim.Optimizer]], batches: list) -> None:
    for model, opt in pairs:
        train(model, opt, batches, range(LATER, LATER + 1))


def manager(run: str, model: nn.Module, opt: torch.optim.Optimizer) -> CheckpointManager:
    return CheckpointManager(run, model, opt, every=None, keep_last=None, handle_signals=False)


# ---------------------------------------------------------------- what must hold
def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(got: Any, want: Any, what: Any) -> None:
    assert isinstance(got, torch.Tensor), (what, got)
    assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), (what, got.dtype, want.dtype)
    assert torch.equal(bits(got), bits(want)), (what, got, want)


def assert_same_model(got: nn.Module, want: nn.Module) -> None:
    """Every state-dict entry (parameters, tied names, buffers) bit for bit, by name."""
    a, b = got.state_dict(), want.state_dict()
    assert list(a) == list(b)
    for name in b:
        assert_same_tensor(a[name], b[name], name)


def state_by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """Each parameter's optimizer state, by its name; parameters without state left out."""
    return {name: dict(opt.state[p]) for name, p in model.named_parameters() if opt.state.get(p)}


def assert_same_state(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> None:
    assert sorted(got) == sorted(want), "parameters with optimizer state differ"
    for name, state in want.items():
        assert sorted(got[name]) == sorted(state), name
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert_same_tensor(got[name][key], value, (name, key))
            else:
                assert got[name][key] == value, (name, key)


def settings_by_members(model: nn.Module, opt: torch.optim.Optimizer) -> dict[frozenset, dict[str, Any]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {frozenset(names[id(p)] for p in g["params"]): {k: v for k, v in g.items() if k not in NOT_SETTINGS}
            for g in opt.param_groups}


def assert_same_settings(got: dict[frozenset, dict], want: dict[frozenset, dict], numpy_as_float: bool = False) -> None:
    """Each group's settings equal, in the types they had (NumPy scalars as Python numbers
    where a ``torch.save`` file holds them)."""
    assert set(got) == set(want)
    for members, saved in want.items():
        live = got[members]
        assert sorted(live) == sorted(saved), sorted(members)
        for key, value in saved.items():
            if numpy_as_float and isinstance(value, np.generic):
                value = value.item()
            assert type(live[key]) is type(value), (sorted(members), key, live[key], value)
            assert live[key] == value, (sorted(members), key, live[key], value)


def assert_refused(info: pytest.ExceptionInfo) -> None:
    assert isinstance(info.value, CheckpointError), info.value
    assert str(info.value) and "\n" not in str(info.value), str(info.value)


def fits_torch_save(setup: Setup, model: nn.Module, opt: torch.optim.Optimizer) -> bool:
    """True where ``ct.save`` holds the model: one step for all: SGD keeps no step count;
    Adam's parameters all took the same number of steps (a parameter without state took none)."""
    if setup.optimizer.startswith("SGD"):
        return True
    return len({int(opt.state[p]["step"]) if opt.state.get(p) else 0 for p in model.parameters()}) == 1


def as_torch(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array))


# ---------------------------------------------------------------- (a) the manager
@PROPERTY
@given(setup=setups(), save_first=st.booleans(), warm=st.booleans())
def test_a_manager_generation_restores_each_tensor_and_group_setting_onto_its_named_parameter(setup, save_first, warm):
    model, opt, batches = trained(setup)
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "run")
        mgr = manager(run, model, opt)
        if save_first:
            mgr.save(setup.steps)
            mgr.close()
        else:
            mgr.close(setup.steps)
        fresh, fresh_opt = build(setup, 1, setup.resume, fresh=True)
        if warm:                # a loop that took a step before restoring: all its state is replaced
            train(fresh, fresh_opt, batches, range(LATER, LATER + 1))
        mgr = manager(run, fresh, fresh_opt)
        try:
            assert mgr.restore() == setup.steps
        finally:
            mgr.close()
    assert_same_model(fresh, model)
    assert_same_state(state_by_name(fresh, fresh_opt), state_by_name(model, opt))
    assert_same_settings(settings_by_members(fresh, fresh_opt), settings_by_members(model, opt))
    step_after([(model, opt), (fresh, fresh_opt)], batches)
    assert_same_model(fresh, model)
    assert_same_state(state_by_name(fresh, fresh_opt), state_by_name(model, opt))


# ---------------------------------------------------------------- (b) ct.save / ct.load
@PROPERTY
@given(setup=setups(float32=12, trainable=20))
def test_torch_save_and_load_put_each_tensor_and_group_setting_back_on_its_named_parameter(setup):
    model, opt, batches = trained(setup)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"step_{setup.steps:06d}.bin")
        if not fits_torch_save(setup, model, opt):
            with pytest.raises(CheckpointError) as info:
                ct.save(path, model, opt, step=setup.steps)
            assert_refused(info)
            assert os.listdir(tmp) == []
            return
        ct.save(path, model, opt, step=setup.steps)
        fresh, fresh_opt = build(setup, 1, setup.resume, fresh=True)
        ct.load(path, fresh, fresh_opt).close()
        with ckptfmt.open(path) as ck:
            assert ck.step == setup.steps
    assert_same_model_parameters(fresh, model)
    assert_same_state(state_by_name(fresh, fresh_opt), state_by_name(model, opt))
    assert_same_settings(settings_by_members(fresh, fresh_opt), settings_by_members(model, opt))
    step_after([(model, opt), (fresh, fresh_opt)], batches)
    assert_same_model_parameters(fresh, model)


def assert_same_model_parameters(got: nn.Module, want: nn.Module) -> None:
    """Every parameter bit for bit, by name (``ct.save`` holds no buffers)."""
    a = dict(got.named_parameters())
    assert list(a) == [n for n, _ in want.named_parameters()]
    for name, p in want.named_parameters():
        assert_same_tensor(a[name], p, name)


# ---------------------------------------------------------------- (c) a foreign torch.save file
@PROPERTY
@given(setup=setups(numpy=8), naming=st.sampled_from(["param_names", "groups", "none"]))
def test_a_foreign_torch_checkpoint_converts_onto_named_parameters_and_goes_back_whole(setup, naming):
    if naming == "none" and len(setup.groups) == 1:        # one unnamed group: in state-dict order
        setup = dataclasses.replace(setup, groups=(tuple(n for n in setup.names if n in setup.groups[0]),))
    model, opt, _ = trained(setup, param_names=naming == "param_names")
    original = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}
    refused = setup.numpy_settings or (naming == "none" and (len(setup.groups) > 1 or "outside" in setup.frozen))
    adam = not setup.optimizer.startswith("SGD")
    step = max((int(s["step"]) for s in opt.state.values() if "step" in s), default=0) if adam else setup.steps
    with tempfile.TemporaryDirectory() as tmp:
        src, run = os.path.join(tmp, "x.pt"), os.path.join(tmp, "run")
        os.mkdir(run)
        binary = os.path.join(run, f"step_{step:06d}.bin")
        torch.save(original, src)
        groups = [list(g) for g in setup.groups] if naming == "groups" else None
        if refused:
            with pytest.raises(CheckpointError) as info:
                convert(src, binary, groups=groups)
            assert_refused(info)
            assert os.listdir(run) == []
            return
        convert(src, binary, groups=groups)
        params = dict(model.named_parameters())
        first, second = ("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer", None)
        with ckptfmt.open(binary) as ck:
            assert ck.step == step
            for group in setup.groups:
                for name in group:
                    p = params[name]
                    state = opt.state.get(p) or {}
                    zeros = torch.zeros_like(p, dtype=torch.float32)
                    m = state.get(first)
                    v = state.get(second) if second else None
                    assert_same_tensor(as_torch(ck.tensor(name)), p.detach().float(), ("weights", name))
                    assert_same_tensor(as_torch(ck.tensor(name, region="m")),
                                       m.float() if m is not None else zeros, ("m", name))
                    assert_same_tensor(as_torch(ck.tensor(name, region="v")),
                                       v.float() if v is not None else zeros, ("v", name))
        back_path = os.path.join(tmp, "back.pt")
        convert(binary, back_path, to="torch")
        back = torch.load(back_path, weights_only=True)
    assert back["epoch"] == 3
    assert_same_optimizer_state_dict(back["optimizer"], original["optimizer"])
    fresh, fresh_opt = build(setup, 1, setup.groups, fresh=True, param_names=naming == "param_names")
    fresh.load_state_dict(back["model"], strict=True)
    fresh_opt.load_state_dict(back["optimizer"])
    assert_same_model(fresh, model)
    assert_same_state(state_by_name(fresh, fresh_opt), state_by_name(model, opt))
    assert_same_settings(settings_by_members(fresh, fresh_opt), settings_by_members(model, opt))


def assert_same_optimizer_state_dict(got: dict, want: dict) -> None:
    """Two optimizer state dicts: the same indices, tensors bit for bit, the same groups."""
    assert sorted(got["state"]) == sorted(want["state"])
    for i, state in want["state"].items():
        assert sorted(got["state"][i]) == sorted(state), i
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert_same_tensor(got["state"][i][key], value, (i, key))
            else:
                assert got["state"][i][key] == value, (i, key)
    assert len(got["param_groups"]) == len(want["param_groups"])
    for g, (a, b) in enumerate(zip(got["param_groups"], want["param_groups"])):
        assert sorted(a) == sorted(b), g
        for key, value in b.items():
            assert type(a[key]) is type(value) and a[key] == value, (g, key, a[key], value)


# ---------------------------------------------------------------- (d) a manager generation exported
@PROPERTY
@given(setup=setups())
def test_a_manager_generation_exports_to_torch_and_weights_under_every_state_dict_name(setup):
    model, opt, _ = trained(setup)
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "run")
        manager(run, model, opt).close(setup.steps)
        binary = os.path.join(run, f"step_{setup.steps:06d}.bin")
        convert(binary, os.path.join(tmp, "out.pt"), to="torch")
        convert(binary, os.path.join(tmp, "w.safetensors"), to="weights")
        out = torch.load(os.path.join(tmp, "out.pt"), weights_only=True)
        weights = load_file(os.path.join(tmp, "w.safetensors"))
    want = model.state_dict()
    assert set(want) <= set(out["model"])
    assert set(want) <= set(weights)
    for name, t in want.items():
        assert_same_tensor(weights[name], t, ("safetensors", name))
    fresh, fresh_opt = build(setup, 1, setup.groups, fresh=True)
    fresh.load_state_dict(out["model"], strict=True)
    fresh_opt.load_state_dict(out["optimizer"])
    assert_same_model(fresh, model)
    assert_same_state(state_by_name(fresh, fresh_opt), state_by_name(model, opt))
    assert_same_settings(settings_by_members(fresh, fresh_opt), settings_by_members(model, opt), numpy_as_float=True)


# ---------------------------------------------------------------- a setting's type, whatever the loop built
@PROPERTY
@given(setup=setups(float32=1000, trainable=1000, other_types=True), way=st.sampled_from(["manager", "torch.save"]))
def test_a_restored_group_setting_comes_back_in_the_type_it_was_saved_in_whatever_the_loop_built(setup, way):
    """A loop that builds ``lr=np.float32(...)`` (or a float) resumes with the value and type
    the checkpoint holds: a float saved comes back a float, not rounded to the loop's float32."""
    model, opt, _ = trained(setup)
    assume(way == "manager" or fits_torch_save(setup, model, opt))
    fresh, fresh_opt = build(setup, 1, setup.groups, fresh=True)     # the groups in the saved order
    with tempfile.TemporaryDirectory() as tmp:
        if way == "manager":
            run = os.path.join(tmp, "run")
            manager(run, model, opt).close(setup.steps)
            mgr = manager(run, fresh, fresh_opt)
            try:
                assert mgr.restore() == setup.steps
            finally:
                mgr.close()
        else:
            path = os.path.join(tmp, f"step_{setup.steps:06d}.bin")
            ct.save(path, model, opt, step=setup.steps)
            ct.load(path, fresh, fresh_opt).close()
    assert_same_settings(settings_by_members(fresh, fresh_opt), settings_by_members(model, opt))
