"""The root a writer commits is in the run's history before its manifest is (spec/RUN.md §3.7):
a kill between the commit and its ``checkpoint`` event, after the run fell back past that step
and committed it again, must not make the next start pass over the new generation, and a
``validate`` of the live run in that moment must not call it another's."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ckptfmt.run import Run, roots  # noqa: E402
from ckptfmt.run import history as hist  # noqa: E402
from ckptfmt.torch import CheckpointManager  # noqa: E402
from conftest import cli  # noqa: E402
from models import tiny_adamw, train_steps  # noqa: E402


class Killed(BaseException):
    """A kill at one point of the manager's work: nothing after it runs."""


def train(m, model, opt, first, last):
    for step in range(first, last + 1):
        m.step(step, loss=train_steps(model, opt, 1).item())


def flip(path, at=-5):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_step_committed_again_after_a_fallback_survives_a_kill_before_its_checkpoint_event(
        tmp_path, monkeypatch, async_save):
    run = tmp_path / "r"
    model, opt = tiny_adamw(lr=0.1)
    with CheckpointManager(run, model, opt, every=5, handle_signals=False) as m:
        m.restore()
        train(m, model, opt, 1, 10)
        m.close(10)
    before = roots.recorded(run / hist.NAME)[10]
    flip(run / "step_000010.bin")                             # damaged after its commit: the run falls back
    model, opt = tiny_adamw(lr=0.2)                             # another timeline: another generation 10
    m = CheckpointManager(run, model, opt, every=5, handle_signals=False, async_save=async_save)
    with pytest.warns(UserWarning, match="skipping generation 10"):
        assert m.restore() == 5
    from ckptfmt.run.session import Session
    event = Session.event

    def killed_at_the_checkpoint_event(self, kind, step, **fields):
        if kind == "checkpoint" and step == 10:
            raise Killed
        return event(self, kind, step, **fields)
    monkeypatch.setattr(Session, "event", killed_at_the_checkpoint_event)
    with pytest.raises(Killed):
        train(m, model, opt, 6, 10)
        m.close(10)
    now = roots.of_step(run, 10)
    assert now != before and roots.recorded(run / hist.NAME)[10] == now
    done = cli("validate", str(run))                           # the writer still holds the run: live
    assert done.returncode == 0 and "not the generation" not in done.stdout, done.stdout
    assert Run(run).latest(deep=True).step == 10
