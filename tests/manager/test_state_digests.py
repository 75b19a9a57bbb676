"""The history's state digests (spec/RUN.md §3.9): the record of ``mgr.step(k)`` holds a digest of
every piece of state as step k+1 will find it; a run resumed bit-exactly writes the records a
straight run writes, and one that went wrong parts at the piece it lost; the readers of the
history pass over the field; the reference trainer records it with ``--state-digests``."""
from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import models  # noqa: E402
import warm  # noqa: E402
from ckptfmt.run import SavePolicy, history, timeline  # noqa: E402
from ckptfmt.run.statemanager import StateManager  # noqa: E402
from ckptfmt.torch import CheckpointManager  # noqa: E402
from ckptfmt.torch.digests import Held, digest, state_digests  # noqa: E402
from conftest import cli  # noqa: E402

STEPS, CUT = 6, 3
RNG = {"rng.python", "rng.numpy", "rng.torch", "rng.noise", "rng.drop"}


class Position:
    """A loop's own state object: where its data stream stands, with a tensor in it."""

    def __init__(self) -> None:
        self.seen, self.order = 0, torch.arange(4)

    def state_dict(self) -> dict:
        return {"seen": self.seen, "order": self.order.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.order = state["seen"], state["order"].clone()


class Loop:
    """A loop drawing from every RNG each step, with a scheduler, a state object and two named
    generators; ``seed`` builds it as a fresh process would (another seed: a process to restore into)."""

    def __init__(self, run: Path, seed: int = 0, **options):
        random.seed(seed)
        np.random.seed(seed)
        self.model, self.opt = models.tiny_adamw(seed)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.position = Position()
        self.gens = {"noise": np.random.default_rng(seed + 1), "drop": torch.Generator().manual_seed(seed + 2)}
        self.mgr = CheckpointManager(run, self.model, self.opt, self.sched, state={"data": self.position},
                                     generators=self.gens, every=None, handle_signals=False,
                                     **{"digests": True, **options})

    def train(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            x = models.inputs() * (1 + random.random() + np.random.random() + self.gens["noise"].random())
            x = x + torch.rand(1, generator=self.gens["drop"])
            loss = self.model(x).square().mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.position.seen += len(x)
            self.mgr.step(step, loss=loss.item())


def states(run: Path) -> dict[int, dict]:
    """Each step's ``state`` in the canonical history."""
    return {rec["step"]: rec.get("state") for rec in history.read(run / ".loss.json").canonical()}


def straight_run(run: Path) -> dict[int, dict]:
    loop = Loop(run)
    loop.train(1, STEPS)
    loop.mgr.close()
    return states(run)


def resumed_run(run: Path, restore_rng: bool = True) -> dict[int, dict]:
    """Trained to ``CUT``, saved; then a loop built as a new process would build it (other seeds
    everywhere) restores and goes on to ``STEPS``."""
    first = Loop(run)
    first.train(1, CUT)
    first.mgr.close(CUT)
    second = Loop(run, seed=99)
    assert second.mgr.restore(restore_rng=restore_rng) == CUT
    second.train(CUT + 1, STEPS)
    second.mgr.close()
    return states(run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("digests")
    return {"straight": (base / "straight", straight_run(base / "straight")),
            "resumed": (base / "resumed", resumed_run(base / "resumed")),
            "reseeded": (base / "reseeded", resumed_run(base / "reseeded", restore_rng=False))}


def test_the_record_of_step_k_holds_the_state_step_k_plus_1_starts_from(tmp_path):
    loop = Loop(tmp_path / "run")
    loop.train(1, 1)
    after_1 = digest(torch.get_rng_state())
    torch.rand(1)                         # step 2's draw, made between mgr.step(1) and its work
    drawn = digest(torch.get_rng_state())
    loop.mgr.step(2, loss=0.0)
    loop.mgr.close()
    got = states(tmp_path / "run")
    assert got[1]["rng.torch"] == after_1 != drawn == got[2]["rng.torch"]
    assert got[1]["optimizer.step"] == 1 and got[1]["state.data"] == digest({"seen": 5, "order": torch.arange(4)})
    assert got[2]["optimizer.step"] == 1       # step 2 made no update: its record says so


def test_each_component_is_recorded(tmp_path):
    model = models.two_layer()
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.25}])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    position = Position()
    gens = {"noise": np.random.default_rng(0), "drop": torch.Generator().manual_seed(1),
            "numpy": np.random.default_rng(2)}     # would hide NumPy's own: rng.generators.numpy
    with CheckpointManager(tmp_path, model, opt, sched, scaler, state={"data": position}, generators=gens,
                           every=None, handle_signals=False, digests=True) as mgr:
        for step in (1, 2):
            loss = model(models.inputs()).square().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            mgr.step(step, loss=loss.item())
    got = states(tmp_path)[2]
    assert set(got) == {"rng.python", "rng.numpy", "rng.torch", "rng.noise", "rng.drop", "rng.generators.numpy",
                        "scheduler", "amp.scaler", "state.data", "lr.0", "lr.1", "optimizer.step", "amp.scale",
                        "update.lr.0", "update.lr.1"}
    assert (got["lr.0"], got["lr.1"], got["optimizer.step"]) == (0.001 * 0.25, 0.25 * 0.25, 2)
    assert (got["update.lr.0"], got["update.lr.1"]) == (0.001 * 0.5, 0.25 * 0.5)    # what step 2's update used
    assert got["amp.scale"] == scaler.get_scale() == 256.0
    assert got["scheduler"] == digest(sched.state_dict()) and got["amp.scaler"] == digest(scaler.state_dict())
    assert got["rng.numpy"] == digest(np.random.get_state()) != got["rng.generators.numpy"]
    assert all(re.fullmatch("[0-9a-f]{16}", v) for k, v in got.items() if k.startswith(("rng.", "state.")))
    assert len({got[k] for k in RNG}) == len(RNG)      # five RNGs, five digests


def test_a_bit_exact_resume_writes_the_straight_runs_digests(runs):
    straight, resumed = runs["straight"][1], runs["resumed"][1]
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == straight
    assert len({s["rng.torch"] for s in straight.values()}) == STEPS     # they change every step


def test_a_restore_that_reseeds_parts_at_the_rngs_and_only_there(runs):
    straight, reseeded = runs["straight"][1], runs["reseeded"][1]
    assert all(reseeded[k] == straight[k] for k in range(1, CUT + 1))
    first = reseeded[CUT + 1]
    assert {k for k in first if first[k] != straight[CUT + 1][k]} == RNG


def test_the_history_readers_pass_over_the_field(runs, tmp_path):
    (straight, _), (resumed, _), (reseeded, _) = runs["straight"], runs["resumed"], runs["reseeded"]
    recs = list(timeline.canonical(str(straight / ".loss.json")))
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1)) and all("state" in r for r in recs)
    assert len(history.index(straight / ".loss.json")) == STEPS
    same = cli("bisect", str(straight), str(resumed), "--json")
    assert same.returncode == 0 and json.loads(same.stdout)["first_history_difference"] is None
    parted = cli("bisect", str(straight), str(reseeded), "--json")
    assert json.loads(parted.stdout)["first_history_difference"] == CUT + 1
    assert cli("plot", str(straight), "--out", str(tmp_path / "loss.png")).returncode == 0
    assert (tmp_path / "loss.png").stat().st_size > 1000
    listed = cli("ls", str(resumed), "--json")
    assert listed.returncode == 0, listed.stderr
    assert cli("validate", str(resumed)).returncode == 0


def test_off_by_default_and_a_metric_named_state_is_refused_only_when_on(tmp_path):
    model, opt = models.tiny_adamw()
    with CheckpointManager(tmp_path / "default", model, opt, every=None, handle_signals=False) as mgr:
        mgr.step(1, loss=0.5)
    assert states(tmp_path / "default") == {1: None}
    off = Loop(tmp_path / "off", digests=False)
    off.train(1, 1)
    off.mgr.step(2, state=1.5)
    off.mgr.close()
    assert states(tmp_path / "off") == {1: None, 2: 1.5}
    on = Loop(tmp_path / "on")
    with pytest.raises(ValueError, match="a metric named 'state' would hide the record's state digests"):
        on.mgr.step(1, state=1.5)
    on.mgr.close()
    assert not (tmp_path / "on" / ".loss.json").exists() or states(tmp_path / "on") == {}


def test_a_state_side_without_digests_is_refused_them(tmp_path):
    with pytest.raises(TypeError, match="SimpleNamespace computes no state digests"):
        StateManager(tmp_path, SimpleNamespace(), saving=SavePolicy(), retention=None, digests=True)
    assert not tmp_path.joinpath(".lock").exists()          # refused before the run is opened


def test_a_state_object_with_digest_every_is_digested_at_its_multiples(tmp_path):
    loop = Loop(tmp_path / "run")
    loop.position.digest_every = 2
    loop.train(1, 4)
    loop.position.digest_every = 0
    with pytest.raises(ValueError, match=r"state\.data\.digest_every must be a positive integer"):
        loop.mgr.step(5)
    loop.mgr.close()
    got = states(tmp_path / "run")
    assert ["state.data" in got[k] for k in (1, 2, 3, 4)] == [False, True, False, True]
    assert 5 not in got


def train(run: Path, steps: int, *extra: str):
    proc = warm.run([sys.executable, "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", str(steps),
                     "--checkpoint-every", str(CUT), "--sample-every", "0", "--device", "cpu", *extra],
                    capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(60)
def test_the_reference_trainer_records_them_with_state_digests(tmp_path):
    train(tmp_path / "straight", STEPS, "--state-digests")
    train(tmp_path / "resumed", CUT, "--state-digests")
    train(tmp_path / "resumed", STEPS, "--state-digests")
    straight = states(tmp_path / "straight")
    assert set(straight[1]) == {"rng.python", "rng.numpy", "rng.torch", "rng.bandit", "scheduler",
                                "state.data", "state.bandit", "lr.0", "update.lr.0", "optimizer.step"}
    assert states(tmp_path / "resumed") == straight


def test_a_digest_is_of_the_value_not_of_its_spelling():
    assert digest({"b": (1, 2), "a": None}) == digest({"a": None, "b": [1, 2]}) != digest({"a": None, "b": [2, 1]})
    assert digest({1: "x", "y": 2}) == digest({"y": 2, "1": "x"})         # keys of two types: all as text
    half = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert digest(half) != digest(half.float()) and digest(half) == digest(half.clone())
    assert digest({"t": torch.arange(6).reshape(2, 3)}) != digest({"t": torch.arange(6).reshape(3, 2)})
    assert digest(np.arange(6)[::2]) == digest(np.array([0, 2, 4]))      # the values, not the strides
    assert digest(float("nan")) == digest(float("nan")) != digest(float("inf"))


def test_a_frameworks_pieces_held_as_values_and_an_optimizer_the_layout_cannot_hold():
    """What the Lightning and Hugging Face callbacks give: a state held as a value digests as that
    value; no optimizer records no lr and no step; an optimizer the seed layout cannot hold (a
    Trainer's checkpoint holds any) records the steps its state counts, the loop's before it has any."""
    params = [torch.nn.Parameter(torch.ones(2))]
    rprop = torch.optim.Rprop(params, lr=0.5)
    found = state_digests(optimizer=None, pieces=[("state.trainer_state", Held({"epoch": 0.25}))], generators={},
                          scaler=None, step=4)
    assert found["state.trainer_state"] == digest({"epoch": 0.25}) and not {"lr.0", "optimizer.step"} & set(found)
    assert state_digests(optimizer=rprop, pieces=[], generators={}, scaler=None, step=7)["optimizer.step"] == 7
    for _ in range(2):
        params[0].sum().backward()
        rprop.step()
    found = state_digests(optimizer=rprop, pieces=[], generators={}, scaler=None, step=7)
    assert (found["lr.0"], found["optimizer.step"]) == (0.5, 2)
