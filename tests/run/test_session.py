"""The run layer's session drives a loop's saves without torch: a loop of plain NumPy arrays
saves through it into a real run directory, and each commit is followed by retention, then the
loop's hook, then the mirror, in that order. A NumPy state side (``StateSide``) saves, is
retained and resumes bit-exactly through the generic manager, the one manifest writer and the
one restore order that the torch manager goes through too, where torch cannot be imported."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptfmt import reader
from ckptfmt.errors import ConfigMismatchError, LayoutMismatchError, RunLockedError, UnsupportedSetupError
from ckptfmt.run import Policy, SavePolicy, list_dir, resuming, roots
from ckptfmt.run.collective import OneProcess
from ckptfmt.run.hooks import Hooks
from ckptfmt.run.session import Session
from ckptfmt.run.statemanager import StateManager
from ckptfmt.run.stateside import ArrayWriter

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


class ArraySide:
    """A state side of plain NumPy arrays (``ckptfmt.run.stateside.StateSide``), as a JAX loop's
    state is once on the host: weights, m and v in the ``.bin``, a count per class in the
    companion file, its generator's state in the manifest. ``train`` is an Adam-like step."""

    collective = OneProcess()

    def __init__(self, seed: int, dtype: Any = np.float32):
        self.rng = np.random.default_rng(seed)
        self.weights, self.m, self.v = (self.rng.standard_normal(N).astype(dtype) for _ in range(3))
        self.v = abs(self.v)
        self.seen = np.zeros(3, dtype=np.int64)

    def train(self, step: int) -> float:
        grad = self.rng.standard_normal(N).astype(np.float32)
        self.m = np.float32(0.9) * self.m + np.float32(0.1) * grad
        self.v = np.float32(0.99) * self.v + np.float32(0.01) * grad * grad
        self.weights = self.weights - np.float32(0.01) * self.m / (np.sqrt(self.v) + np.float32(1e-8))
        self.seen[step % 3] += 1
        return float(np.mean(self.weights ** 2))

    def snapshot(self) -> list[Any]:
        return [a.tobytes() for a in (self.weights, self.m, self.v, self.seen)] + [self.rng.bit_generator.state]

    def versions(self) -> dict[str, str]:
        return {}

    def refuse(self) -> None:
        for name in ("weights", "m", "v"):
            if getattr(self, name).dtype != np.float32:
                raise UnsupportedSetupError(None, f"{name} is {getattr(self, name).dtype}: the layout holds float32")

    def writer(self, session: Session) -> ArrayWriter:
        return ArrayWriter.of(session)

    def capture(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"counts": "seen", "rng": self.rng.bit_generator.state}, {"seen": self.seen.copy()}

    def commit(self, writer: ArrayWriter, step: int, manifest: dict[str, Any], extra: dict[str, Any]) -> None:
        writer.write(step, (self.weights, self.m, self.v), manifest, extra)

    def choose(self, run: Any, allow_nonfinite: bool) -> dict[str, Any]:
        return resuming.choose_here(run, allow_nonfinite)

    def plan(self, at: Any, ck: Any, doc: dict[str, Any]) -> tuple[Any, ...]:
        if ck.n_params != N:
            raise LayoutMismatchError(ck.path, f"{ck.n_params} parameters in the checkpoint, {N} in the loop")
        return np.array(ck.weights), np.array(ck.m), np.array(ck.v), np.array(ck.companion().tensor("seen")), doc["rng"]

    def load(self, at: Any, ck: Any, plan: tuple[Any, ...]) -> list[str]:
        self.weights, self.m, self.v, self.seen, self.rng.bit_generator.state = plan
        return []


def array_manager(run: Path, side: ArraySide, **hooks: Any) -> StateManager:
    return StateManager(run, side, saving=SavePolicy(every=2), retention=Policy.by_count(2), config={"lr": 0.01},
                        hooks=Hooks(**hooks), handle_signals=False)


def numpy_side_round_trip(tmp_path: Path) -> None:
    """A NumPy state side saves every 2 steps keeping 2, and a loop of other values resumes it
    bit-exactly and goes on as the straight run does (run again where torch cannot be imported)."""
    run, straight = tmp_path / "run", ArraySide(0)
    with array_manager(run, straight) as mgr:
        assert mgr.restore() == 0
        for step in range(1, 6):
            assert not mgr.step(step, loss=straight.train(step))
        at_5 = straight.snapshot()
        mgr.close(5)
    assert on_disk(run) == [4, 5]                             # retention ran after each commit
    doc = json.loads((run / "step_000005.json").read_text())  # the fields every manifest has
    assert sorted(doc["versions"]) == ["ckptfmt", "numpy", "python"] and doc["progress"] == {"step": 5}
    assert doc["config"] == {"lr": 0.01} and doc["metrics"]["loss"]["step"] == 5 and doc["created"] > 0
    resumed = ArraySide(1)
    assert resumed.snapshot() != at_5
    with array_manager(run, resumed) as mgr:
        assert mgr.restore() == 5 and mgr.restored_from == str(run / "step_000005.bin")
        assert resumed.snapshot() == at_5 and mgr.metric("loss") == doc["metrics"]["loss"]["value"]
        for step in (6, 7):
            assert not mgr.step(step, loss=resumed.train(step))
            straight.train(step)
        assert resumed.snapshot() == straight.snapshot()
    events = [(e["event"], e["step"]) for e in mgr.run.history.read().events() if e["event"] in ("start", "resume")]
    assert events == [("start", 0), ("resume", 5)]
    with reader.open(run / "step_000006.bin", verify=True) as ckpt:
        assert ckpt.companion().tensor("seen").tolist() == [2, 2, 2]


def test_a_numpy_state_side_saves_is_retained_and_resumes_bit_exactly_through_the_generic_manager(tmp_path):
    numpy_side_round_trip(tmp_path)


def test_the_session_and_a_numpy_state_side_need_no_torch(tmp_path):
    """The session, the generic manager and the NumPy round trip, where ``import torch`` fails."""
    code = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1]); "
            "import ckptfmt.run.session, ckptfmt.run.collective, test_session; "
            "from pathlib import Path; test_session.numpy_side_round_trip(Path(sys.argv[2])); "
            "assert 'ckptfmt.torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(tmp_path)],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_one_manifest_writer_refuses_what_no_state_side_may_write(tmp_path):
    """A ``manifest_fields`` hook that names a field already written, and a capture that holds
    a field every manifest has, are refused before a byte is written; so is state the side
    cannot store, when the manager is built."""
    with array_manager(tmp_path / "a", ArraySide(0), manifest_fields=lambda step: {"created": 0}) as mgr:
        with pytest.raises(ValueError, match="manifest_fields: 'created' is a field the manager writes"):
            mgr.save(1)
        mgr.session.committed = 1                             # nothing to commit at close
    side = ArraySide(0)
    side.capture = lambda step: ({"progress": {}}, {})        # type: ignore[method-assign]
    with array_manager(tmp_path / "b", side) as mgr:
        with pytest.raises(ValueError, match=r"capture holds \['progress'\]"):
            mgr.save(1)
        mgr.session.committed = 1
    assert on_disk(tmp_path / "a") == on_disk(tmp_path / "b") == []
    with pytest.raises(UnsupportedSetupError, match="weights is float64"):
        array_manager(tmp_path / "c", ArraySide(0, dtype=np.float64))
    assert not (tmp_path / "c").exists()                      # refused before the run was opened


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
