"""A run resumed on another device type is refused by name, or, when asked
for, goes on and says so.

A CUDA run is simulated on the CPU by writing into a saved manifest what a CUDA process writes
(``rng.torch_cuda`` with the device in use, a torch generator's ``device``); a CPU run resumed
with CUDA in use by ``rng.cuda_device`` answering a device index for the restore (the only
CUDA call on that path; the CUDA RNG itself is then never touched, which is the point).
"""
from __future__ import annotations

import base64
import json

import pytest

torch = pytest.importorskip("torch")

from ckptfmt.errors import DeviceChangeError  # noqa: E402
from ckptfmt.run import history as hist  # noqa: E402
from ckptfmt.torch import CheckpointManager, rng  # noqa: E402
from ckptfmt.trainer.checkpointing import device_refusal  # noqa: E402
from models import train_steps, two_layer_adamw  # noqa: E402
from conftest import commit_rewritten  # noqa: E402

CUDA_STATE = base64.b64encode(bytes(16)).decode()      # a philox seed and offset: 16 bytes
ACCEPT = " (restore(allow_device_change=True) goes on with those RNGs as this process has them; " \
         "the run then does not continue bit-exactly)"


def loop(run, seed=0, logs=None):
    model, opt = two_layer_adamw(seed)
    noise = torch.Generator().manual_seed(seed + 7)
    mgr = CheckpointManager(run, model, opt, generators={"noise": noise}, handle_signals=False,
                            every=None, log=(logs.append if logs is not None else None))
    return model, opt, noise, mgr


def saved_run(tmp_path, edit):
    """A CPU run with one generation at step 3, its manifest edited by ``edit``."""
    run = tmp_path / "run"
    model, opt, noise, mgr = loop(run)
    train_steps(model, opt, 3, generator=noise)
    mgr.close(3)
    path = run / "step_000003.json"
    doc = json.loads(path.read_text())
    edit(doc)
    commit_rewritten(path, doc)                         # as a writer on that device committed it
    return run, model


def as_cuda_run(doc):
    doc["rng"]["torch_cuda"] = {"device": 0, "state": CUDA_STATE}


def test_a_cuda_run_on_the_cpu_is_refused_by_name_and_nothing_is_restored(tmp_path):
    run, saved = saved_run(tmp_path, as_cuda_run)
    model, _, noise, mgr = loop(run, seed=1)
    before = [p.clone() for p in model.parameters()]
    draws = noise.get_state()
    with pytest.raises(DeviceChangeError) as err:
        mgr.restore()
    assert err.value.problem == ("cannot resume on another device type: it was saved on cuda:0 and this "
                                 "process uses no CUDA device, so its rng.torch_cuda cannot be restored" + ACCEPT)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(noise.get_state(), draws)
    mgr.close()


def test_an_accepted_device_change_restores_the_rest_and_says_so(tmp_path):
    run, saved = saved_run(tmp_path, as_cuda_run)
    logs = []
    model, _, noise, mgr = loop(run, seed=1, logs=logs)
    assert mgr.restore(allow_device_change=True) == 3
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters()))
    assert mgr.fresh == ["rng.torch_cuda (device change)"]
    assert any(m.startswith("device changed from cuda:0 to cpu: ") for m in logs)
    events = [e for e in hist.read(run / ".loss.json").events() if e["event"] == "device_change"]
    assert [(e["step"], e["saved"], e["now"], e["not_restored"]) for e in events] == \
        [(3, "cuda:0", "cpu", ["rng.torch_cuda"])]
    mgr.close()


def test_a_generator_saved_on_cuda_is_named_and_skipped_when_accepted(tmp_path):
    def cuda_generator(doc):
        as_cuda_run(doc)
        doc["rng"]["generators"]["noise"].update(device="cuda:0", state=CUDA_STATE)
    run, _ = saved_run(tmp_path, cuda_generator)
    model, _, noise, mgr = loop(run, seed=1)
    with pytest.raises(DeviceChangeError, match="rng.generators.noise was saved on cuda:0, the loop gives it on cpu"):
        mgr.restore()
    draws = noise.get_state()
    assert mgr.restore(allow_device_change=True) == 3
    assert torch.equal(noise.get_state(), draws)           # a CUDA state cannot go into a CPU generator
    assert mgr.fresh == ["rng.torch_cuda (device change)", "rng.generators.noise (device change)"]
    mgr.close()


def test_a_cpu_run_with_cuda_in_use_names_the_device_change_not_a_missing_piece(tmp_path, monkeypatch):
    run, saved = saved_run(tmp_path, lambda doc: None)
    model, _, _, mgr = loop(run, seed=1)
    monkeypatch.setattr(rng, "cuda_device", lambda: 0)     # CUDA in use here (see the module docstring)
    with pytest.raises(DeviceChangeError) as err:
        mgr.restore()
    assert err.value.problem == ("cannot resume on another device type: the checkpoint was saved without "
                                 "CUDA (it has no rng.torch_cuda) and this process uses cuda:0" + ACCEPT)
    assert "lacks" not in str(err.value)
    assert mgr.restore(allow_device_change=True) == 3
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters()))
    assert mgr.fresh == ["rng.torch_cuda (device change)"]
    mgr.close()


def test_the_decision_in_every_direction():
    cuda = {"torch_cuda": {"device": 1, "state": CUDA_STATE}}
    assert rng.device_changes(cuda, None) == [("torch_cuda", "cuda:1", "cpu")]
    assert rng.device_changes(cuda, 0) == []                      # another GPU: no change of type
    assert rng.device_changes({}, 0) == [("torch_cuda", "cpu", "cuda:0")]
    assert rng.device_changes({}, None) == []
    assert rng.device_changes({"torch_cuda": ["old", "list"]}, None) == [("torch_cuda", "cuda", "cpu")]
    gens = {"generators": {"g": {"kind": "torch", "device": "cuda:0"}, "n": {"kind": "numpy"}}}
    assert rng.device_changes(gens, None, {"g": "cpu"}) == [("generators.g", "cuda:0", "cpu")]
    assert rng.device_changes(gens, None, {"g": "cuda:1"}) == []


def test_the_trainer_names_the_flag_in_both_directions():
    assert device_refusal("cuda:0", "cpu") == (
        "the run trained on cuda:0, this start runs on cpu: resume it where CUDA is available "
        "(--device cuda), or pass --allow-device-change to go on on cpu (not bit-exact: the RNG "
        "state of cuda:0 cannot be restored there)")
    assert device_refusal("cpu", "cuda:0") == (
        "the run trained on cpu, this start runs on cuda:0: pass --device cpu, or pass "
        "--allow-device-change to go on on cuda:0 (not bit-exact: the RNG state of cpu cannot be "
        "restored there)")
    assert device_refusal("cuda:1", "cuda:0") is None and device_refusal(None, "cpu") is None
