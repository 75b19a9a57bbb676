"""examples/lightning_loop.py under the verify-resume protocol (spec/RUN.md §11): its mid-epoch
checkpoints (ModelCheckpoint every_n_train_steps, a resumable sampler) resume bit-exactly through
the ckptfmt plugin, with a diverging negative control; the same runs through Lightning's own
TorchCheckpointIO diverge. Each run is a process of its own, as the protocol asks (forked from the
warm parent, tests/warm.py)."""
from __future__ import annotations

import json
import os
import shlex
import sys

import pytest

pytest.importorskip("pytorch_lightning")

import warm                                         # noqa: E402
from ckptfmt.verify.protocol import check_pair      # noqa: E402
from verify_runs import once_per_session, verify_resume   # noqa: E402

# One worker for the module, where --dist loadgroup honours the mark (with pytest 9.2 it does not;
# the proof is made once in the session either way: verify_runs.once_per_session).
pytestmark = pytest.mark.xdist_group("lightning-example")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "lightning_loop.py")
STEPS, CUT = 18, 11          # 8 steps an epoch: the cut is mid-epoch, the rest crosses an epoch's end
COMMAND = f"{shlex.quote(sys.executable)} {shlex.quote(EXAMPLE)} --updates {{steps}} --output {{output}} {{resume}} {{omit_rng}}"


@pytest.fixture(scope="module")
def proof(tmp_path_factory):
    """verify-resume of the example through the ckptfmt plugin: (exit code, verdict, its directory),
    made once in the session for every test here, whichever worker runs it."""
    def make(folder):
        done = verify_resume("--output", folder / "verify", "--steps", STEPS, "--cut", CUT,
                             "--trainer", "command", "--command", COMMAND, "--json")
        return {"code": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
    folder, done = once_per_session(tmp_path_factory, "lightning-example-proof", make)
    assert done["stdout"].lstrip().startswith("{"), f"exit {done['code']}: {done['stdout'][-2000:]}{done['stderr']}"
    return done["code"], json.loads(done["stdout"]), folder / "verify"


@pytest.mark.timeout(60)
def test_verify_resume_of_the_lightning_example_passes_with_deviation_zero(proof):
    code, verdict, out = proof
    assert code == 0, verdict.get("failed_checks")
    assert verdict["all_checks_passed"] and verdict["failed_checks"] == []
    resume = verdict["checks"]["resume"]
    assert {"losses", "parameters", "optimizer", "buffers", "scheduler", "progress", "next_draws"} <= set(resume)
    assert all(c["ok"] and c["max_deviation"] == 0 for c in resume.values())
    cut = json.loads((out / "cut" / "summary.json").read_text())
    assert cut["checkpoint"] == f"step={CUT}.ckpt" and cut["final"]["progress"] == {"epoch": 1, "cursor": 3 * 12}
    assert sorted(os.listdir(out / "cut" / cut["checkpoint"])) == \
        [f"step_{CUT:06d}.bin", f"step_{CUT:06d}.extra.safetensors", f"step_{CUT:06d}.json"]


def test_the_tutorial_shows_the_proof_made_here():
    """docs/tutorials/lightning.md's verify-resume block is this module's run (the docs test does
    not run it: this is its twin): the same steps, cut and command template."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "tutorials", "lightning.md")).read()
    assert f"ckptfmt verify-resume --output proof --steps {STEPS} --cut {CUT} --trainer command" in text
    assert "--command 'python examples/lightning_loop.py --updates {steps} --output {output} {resume} {omit_rng}'" in text


@pytest.mark.timeout(60)
def test_the_resume_without_rng_restore_diverges(proof):
    _, verdict, _ = proof
    assert verdict["negative_divergence_detected"]
    control = verdict["checks"]["resume_without_rng"]
    assert control["sample_ids"]["ok"] and control["learning_rates"]["ok"]      # data and schedule resumed
    assert not control["losses"]["ok"] and not control["parameters"]["ok"]      # dropout drew otherwise


def run_example(output, updates: int, *extra: str) -> dict:
    argv = [sys.executable, EXAMPLE, "--updates", str(updates), "--output", str(output), *extra]
    done = warm.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((output / "summary.json").read_text())


@pytest.mark.timeout(60)
def test_the_same_resume_through_torch_checkpoint_io_diverges(proof, tmp_path):
    """Lightning's own CheckpointIO saves no RNG state: its mid-epoch resume of the same loop
    (the same continuous run: checkpointing draws nothing) takes the same batches and schedule,
    but dropout draws otherwise, and the weights drift."""
    _, _, out = proof
    continuous = json.loads((out / "continuous" / "summary.json").read_text())
    cut = run_example(tmp_path / "cut", CUT, "--io", "torch")
    assert os.path.isfile(tmp_path / "cut" / cut["checkpoint"])                   # a torch.save file
    resumed = run_example(tmp_path / "resume", STEPS - CUT, "--io", "torch", "--resume",
                          str(tmp_path / "cut" / cut["checkpoint"]))
    checks = check_pair(continuous, resumed, CUT, 1e-12, 0.0)
    assert checks["sample_ids"]["ok"] and checks["learning_rates"]["ok"] and checks["progress"]["ok"]
    assert {name for name, c in checks.items() if not c["ok"]} >= {"losses", "parameters", "optimizer", "next_draws"}
