"""The run layer's session drives a loop's saves without torch: a loop of plain NumPy arrays
saves through it into a real run directory, and each commit is followed by retention, then the
loop's hook, then the mirror, in that order."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptfmt import reader
from ckptfmt.errors import ConfigMismatchError, RunLockedError
from ckptfmt.run import Policy, SavePolicy, list_dir, roots
from ckptfmt.run.hooks import Hooks
from ckptfmt.run.session import Session

N = 4


def on_disk(path: Path) -> list[int]:
    return [g.step for g in list_dir(path).generations if g.committed]


class ArrayLoop:
    """A loop's state in plain Python: its weights, m and v as float32 arrays, committed
    through the session's run when the session asks (its ``write``)."""

    def __init__(self, order: list[tuple[str, int, list[int]]]):
        self.weights, self.m, self.v = (np.arange(N, dtype=np.float32) * k for k in (1, 2, 3))
        self.order = order
        self.session: Session | None = None

    def write(self, step: int) -> None:
        s = self.session
        manifest = {"progress": {"step": step}, "metrics": s.metrics.at(step)}
        s.run.commit(step, self.weights + step, self.m, self.v, manifest=manifest, n_params=N,
                     before_commit=lambda doc: s.intent(step, roots.of(doc)))
        self.order.append(("commit", step, on_disk(s.run.path)))
        s.after_commit(step, manifest)


class Synchronous:
    """A writer whose saves are committed when ``write`` returns."""

    last_stall_s = 0.0

    def then(self, action: Any) -> None:
        action()

    def poll(self) -> None:
        pass

    def wait(self) -> None:
        pass


class CopyMirror:
    """A mirror into another directory: after each commit it holds the run's committed
    generations, as they are then."""

    def __init__(self, run: Path, there: Path, order: list[tuple[str, int, list[int]]]):
        self.run, self.there, self.order = run, there, order
        there.mkdir()

    def on_commit(self, step: int, manifest: dict[str, Any]) -> None:
        for old in self.there.iterdir():
            old.unlink()
        for gen in list_dir(self.run).generations:
            if gen.committed:
                for path in (gen.path, gen.path.with_suffix(".json")):
                    shutil.copy2(path, self.there / path.name)
        self.order.append(("mirror", step, on_disk(self.there)))

    def close(self) -> dict[str, Any]:
        return {"url": str(self.there), "errors": []}


def test_a_plain_loop_saves_through_the_session_commit_retention_hooks_mirror(tmp_path):
    order: list[tuple[str, int, list[int]]] = []
    loop, run = ArrayLoop(order), tmp_path / "run"
    logs: list[str] = []
    hooks = Hooks(on_commit=lambda step, doc: order.append(("hook", step, on_disk(run))), log=logs.append)
    session = Session(run, write=loop.write, writer=lambda s: Synchronous(), saving=SavePolicy(every=2),
                      retention=Policy.by_count(2), hooks=hooks,
                      mirror=lambda s: CopyMirror(s.run.path, tmp_path / "mirror", order))
    loop.session = session
    with pytest.raises(RunLockedError):          # the session holds the run's writer lock
        Session(run, write=loop.write, writer=lambda s: Synchronous(), saving=SavePolicy(), retention=None)
    stops = []
    for step in range(1, 6):
        if step == 3:
            session.request_save()               # what SIGUSR1 sets
        stops.append(session.step(step, {"loss": 1.0 / step})[0])
    with pytest.raises(ConfigMismatchError, match="step 5 is not after step 5"):
        session.step(5, {})
    session.close(6)
    assert stops == [False] * 5 and session.closed
    steps = [(kind, step) for kind, step, _ in order]
    assert steps == [(kind, step) for step in (2, 3, 4, 6) for kind in ("commit", "hook", "mirror")]
    seen = {(kind, step): held for kind, step, held in order}
    assert seen[("commit", 4)] == [2, 3, 4]     # committed: retention has not run yet
    assert seen[("hook", 4)] == seen[("mirror", 4)] == [3, 4]    # retention ran before the hook and the mirror
    assert on_disk(run) == on_disk(tmp_path / "mirror") == [4, 6]
    with reader.open(run / "step_000006.bin", verify=True) as ckpt:
        np.testing.assert_array_equal(ckpt.weights, np.arange(N, dtype=np.float32) + 6)
    events = [(e["event"], e["step"], e.get("reason")) for e in session.run.history.read().events()
              if e["event"] == "checkpoint"]
    assert events == [("checkpoint", 2, "cadence"), ("checkpoint", 3, "SIGUSR1"), ("checkpoint", 4, "cadence"),
                      ("checkpoint", 6, "close")]
    assert [r["step"] for r in session.run.history.read().canonical()] == [1, 2, 3, 4, 5]
    again = Session(run, write=loop.write, writer=lambda s: Synchronous(), saving=SavePolicy(), retention=None)
    again.close()                               # close gave the lock back


def test_a_stop_request_commits_the_step_and_says_stop(tmp_path):
    order: list[tuple[str, int, list[int]]] = []
    loop = ArrayLoop(order)
    session = Session(tmp_path / "run", write=loop.write, writer=lambda s: Synchronous(),
                      saving=SavePolicy(every=None), retention=None, handle_signals=False)
    loop.session = session
    assert session.step(1, {}) == (False, False)
    session.request_stop("SIGINT")
    assert session.step(2, {}) == (True, True) and session.last_save == (2, "SIGINT")
    session.close(2)                            # committed already: nothing more
    assert [(kind, step) for kind, step, _ in order] == [("commit", 2)]


def test_the_session_imports_no_torch():
    blocked = "import sys; sys.modules['torch'] = None; import ckptfmt.run.session, ckptfmt.run.collective"
    assert subprocess.run([sys.executable, "-c", blocked], capture_output=True, timeout=60).returncode == 0


class Reported:
    """A mirror whose close reports what ``report`` says."""

    def __init__(self, **report: Any):
        self.report = {"url": "file:///there", "errors": [], **report}

    def on_commit(self, step: int, manifest: dict[str, Any]) -> None:
        pass

    def close(self) -> dict[str, Any]:
        return self.report


@pytest.mark.parametrize("report, said", [
    ({"errors": ["refused"], "failed": False}, []),       # a failed pass, then one that caught up
    ({"errors": ["refused"], "failed": True}, ["mirror to file:///there is behind RUN: refused"]),
    ({"errors": ["refused"]}, ["mirror to file:///there is behind RUN: refused"]),   # no failed: the errors say
])
def test_at_close_the_session_says_a_mirror_behind_once_and_a_caught_up_one_not(tmp_path, report, said):
    logs: list[str] = []
    session = Session(tmp_path / "run", write=None, writer=None, saving=SavePolicy(), retention=None,
                      hooks=Hooks(log=logs.append), handle_signals=False, mirror=lambda s: Reported(**report))
    session.close()
    assert logs == [m.replace("RUN", str(tmp_path / "run")) for m in said]
