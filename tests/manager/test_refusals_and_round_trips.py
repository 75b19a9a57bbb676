"""CheckpointManager's refusals and round trips: what it cannot store, and what users commonly get
wrong, is one line, a ``CheckpointError``, before a byte is written or copied; what it stores
comes back exactly."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ckptfmt.errors import (ConfigMismatchError, IncompleteResumeStateError, LayoutMismatchError,  # noqa: E402
                            OptimizerMismatchError, RunLockedError, StateRefusedError,
                            UnsupportedSetupError)
from ckptfmt.torch import CheckpointManager  # noqa: E402
from ckptfmt.torch.state import join, split  # noqa: E402
from models import inputs, tiny_adamw, train_steps, two_layer  # noqa: E402
from conftest import commit_rewritten  # noqa: E402


def mgr(path, model, opt, **kw):
    return CheckpointManager(path, model, opt, handle_signals=False, **kw)


def steps(model, opt, n, pick=lambda i: True):
    for i in range(n):
        out = model[0](inputs(8))
        if pick(i):
            out = model[1](out)
        loss = out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_split_join_keeps_colliding_paths_byte_order_scalars_and_marker_keys():
    state = {"a/b": torch.tensor([1]), "a": {"b": torch.tensor([2])}, "l": {1: torch.tensor([3]), "1": torch.tensor([4])},
             "be": np.arange(4, dtype=">f4"), "s": np.float32(0.1), "m": {"__float__": "1.5", "o": 1},
             "empty": torch.empty(0, 4), "u": np.arange(3, dtype=np.uint32)}
    tree, tensors = split(state, "x")
    json.dumps(tree, allow_nan=False)
    back = join(tree, tensors)
    assert back["a/b"].tolist() == [1] and back["a"]["b"].tolist() == [2]
    assert back["l"][1].tolist() == [3] and back["l"]["1"].tolist() == [4]
    assert back["be"].tolist() == [0.0, 1.0, 2.0, 3.0] and back["be"].dtype == np.dtype(">f4")
    assert type(back["s"]) is np.float32 and back["s"] == np.float32(0.1)
    assert back["m"] == {"__float__": "1.5", "o": 1} and back["empty"].shape == (0, 4)
    with pytest.raises(TypeError, match="x/c: a torch.complex64"):
        split({"c": torch.zeros(2, dtype=torch.complex64)}, "x")


def test_what_cannot_be_stored_is_refused_at_construction(tmp_path):
    model = two_layer()
    with pytest.raises(UnsupportedSetupError, match="float64"):
        mgr(tmp_path / "a", model.double(), torch.optim.Adam(model.parameters()))
    model = two_layer()
    extra = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(UnsupportedSetupError, match="not parameters of the model"):
        mgr(tmp_path / "b", model, torch.optim.Adam([*model.parameters(), extra]))
    with pytest.raises(TypeError, match="not JSON|neither"):
        mgr(tmp_path / "c", model, torch.optim.Adam(model.parameters()),
            generators={"mt": np.random.Generator(np.random.MT19937(1))})
    CheckpointManager(tmp_path / "c", model, torch.optim.Adam(model.parameters()), handle_signals=False).close()


def test_a_refused_save_writes_nothing(tmp_path):
    model = two_layer()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(TypeError, match="strict JSON"):
        mgr(tmp_path / "r", model, opt, config={"lr": float("nan")})
    m = mgr(tmp_path / "r", model, opt, config={"ok": 1})
    m.config = {"path": tmp_path}                        # becomes unstorable later
    with pytest.raises(TypeError, match="strict JSON"):
        m.save(1)
    m.close()
    assert not list((tmp_path / "r").glob("step_*"))


def test_parameters_outside_the_optimizer_and_on_different_steps_resume_exactly(tmp_path):
    model = two_layer()
    opt = torch.optim.Adam(model[1].parameters(), lr=1e-2)   # model[0] frozen: not in the optimizer
    steps(model, opt, 5, pick=lambda i: i % 2 == 0)
    with mgr(tmp_path / "r", model, opt) as m:
        m.save(5)
    model2 = two_layer()
    opt2 = torch.optim.Adam(model2[1].parameters(), lr=1e-2)
    with mgr(tmp_path / "r", model2, opt2) as m:
        assert m.restore() == 5
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"] and isinstance(opt2.param_groups[0]["betas"], tuple)


def test_branch_parameters_with_fewer_steps_save_and_resume(tmp_path):
    model = two_layer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps(model, opt, 4, pick=lambda i: i % 3 == 0)           # model[1] takes 2 steps, model[0] 4
    with mgr(tmp_path / "r", model, opt) as m:
        m.save(4)
    doc = json.loads((tmp_path / "r" / "step_000004.json").read_text())
    assert doc["optimizer"]["param_steps"] == [4, 4, 2, 2]
    model2 = two_layer()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    with mgr(tmp_path / "r", model2, opt2) as m:
        m.restore()
    assert [int(s["step"]) for s in opt2.state.values()] == [4, 4, 2, 2]


def test_rollback_inside_the_run_is_refused_with_the_fork_advice(tmp_path):
    model = two_layer()
    opt = torch.optim.Adam(model.parameters())
    with mgr(tmp_path / "r", model, opt) as m:
        for s in (2, 4):
            m.save(s)
    with mgr(tmp_path / "r", model, opt) as m:
        with pytest.raises(UnsupportedSetupError, match=r"newer ones \(steps \[4\]\).*ckptfmt fork"):
            m.restore(tmp_path / "r" / "step_000002.bin")


def test_a_first_save_cut_before_its_manifest_is_a_fresh_start(tmp_path):
    model = two_layer()
    opt = torch.optim.Adam(model.parameters())
    with mgr(tmp_path / "r", model, opt) as m:
        m.save(3)
    (tmp_path / "r" / "step_000003.json").unlink()          # what a kill between the renames leaves
    with mgr(tmp_path / "r", model, opt) as m:
        with pytest.warns(UserWarning, match="starting fresh"):
            assert m.restore() == 0


def test_pieces_in_the_checkpoint_but_not_given_are_refused(tmp_path):
    model = two_layer()
    opt = torch.optim.Adam(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    with mgr(tmp_path / "r", model, opt, scheduler=sched, generators={"g": np.random.default_rng(1)}) as m:
        m.save(1)
    with mgr(tmp_path / "r", model, opt) as m:
        with pytest.raises(IncompleteResumeStateError, match="the checkpoint has scheduler, rng.generators.g, which this loop does not restore"):
            m.restore()
    with mgr(tmp_path / "r", model, opt) as m:
        with pytest.warns(UserWarning):
            m.restore(strict=False)
        assert m.fresh == ["scheduler (in the checkpoint, not restored)",
                           "rng.generators.g (in the checkpoint, not restored)"]


def test_tied_weights_numpy_losses_closed_managers_and_thread_construction(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight                       # tied
    opt = torch.optim.Adam(model.parameters())
    m = mgr(tmp_path / "r", model, opt)
    assert m.step(1, loss=np.float32(1.5), tokens=np.int64(64)) is False
    m.save(1)
    m.close()
    doc = json.loads((tmp_path / "r" / "step_000001.json").read_text())
    assert doc["buffers"] == {} and "companion" not in doc
    with pytest.raises(RuntimeError, match="closed"):
        m.save(2)
    said = []                    # built outside the main thread: no signals, said once (tests/manager/test_interrupts.py)
    thread = threading.Thread(target=lambda: CheckpointManager(tmp_path / "r", model, opt, log=said.append).close())
    thread.start()
    thread.join()
    assert len(said) == 1 and "signals are not handled" in said[0]
    CheckpointManager(tmp_path / "r", model, opt, handle_signals=False).close()    # the lock is free


def test_a_tensor_learning_rate_comes_back_as_the_same_tensor(tmp_path):
    model = two_layer()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.0123))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        steps(model, opt, 1)
        sched.step()
    with mgr(tmp_path / "r", model, opt, scheduler=sched) as m:
        m.save(3)
    model2 = two_layer()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=torch.tensor(0.5))
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    with mgr(tmp_path / "r", model2, opt2, scheduler=sched2) as m:
        assert m.restore() == 3
    lr = opt2.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and torch.equal(lr, opt.param_groups[0]["lr"])
    for model_, opt_ in ((model, opt), (model2, opt2)):
        torch.manual_seed(5)                         # the same batch for both
        steps(model_, opt_, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_a_refused_restore_names_every_missing_piece_and_changes_nothing(tmp_path):
    model, noise = two_layer(), np.random.default_rng(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps(model, opt, 2)
    with mgr(tmp_path / "r", model, opt) as m:
        m.save(2)
    model2 = two_layer()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    before = [p.detach().clone() for p in model2.parameters()]
    noise_before = noise.bit_generator.state
    with mgr(tmp_path / "r", model2, opt2, scheduler=sched2, generators={"noise": noise}) as m:
        with pytest.raises(IncompleteResumeStateError, match="lacks scheduler, rng.generators.noise"):
            m.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))
    assert not opt2.state and noise.bit_generator.state == noise_before


def test_hooks_add_fields_see_the_manifest_first_and_upgrade_old_ones(tmp_path):
    model = two_layer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    committed = []
    with mgr(tmp_path / "r", model, opt, manifest_fields=lambda step: {"mine": {"at": step}},
             on_commit=lambda step, doc: committed.append((step, doc["mine"]))) as m:
        m.save(4)
    assert committed == [(4, {"at": 4})]
    seen = []

    def refuse(doc, path):
        seen.append(doc["mine"])
        raise IncompleteResumeStateError(path, "not mine")
    model2 = two_layer()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model2.parameters()]
    upgrade = lambda doc: {**doc, "mine": {"at": doc["mine"]["at"] * 10}}   # noqa: E731
    with mgr(tmp_path / "r", model2, opt2, upgrade=upgrade, on_restore=refuse) as m:
        with pytest.raises(IncompleteResumeStateError, match="not mine"):
            m.restore()
    assert seen == [{"at": 40}] and all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))
    model3 = two_layer()
    with pytest.raises(ValueError, match="'rng' is a field the manager writes"):
        with mgr(tmp_path / "r2", model3, torch.optim.SGD(model3.parameters(), lr=0.1),
                 manifest_fields=lambda step: {"rng": 1}) as m:
            m.save(1)
    assert not list((tmp_path / "r2").glob("step_*"))
    with pytest.raises(TypeError, match="unknown argument"):
        mgr(tmp_path / "r3", model, opt, on_save=print)


def test_history_keeps_integers_and_a_fresh_run_starts_once(tmp_path):
    from ckptfmt.run import history as hist
    model = two_layer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mgr(tmp_path / "r", model, opt) as m:
        assert m.restore() == 0
        m.step(1, loss=torch.tensor(0.5), tokens=np.int64(512), source="code", nan=float("nan"))
    record = hist.read(tmp_path / "r" / ".loss.json").canonical()[0]
    assert record["tokens"] == 512 and isinstance(record["tokens"], int) and record["loss"] == 0.5
    assert record["source"] == "code" and record["nan"] == "nan"
    events = [e["event"] for e in hist.read(tmp_path / "r" / ".loss.json").events()]
    assert events == ["start"]


def test_bare_checkpoints_that_no_ckptfmt_writer_held_are_never_replaced(tmp_path):
    """Another trainer's step_N.bin files (no manifest, FORMAT §4.4) copied into a directory
    were taken for leftovers of an interrupted first save: a fresh start replaced them at its
    first save of the same step. A run whose .lock no writer created before is refused, and the
    refusal (and gc or pivot there) leaves the .lock marked never written, so a retry is refused
    too (it removed the .lock at first, which a writer waiting on it could hold open)."""
    from ckptfmt.errors import NoValidGenerationError
    from ckptfmt.run.ops import gc, pivot
    from conftest import arrays
    model = two_layer()
    opt = torch.optim.Adam(model.parameters())
    run = tmp_path / "bare"
    run.mkdir()
    n = sum(p.numel() for p in model.parameters())
    header = np.array([3, n], dtype="<i4").tobytes()                 # the original trainer's file
    (run / "step_000003.bin").write_bytes(header + b"".join(a.astype("<f4").tobytes() for a in arrays(n)))
    before = (run / "step_000003.bin").read_bytes()
    for _ in range(2):
        with mgr(run, model, opt) as m:
            with pytest.raises(UnsupportedSetupError, match=r"bare: holds checkpoints without manifests "
                                                            r"\(step_000003.bin\) and was never a ckptfmt run"):
                m.restore()
        assert sorted(p.name for p in run.iterdir()) == [".lock", "step_000003.bin"]
        assert json.loads((run / ".lock").read_text()) == {"never_written": True}
    assert gc(run, keep_last=1)["deleted"] == []
    with pytest.raises(NoValidGenerationError):
        pivot(run)
    with mgr(run, model, opt) as m, pytest.raises(UnsupportedSetupError, match="was never a ckptfmt run"):
        m.restore()
    assert (run / "step_000003.bin").read_bytes() == before


def test_an_async_save_waits_for_the_one_in_flight_before_it_takes_its_snapshot(tmp_path, monkeypatch):
    """With ``async_save`` the snapshot buffers are reused: a save while the previous one is still
    writing must wait for it, or the new snapshot overwrites what the old commit is writing. The
    first commit is held mid-write until the second save has asked; each generation must still
    hold exactly the weights of its own step."""
    import time

    import ckptfmt
    from ckptfmt import fsio
    from models import two_layer_adamw, train_steps
    model, opt = two_layer_adamw()
    held = threading.Event()

    def hook(op, path):
        if op == "write" and "step_000001" in path and not held.is_set():
            held.set()
            time.sleep(0.5)             # the second save is asked for while this one writes
    monkeypatch.setattr(fsio, "hook", hook)
    want = {}
    with CheckpointManager(tmp_path / "run", model, opt, every=None, keep_last=None, async_save=True,
                           handle_signals=False) as mgr:
        mgr.restore()
        for step in (1, 2):
            train_steps(model, opt, 1)
            want[step] = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
            mgr.save(step)
            if step == 1:
                assert held.wait(10)
        mgr.wait()
    for step in (1, 2):
        with ckptfmt.open(tmp_path / "run" / f"step_{step:06d}.bin", verify=True) as ck:
            assert np.array_equal(np.asarray(ck.weights), want[step]), f"generation {step} holds another step's weights"


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
    with pytest.raises(RunLockedError, match=r"checkpoint manager pid \d+ on .* \(this process: an earlier writer on "
                                             r"this run was never closed"):
        mgr(tmp_path / "r", model, opt)
    first.close()
    mgr(tmp_path / "r", model, opt).close()


def test_a_model_with_other_parameter_names_is_refused_naming_a_name_each_side_lacks(tmp_path):
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with mgr(tmp_path / "r", saved, torch.optim.AdamW(saved.parameters())) as m:
        m.save(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))     # the ReLU left out
    with mgr(tmp_path / "r", model, torch.optim.AdamW(model.parameters())) as m:
        with pytest.raises(LayoutMismatchError, match=r"step_000001.bin: parameter names differ from the "
                                                      r"model's \(4 parameters in the checkpoint, 4 in the model; "
                                                      r"the checkpoint has '2.weight' \(and 1 more\), which the model "
                                                      r"lacks; the model has '1.weight' \(and 1 more\), which the "
                                                      r"checkpoint lacks\)$"):
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
    commit_rewritten(manifest, doc)                      # as a writer under torch 1.13.1 committed it
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


def test_a_restore_that_finds_nothing_after_training_in_memory_says_it_is_no_fresh_start(tmp_path):
    """A notebook: the manager built, a cell trains, then restore() finds no generation. The
    loop would go on from the trained weights as if from step 0: the log says so, as it does for a
    model an earlier cell trained before the manager was built (its optimizer holds state). A
    model left as it was built restores silently to a fresh start."""
    model, opt = tiny_adamw()
    said = []
    with CheckpointManager(tmp_path / "run", model, opt, handle_signals=False, log=said.append) as mgr:
        train_steps(model, opt, 2)
        assert mgr.restore() == 0
    assert len(said) == 1 and "restore() found no generation, but the model's parameters changed" in said[0]
    model, opt = tiny_adamw()
    said.clear()
    with CheckpointManager(tmp_path / "other", model, opt, handle_signals=False, log=said.append) as mgr:
        assert mgr.restore() == 0
    assert said == []
    train_steps(model, opt, 2)                  # an earlier cell trained, then the manager was built
    with CheckpointManager(tmp_path / "third", model, opt, handle_signals=False, log=said.append) as mgr:
        assert mgr.restore() == 0
    assert len(said) == 1 and "restore() found no generation, but the optimizer already holds state" in said[0]


def test_a_manager_left_unclosed_gives_its_lock_to_the_next_one_once_nothing_refers_to_it(tmp_path):
    """A notebook cell failed before close(): its manager lives on in a reference cycle until
    the collector runs. The next manager on the run collects it and takes the lock; one still
    referred to is refused with how to free it."""
    import gc
    import weakref
    from ckptfmt.errors import RunLockedError
    model, opt = tiny_adamw()
    gc.disable()
    try:
        mgr = CheckpointManager(tmp_path / "run", model, opt, handle_signals=False)
        mgr.restore()
        orphan = weakref.ref(mgr)
        del mgr
        assert orphan() is not None                      # only the collector frees it
        with CheckpointManager(tmp_path / "run", model, opt, handle_signals=False) as again:
            assert again.restore() == 0 and orphan() is None
    finally:
        gc.enable()
    orphaned = CheckpointManager(tmp_path / "mirrored", model, opt, handle_signals=False, every=1,
                                 mirror=(tmp_path / "there").as_uri())       # its thread lives on
    orphaned.restore()
    orphaned.step(1, loss=1.0)
    del orphaned
    with CheckpointManager(tmp_path / "mirrored", model, opt, handle_signals=False) as again:
        assert again.restore() == 1
    with pytest.raises(ValueError, match="memory_every"):          # refused before the lock is taken
        CheckpointManager(tmp_path / "tier", model, opt, memory_every=0)
    CheckpointManager(tmp_path / "tier", model, opt, handle_signals=False).close()
    kept = CheckpointManager(tmp_path / "held", model, opt, handle_signals=False)
    with pytest.raises(RunLockedError, match=r"never closed, e\.g\. a CheckpointManager of a notebook cell that "
                                             r"failed: call its close\(\), or drop every reference to it"):
        CheckpointManager(tmp_path / "held", model, opt, handle_signals=False)
    kept.close()


@pytest.mark.parametrize("url, error", [("plain/path", "mirror= needs a URL"),
                                        ("nosuch://bucket/run", "Protocol not known: nosuch")])
def test_a_mirror_that_is_no_url_is_refused_before_the_run_is_opened(tmp_path, url, error):
    model, opt = tiny_adamw()
    from ckptfmt import errors
    with pytest.raises(errors.CheckpointError, match=error):
        CheckpointManager(tmp_path / "run", model, opt, handle_signals=False, mirror=url)
    assert not (tmp_path / "run").exists() and not (tmp_path / "plain").exists()
