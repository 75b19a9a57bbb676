"""benchmarks/gpu_check.py's plumbing on the CPU: the GPU machine gives
one try of a few minutes, so what can go wrong without a GPU is proven here with ``--dry-run``:
the stages' verdicts, budgets that cut a stage and keep what it had, the report rewritten after
every stage, a trainer's error reaching the log, a SIGTERM to the driver, and the refusal to run
without CUDA. (The full dry run, every stage, is the command in benchmarks/README.md "GPU"; here
a subset keeps the module near a minute on two cores.)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402  (benchmarks/ is no package)
from verify_runs import once_per_session  # noqa: E402

# One worker for the module, where --dist loadgroup honours the mark (with pytest 9.2 it does not;
# the clean run is made once in the session either way: verify_runs.once_per_session).
pytestmark = pytest.mark.xdist_group("gpu-check")
NAMES = [s.name for s in gpu_check.STAGES]
CLEAN = ("environment", "save_digests", "resume_tiny_bf16", "throughput_limits")


def check(out: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], capture_output=True,
                          text=True, timeout=400, env=env)


def only(*names: str) -> list[str]:
    return [arg for name in names for arg in ("--only", name)]


def report(out: Path) -> dict:
    return json.loads((out / "gpu_check.json").read_text())


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The dry run of the CLEAN stages, made once in the session for every test that reads it,
    whichever worker runs it."""
    def make(out):
        done = check(out, "--dry-run", *only(*CLEAN))
        return [done.args, done.returncode, done.stdout, done.stderr]
    out, done = once_per_session(tmp_path_factory, "gpu-check-clean", make)
    return subprocess.CompletedProcess(*done), report(out), (out / "gpu_check.log").read_text()


@pytest.mark.timeout(120)
def test_the_dry_run_passes_every_stage_it_ran(clean):
    proc, doc, _ = clean
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert doc["mode"] == "dry-run" and doc["finished"] and doc["exit_code"] == 0
    assert list(doc["stages"]) == NAMES
    expected = {"environment": "passed", "save_digests": "passed", "resume_tiny_bf16": "passed",
                "throughput_limits": "done"}
    assert {k: v["status"] for k, v in doc["stages"].items()} == {n: expected.get(n, "skipped") for n in NAMES}
    assert all(v["reason"] == "not selected (--only)" for k, v in doc["stages"].items() if k not in CLEAN)
    assert [line.split("] ")[1].split(":")[0] for line in proc.stdout.splitlines()] == \
        [n for n in NAMES if n not in CLEAN] + list(CLEAN)     # the caller's skips first, then each stage


@pytest.mark.timeout(120)
def test_every_save_matches_its_independent_hash_and_bytes(clean):
    stage = clean[1]["stages"]["save_digests"]
    assert stage["saves_planned"] == 5 and [s["step"] for s in stage["saves"]] == [1, 2, 3, 4, 5]
    assert all(s["digest_matches_manifest"] and s["file_matches_digest"] and s["bytes_match"]
               for s in stage["saves"])
    assert stage["mismatched_steps"] == [] and stage["bytes"] == 8 + 12 * stage["n_params"]


@pytest.mark.timeout(120)
def test_resume_controls_give_the_first_divergent_step_and_the_resume_step(clean):
    _, doc, log = clean
    stage = doc["stages"]["resume_tiny_bf16"]
    cut, controls = stage["cut"], stage["controls"]
    assert stage["runs"]["cut"]["exit"] == 0 and stage["cut_committed"]
    assert controls["straight-2"] == {"first_divergent_step": None, "resumed_from": None,
                                      "generations_compared": [4, 8, 12], "final_identical": True}
    assert controls["resume"] == {"first_divergent_step": None, "resumed_from": cut,
                                  "generations_compared": [4, 8, 12], "final_identical": True}
    negative = controls["negative-control"]
    assert negative["resumed_from"] == cut and negative["first_divergent_step"] == cut + 1
    assert not negative["final_identical"]
    assert f"resumed from step_{cut:06d}.bin" in log and f"stopped at step {cut}" in log   # the trainers' stderr


@pytest.mark.timeout(120)
def test_cuda_only_figures_are_recorded_as_skipped(clean):
    doc = clean[1]
    limits = doc["stages"]["throughput_limits"]
    assert limits["skipped"] == {"d2h_pinned": "needs CUDA", "h2d_pinned": "needs CUDA"}
    assert set(limits["gbps"]) == {"blake3_1_thread", "blake3_all_cores", "write_fsync"}
    assert doc["summary"]["save_floor_gbps"] == min(limits["gbps"]["blake3_all_cores"], limits["gbps"]["write_fsync"])


@pytest.mark.timeout(30)
def test_an_over_budget_stage_is_cut_and_a_failing_trainer_reaches_the_log(tmp_path):
    out = tmp_path / "out"
    proc = check(out, "--dry-run", *only("save_digests", "resume_tiny_fp16", "throughput_limits"),
                 "--budget", "save_digests=0.5", "--inject-failure", "resume_tiny_fp16")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    doc = report(out)
    assert doc["exit_code"] == 2 and doc["finished"]
    cut = doc["stages"]["save_digests"]
    assert cut["status"] == "timed_out" and cut["reason"] == "over its budget of 0.5 s: killed" and "had" in cut
    failed = doc["stages"]["resume_tiny_fp16"]
    assert failed["status"] == "error" and failed["runs"]["straight-1"]["exit"] == 2
    assert failed["reason"].startswith("trainer run straight-1 exited 2: ") and "No such option" in failed["reason"]
    assert any("No such option '--no-such-option'" in line for line in failed["stderr_tail"])
    assert doc["stages"]["throughput_limits"]["status"] == "done"          # later stages still ran
    log = (out / "gpu_check.log").read_text()
    assert "== save_digests: timed_out" in log and "== resume_tiny_fp16: error" in log
    assert "-- straight-1: the trainer's stderr" in log and "No such option '--no-such-option'" in log


def _processes_under(folder: Path) -> list[str]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(folder) in cmd:
            found.append(cmd)
    return found


@pytest.mark.timeout(30)
def test_the_report_is_complete_after_each_stage_and_survives_sigterm(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(out), "--work", str(work), "--dry-run",
                             *only("environment", "resume_tiny_bf16", "throughput_limits")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = None
    for _ in range(4000):                 # until the resume stage's trainers run (or the driver ends)
        if proc.poll() is not None:
            break
        if list(work.glob("*/resume_tiny_bf16/run-cut.log")):
            seen = report(out)            # replaced atomically: always whole
            break
        time.sleep(0.05)
    assert seen is not None, proc.communicate()
    assert seen["stages"]["environment"]["status"] == "passed" and not seen["finished"]
    assert seen["stages"]["resume_tiny_bf16"]["status"] == "pending"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 2
    doc = report(out)
    assert doc["finished"] and doc["exit_code"] == 2
    cut = doc["stages"]["resume_tiny_bf16"]
    assert cut["status"] == "timed_out" and cut["reason"] == "interrupted by SIGTERM while it ran"
    assert cut["had"]["cut"] == 7
    assert doc["stages"]["throughput_limits"] == {"what": gpu_check.BY_NAME["throughput_limits"].what,
                                                  "status": "skipped", "reason": "interrupted by SIGTERM"}
    for _ in range(100):                  # the stage and its trainers were killed (init reaps them)
        if not _processes_under(work):
            break
        time.sleep(0.1)
    assert _processes_under(work) == []


@pytest.mark.timeout(30)
def test_without_cuda_it_does_not_run(tmp_path):
    out = tmp_path / "out"
    proc = check(out, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "gpu_check: no CUDA device here (--dry-run runs the stages' plumbing on the CPU)\n"
    assert not out.exists()
    bad = check(out, "--dry-run", "--budget", "nosuch=3")
    assert bad.returncode == 2 and "--budget nosuch=3: unknown stage 'nosuch'" in bad.stderr
    assert not out.exists()


def _run(folder: Path, losses: dict, generations: dict, resumed_from: int | None = None) -> Path:
    """A run directory as the trainer leaves it, reduced to what the comparison reads."""
    folder.mkdir()
    lines = [{"step": step, "loss": loss} for step, loss in losses.items()]
    if resumed_from is not None:
        lines.insert(resumed_from, {"event": "resume", "step": resumed_from})
    (folder / ".loss.json").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for step, digest in generations.items():
        (folder / f"step_{step:06d}.json").write_text(json.dumps({"step": step, "blake3": digest}))
        (folder / f"step_{step:06d}.bin").write_bytes(b"")
    return folder


def test_a_divergence_is_found_at_its_first_step_and_fails_the_check(tmp_path):
    """What a GPU would report when a resume is not exact (exit 1), from run directories made here."""
    import gpu_report
    import gpu_resume
    losses = {s: 1.0 / s for s in range(1, 7)}
    gens = {2: "a", 4: "b", 6: "c"}
    ref = _run(tmp_path / "ref", losses, gens)
    same = _run(tmp_path / "same", losses, gens)
    late_loss = _run(tmp_path / "late", {**losses, 5: 0.5}, {**gens, 6: "x"}, resumed_from=3)
    bad_generation = _run(tmp_path / "gen", losses, {**gens, 4: "y"}, resumed_from=3)
    assert gpu_resume.compare(ref, same, 6) == {"first_divergent_step": None, "resumed_from": None,
                                               "generations_compared": [2, 4, 6], "final_identical": True}
    assert gpu_resume.compare(ref, late_loss, 6)["first_divergent_step"] == 5
    assert gpu_resume.compare(ref, late_loss, 6)["resumed_from"] == 3
    assert gpu_resume.compare(ref, bad_generation, 6)["first_divergent_step"] == 4
    found = {"straight-2": gpu_resume.compare(ref, same, 6), "resume": gpu_resume.compare(ref, late_loss, 6),
             "negative-control": gpu_resume.compare(ref, _run(tmp_path / "neg", losses, gens, resumed_from=3), 6)}
    failed, line = gpu_resume.verdict(found, 3, cut_committed=True)
    assert failed == ["resume identical to straight-1", "negative control diverges after the cut"]
    assert line == "straight-2: no divergence; resume from 3: 5; negative control from 3: first divergent step None"
    stages = {"a": {"status": "passed"}, "b": {"status": "failed"}, "c": {"status": "timed_out"}}
    assert gpu_report.exit_code(stages) == 1
    assert gpu_report.exit_code({"a": {"status": "passed"}, "c": {"status": "timed_out"}}) == 2
    assert gpu_report.exit_code({"a": {"status": "done"}, "d": {"status": "skipped", "reason": "--stop-after a"}}) == 0
