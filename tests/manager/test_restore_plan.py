"""Restoring is a function of what it restores into (``Loop``) that returns what it did
(``Restored``); the manager only copies that result into its attributes, and what a restore
says goes through the callables it is given."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ckptfmt.run import Run, zombie_arms  # noqa: E402
from ckptfmt.torch import CheckpointManager, notes  # noqa: E402
from ckptfmt.torch import restore as restoring  # noqa: E402
from models import train_steps, two_layer_adamw  # noqa: E402


def loop_of(run, model, opt, pieces=(), generators=None, said=None, events=None) -> restoring.Loop:
    said = [] if said is None else said
    events = [] if events is None else events
    return restoring.Loop(Run(run), model, opt, tuple(pieces), generators or {}, 0,
                          lambda message, info=False: said.append(message),
                          lambda kind, step, **fields: events.append((kind, step, fields)))


def test_restore_takes_a_loop_and_returns_what_it_restored(tmp_path):
    model, opt = two_layer_adamw()
    train_steps(model, opt, 1)
    with CheckpointManager(tmp_path / "r", model, opt, handle_signals=False) as mgr:
        mgr.save(4)
    twin, twin_opt = two_layer_adamw(seed=1)
    loop = loop_of(tmp_path / "r", twin, twin_opt)
    done = restoring.restore(loop, None, True, True)
    assert done == restoring.Restored(4, str(tmp_path / "r" / "step_000004.bin"), (), None,
                                      metrics=done.metrics, tier="disk")
    assert set(done.metrics) == set()            # the loop reported no metric before step 4
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(opt.state[next(model.parameters())]["exp_avg"],
                       twin_opt.state[next(twin.parameters())]["exp_avg"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        loop.rank = 1                                           # what it restores is fixed


def test_a_fresh_run_restores_nothing_and_says_so_in_the_result(tmp_path):
    model, opt = two_layer_adamw()
    (tmp_path / "empty").mkdir()
    assert restoring.restore(loop_of(tmp_path / "empty", model, opt), None, True, True) == restoring.Restored()


def test_pieces_left_fresh_are_in_the_result_and_the_manager_keeps_them(tmp_path):
    model, opt = two_layer_adamw()
    with CheckpointManager(tmp_path / "r", model, opt, handle_signals=False) as mgr:
        mgr.save(2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5)
    gen = np.random.default_rng(0)
    with pytest.warns(UserWarning, match="starts fresh"):
        done = restoring.restore(loop_of(tmp_path / "r", model, opt, [("scheduler", sched)], {"noise": gen}),
                                 None, False, True)
    assert done.step == 2 and done.fresh == ("scheduler", "rng.generators.noise")
    with CheckpointManager(tmp_path / "r", model, opt, sched, generators={"noise": gen},
                           handle_signals=False) as mgr:
        with pytest.warns(UserWarning, match="starts fresh"):
            assert mgr.restore(strict=False) == 2
        assert mgr.fresh == ["scheduler", "rng.generators.noise"]
        assert mgr.restored_from == str(tmp_path / "r" / "step_000002.bin") and mgr.skipped_diverged is None


def test_what_a_restore_says_goes_through_the_log_and_event_it_is_given():
    said, events = [], []
    log = said.append

    def event(kind, step, **fields):
        events.append((kind, step, fields))
    change = {"saved": 2, "now": 1}
    notes.world_size_changed(log, event, 7, change)
    notes.device_changed(log, event, 7, [("torch_cuda", "cuda:0", "cpu")])
    assert said[0].startswith("world size changed from 2 to 1:") and "dropped ranks are discarded" in said[0]
    assert said[1].startswith("device changed from cuda:0 to cpu:") and said[1].endswith("rng.torch_cuda")
    assert events == [("world_size_change", 7, change),
                      ("device_change", 7, {"saved": "cuda:0", "now": "cpu", "not_restored": ["rng.torch_cuda"]})]


def test_the_sidecar_rules_take_a_run_directory_path_or_its_run(tmp_path):
    model, opt = two_layer_adamw()
    with CheckpointManager(tmp_path, model, opt, config={"sources": ["code"]}, handle_signals=False) as mgr:
        mgr.save(1)
    (tmp_path / ".state.json").write_text('{"arms": {"code": {}, "gone": {}}}')
    assert zombie_arms(tmp_path) == zombie_arms(str(tmp_path)) == zombie_arms(Run(tmp_path)) == ["gone"]
