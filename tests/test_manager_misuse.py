"""CheckpointManager against what users commonly get wrong: each is one line, a
``CheckpointError``, before anything is written or copied."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ckptfmt.errors import (ConfigMismatchError, LayoutMismatchError, OptimizerMismatchError,  # noqa: E402
                            RunLockedError, StateRefusedError)
from ckptfmt.torch import CheckpointManager  # noqa: E402
from models import tiny_adamw, train_steps  # noqa: E402


def mgr(path, model, opt, **kw):
    return CheckpointManager(path, model, opt, handle_signals=False, **kw)


def setup(sched=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 3)):
    model, opt = tiny_adamw(lr=0.1)
    return model, opt, sched(opt)


def train(model, opt, sched, m, first, last):
    for step in range(first, last + 1):
        loss = train_steps(model, opt, 1)
        sched.step()
        m.step(step, loss=loss.item())


def saved_run(path, steps=5, every=5):
    model, opt, sched = setup()
    with mgr(path, model, opt, scheduler=sched, every=every) as m:
        m.restore()
        train(model, opt, sched, m, 1, steps)
        m.close(steps)


@pytest.mark.parametrize("other", [
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),    # failed half-way (KeyError)
    lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)])    # took StepLR's fields silently
def test_a_scheduler_of_another_class_is_refused_before_anything_is_copied(tmp_path, other):
    saved_run(tmp_path / "r")
    model, opt, sched = setup(other)
    name = type(sched).__name__
    params, state = [p.detach().clone() for p in model.parameters()], dict(sched.state_dict())
    with mgr(tmp_path / "r", model, opt, scheduler=sched) as m:
        with pytest.raises(ConfigMismatchError, match=f"step_000005.bin: scheduler: the checkpoint holds "
                                                      f"StepLR state, the loop uses {name} "):
            m.restore()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert not opt.state and sched.state_dict().keys() == state.keys()
    assert sched.last_epoch == state["last_epoch"] == 0


def test_strict_false_starts_a_scheduler_of_another_class_fresh(tmp_path):
    saved_run(tmp_path / "r")
    model, opt, sched = setup(lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10))
    with mgr(tmp_path / "r", model, opt, scheduler=sched) as m:
        with pytest.warns(UserWarning, match="CosineAnnealingLR; it starts fresh"):
            assert m.restore(strict=False) == 5
        assert m.fresh == ["scheduler (StepLR in the checkpoint, CosineAnnealingLR in the loop)"]
    assert opt.state and sched.last_epoch == 0 and not hasattr(sched, "step_size")


def test_the_same_scheduler_class_resumes(tmp_path):
    saved_run(tmp_path / "r")
    model, opt, sched = setup()
    with mgr(tmp_path / "r", model, opt, scheduler=sched) as m:
        assert m.restore() == 5 and m.fresh == []
    assert sched.last_epoch == 5


@pytest.mark.parametrize("name", ["step_000005.json", "step_000005.bin"])
def test_restore_from_a_single_file_generation_by_its_manifest_or_its_bin(tmp_path, name):
    """``restore(source="step_N.json")`` of a one-file generation took the manifest for a sharded
    generation's ("not a sharded generation (no 'shards' list)"): it names the .bin beside it."""
    saved_run(tmp_path / "r")
    model, opt, sched = setup()
    with mgr(tmp_path / "r", model, opt, scheduler=sched) as m:
        assert m.restore(str(tmp_path / "r" / name)) == 5
    assert sched.last_epoch == 5


def test_a_loop_that_restarts_at_1_after_restore_is_refused_before_the_history_changes(tmp_path):
    saved_run(tmp_path / "r", steps=10)
    model, opt, sched = setup()
    with mgr(tmp_path / "r", model, opt, scheduler=sched, every=5) as m:
        assert m.restore() == 10
        history = (tmp_path / "r" / ".loss.json").read_bytes()
        with pytest.raises(ConfigMismatchError, match="step 1 is not after step 10, where this run resumed"):
            m.step(1, loss=0.5)
        assert (tmp_path / "r" / ".loss.json").read_bytes() == history
        m.step(11, loss=0.5)                                     # going on from the return is fine
        with pytest.raises(ConfigMismatchError, match="step 11 is not after step 11, the last one given"):
            m.step(11, loss=0.5)
    assert sorted(p.name for p in (tmp_path / "r").glob("step_*.bin")) == ["step_000005.bin", "step_000010.bin"]


def test_a_loop_that_never_called_restore_on_a_run_with_generations_is_refused(tmp_path):
    saved_run(tmp_path / "r", steps=10)
    history = (tmp_path / "r" / ".loss.json").read_bytes()
    model, opt, sched = setup()
    with mgr(tmp_path / "r", model, opt, scheduler=sched, every=5) as m:
        with pytest.raises(ConfigMismatchError, match="step 1: the run has generations up to step 10; "
                                                      "call restore"):
            m.step(1, loss=0.5)
        m.step(12, loss=0.5)                     # past the run's generations: the loop's choice
    assert (tmp_path / "r" / ".loss.json").read_bytes().startswith(history)


def test_a_fresh_run_may_count_from_0(tmp_path):
    model, opt, sched = setup()
    with mgr(tmp_path / "r", model, opt, scheduler=sched, every=2) as m:
        assert m.restore() == 0
        train(model, opt, sched, m, 0, 4)
        m.close(4)
    assert sorted(p.name for p in (tmp_path / "r").glob("step_*.bin"))[-1] == "step_000004.bin"


def test_a_second_manager_in_the_same_process_says_so(tmp_path):
    model, opt, sched = setup()
    first = mgr(tmp_path / "r", model, opt)
    with pytest.raises(RunLockedError, match=r"checkpoint manager pid \d+ on .* \(this process: close\(\) "):
        mgr(tmp_path / "r", model, opt)
    first.close()
    mgr(tmp_path / "r", model, opt).close()


def test_a_model_with_other_parameter_names_is_refused_naming_the_first_difference(tmp_path):
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with mgr(tmp_path / "r", saved, torch.optim.AdamW(saved.parameters())) as m:
        m.save(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))     # the ReLU left out
    with mgr(tmp_path / "r", model, torch.optim.AdamW(model.parameters())) as m:
        with pytest.raises(LayoutMismatchError, match=r"step_000001.bin: parameter names/order differ from the "
                                                      r"model's \(4 parameters in the checkpoint, 4 in the model; "
                                                      r"at #2 the checkpoint has '2.weight', the model '1.weight'\)$"):
            m.restore()


def test_ct_save_of_a_frozen_parameter_in_the_optimizer_names_it(tmp_path):
    import ckptfmt.torch as ct
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)                    # frozen, but given to the optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(OptimizerMismatchError, match=r"^parameters disagree on the optimizer step \(no state "
                                                     r"\(frozen or not updated yet\): 0.weight; step 1: 0.bias, "
                                                     r"1.weight, 1.bias\): .* CheckpointManager keeps"):
        ct.save(str(tmp_path / "step_000001.bin"), model, opt, step=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("saved,now", [(False, True), (True, False)])
def test_a_grad_scaler_enabled_where_the_saved_one_was_not_is_refused_before_anything_is_copied(tmp_path, saved, now):
    model, opt, sched = setup()
    with mgr(tmp_path / "r", model, opt, scaler=torch.amp.GradScaler("cpu", enabled=saved)) as m:
        m.restore()
        train(model, opt, sched, m, 1, 2)
        m.close(2)
    model, opt, sched = setup()
    scaler = torch.amp.GradScaler("cpu", enabled=now, init_scale=8.0)
    params = [p.detach().clone() for p in model.parameters()]
    was, then = ("enabled", "disabled") if now else ("disabled", "enabled")
    with mgr(tmp_path / "r", model, opt, scaler=scaler) as m:
        with pytest.raises(ConfigMismatchError, match=f"step_000002.bin: amp.scaler: the checkpoint's GradScaler "
                                                      f"was {then}, the loop's is {was} "):
            m.restore()       # was: RuntimeError 'The source state dict is empty' after the copy
        assert all(torch.equal(a, b) for a, b in zip(params, model.parameters())) and not opt.state
        with pytest.warns(UserWarning, match="amp.scaler: .* it starts fresh"):
            assert m.restore(strict=False) == 2
        assert m.fresh == [f"amp.scaler ({then} in the checkpoint, {was} in the loop)"]
    assert opt.state and scaler.get_scale() == (8.0 if now else 1.0)


class Counter:
    """A loop's state object. ``newer``: a later version of it, whose state has a ``shuffle_seed``
    the saved one lacks; its load_state_dict changes itself, then raises. ``broken``: it raises
    on any state, its own too."""

    def __init__(self, newer=False, broken=False):
        self.seen, self.newer, self.broken = {"pos": 0, "order": [1, 2]}, newer, broken
        if newer:
            self.seen["shuffle_seed"] = 0

    def state_dict(self):
        return self.seen                        # its live dict, as many loops hand out

    def load_state_dict(self, tree):
        self.seen["pos"] = tree["pos"]          # half-way: changed, then raises
        self.seen["order"].append(99)
        if self.broken:
            raise RuntimeError("broken")
        if self.newer:
            self.seen["shuffle_seed"] = tree["shuffle_seed"]
        self.seen["order"] = list(tree["order"])


def saved_counters(path):
    model, opt, sched = setup()
    loader, sampler = Counter(), Counter()
    with mgr(path, model, opt, scheduler=sched, every=5, state={"loader": loader, "sampler": sampler}) as m:
        m.restore()
        loader.seen["pos"], sampler.seen["pos"] = 7, 8
        train(model, opt, sched, m, 1, 5)
        m.close(5)


def test_a_state_object_whose_load_state_dict_raises_leaves_everything_as_it_was(tmp_path):
    saved_counters(tmp_path / "r")
    model, opt, sched = setup()
    loader, sampler = Counter(), Counter(newer=True)
    params = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(123)
    with mgr(tmp_path / "r", model, opt, scheduler=sched, state={"loader": loader, "sampler": sampler}) as m:
        with pytest.raises(StateRefusedError, match=r"step_000005.bin: cannot resume: state.sampler: "
                                                    r"load_state_dict raised KeyError: 'shuffle_seed'; "
                                                    r"nothing was restored \(every object it loaded was "
                                                    r"put back\)$"):
            m.restore()
        assert torch.rand(1).item() == torch.rand(1, generator=torch.Generator().manual_seed(123)).item()
        assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
        assert not opt.state and sched.last_epoch == 0
        assert loader.seen == {"pos": 0, "order": [1, 2]}
        assert sampler.seen == {"pos": 0, "order": [1, 2], "shuffle_seed": 0}
        sampler.newer = False                   # the loop mended: the same manager restores in full
        assert m.restore() == 5
    assert loader.seen["pos"] == 7 and sampler.seen["pos"] == 8 and sched.last_epoch == 5
    assert all(not torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_a_state_object_that_cannot_take_back_its_own_state_is_named(tmp_path):
    saved_counters(tmp_path / "r")
    model, opt, sched = setup()
    params = [p.detach().clone() for p in model.parameters()]
    with mgr(tmp_path / "r", model, opt, scheduler=sched,
             state={"loader": Counter(), "sampler": Counter(broken=True)}) as m:
        with pytest.raises(StateRefusedError, match=r"state.sampler: load_state_dict raised RuntimeError: "
                                                    r"broken; state.sampler could not be put back \(the "
                                                    r"other objects were; no tensor was copied\)$"):
            m.restore()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters())) and sched.last_epoch == 0


def test_a_resume_under_other_versions_says_so_and_goes_on(tmp_path):
    """The manifest records torch/numpy/Python/ckptfmt versions; a resume under others says
    which changed (bit-identity with an unbroken run is not promised), and never refuses."""
    import json
    saved_run(tmp_path / "r")
    manifest = tmp_path / "r" / "step_000005.json"
    doc = json.loads(manifest.read_text())
    doc["versions"]["torch"] = "1.13.1"
    manifest.write_text(json.dumps(doc))                 # the blake3 covers the .bin, not this
    model, opt, sched = setup()
    said = []
    with mgr(tmp_path / "r", model, opt, scheduler=sched, log=said.append) as m:
        assert m.restore() == 5
    assert [s for s in said if "versions" in s] == [
        f"resuming under other versions than the checkpoint's (torch 1.13.1 -> {torch.__version__}): "
        "the run goes on from the same values; bit-identity with an unbroken run is not promised"]
    model, opt, sched = setup()
    said = []
    saved_run(tmp_path / "same")
    with mgr(tmp_path / "same", model, opt, scheduler=sched, log=said.append) as m:
        assert m.restore() == 5
    assert not [s for s in said if "versions" in s]


class Unkeepable(Counter):
    """A state object whose own state cannot be kept for a rollback (its state_dict raises, as
    deepcopy of a tensor still in the autograd graph does)."""

    def state_dict(self):
        if getattr(self, "restoring", False):
            raise RuntimeError("only graph leaves support deepcopy")
        return super().state_dict()


def test_a_state_object_whose_own_state_cannot_be_kept_is_refused_and_the_others_put_back(tmp_path):
    saved_counters(tmp_path / "r")
    model, opt, sched = setup()
    sampler = Unkeepable()
    sampler.restoring = True
    with mgr(tmp_path / "r", model, opt, scheduler=sched, state={"loader": Counter(), "sampler": sampler}) as m:
        with pytest.raises(StateRefusedError, match=r"state.sampler: state_dict \(kept to put it back\) raised "
                                                    r"RuntimeError: only graph leaves support deepcopy; nothing "
                                                    r"was restored \(every object it loaded was put back\)$"):
            m.restore()
    assert sched.last_epoch == 0 and not opt.state
