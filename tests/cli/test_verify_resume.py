"""verify-resume: the protocol passes, each broken piece is caught by name, a toothless
negative control fails, and a protocol that cannot complete exits 2.

The protocol with the seed's defaults runs as a user runs it (the console entry point, every
trainer run a cold interpreter); the other protocols run in this process with their trainer runs
forked from the warm parent (tests/verify_runs.py), each still a process of its own."""
import json
import re
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import warm  # noqa: E402
from ckptfmt import manifest as mf  # noqa: E402
from ckptfmt.verify.protocol import Deviation, check_pair, compare  # noqa: E402
from conftest import ROOT, cli  # noqa: E402
from verify_runs import verify_resume  # noqa: E402


def verification(path):
    return json.loads((path / "verification.json").read_text())


@pytest.mark.timeout(60)
def test_mini_protocol_passes_with_zero_deviation(tmp_path):
    out = tmp_path / "proof"
    proc = cli("verify-resume", "--output", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    v = verification(out)
    assert v["positive"] and v["negative_divergence_detected"] and v["all_checks_passed"]
    assert all(c["max_deviation"] == 0 and c["ok"] for c in v["checks"]["resume"].values())
    assert v["checks"]["resume_without_rng"]["parameters"]["max_deviation"] > 1e-3
    for run in ("continuous", "cut", "resume", "resume-without-rng"):
        assert (out / run / "summary.json").exists() and v["checkpoints"][run]["blake3"]
    cont = json.loads((out / "continuous" / "summary.json").read_text())
    assert cont["final"]["scheduler"]["_last_lr"] == [0.00375]          # the seed's next lr after 10 steps
    assert [len(s["ids"]) for s in cont["steps"]] == [4] * 10
    cut = json.loads((out / "cut" / "summary.json").read_text())
    assert cut["final"]["progress"] == {"step": 5, "epoch": 0, "cursor": 20}    # mid-epoch, as in the seed


@pytest.mark.parametrize("fault,check", [("optimizer", "resume.optimizer"), ("scheduler", "resume.learning_rates"),
                                         ("cursor", "resume.sample_ids"), ("rng-python", "resume.next_draws"),
                                         ("rng-numpy", "resume.sample_ids"), ("rng-torch", "resume.next_draws")])
@pytest.mark.timeout(30)
def test_each_broken_piece_exits_1_and_names_its_check(tmp_path, fault, check):
    proc = verify_resume("--output", tmp_path / "p", "--fault", fault, "--json")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    result = json.loads(proc.stdout)
    assert not result["positive"] and check in result["failed_checks"], result["failed_checks"]


@pytest.mark.timeout(30)
def test_a_toothless_negative_control_fails(tmp_path):
    mini = f"{shlex.quote(sys.executable)} -B -m ckptfmt.trainer.mini --steps {{steps}} --output {{output}} {{resume}}"
    proc = verify_resume("--output", tmp_path / "p", "--trainer", "command", "--command", mini, "--json")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    result = json.loads(proc.stdout)
    assert result["positive"] and not result["negative_divergence_detected"]
    assert any("did not diverge" in f for f in result["failed_checks"])


@pytest.mark.timeout(30)
def test_andrea_protocol_with_a_real_sigterm(tmp_path):
    out = tmp_path / "proof"
    proc = verify_resume("--output", out, "--trainer", "andrea", "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    v = json.loads(proc.stdout)
    assert all(c["max_deviation"] == 0 for c in v["checks"]["resume"].values())
    assert v["checks"]["resume_without_rng"]["parameters"]["max_deviation"] > 1e-4
    events = [json.loads(x) for x in (out / "cut" / ".loss.json").read_text().splitlines()]
    assert any(e.get("event") == "checkpoint" and e.get("reason") == "SIGTERM" and e["step"] == 5 for e in events)


@pytest.mark.timeout(30)
def test_cannot_complete_exits_2(tmp_path):
    (tmp_path / "exists").mkdir()
    proc = cli("verify-resume", "--output", str(tmp_path / "exists"))
    assert proc.returncode == 2 and "exists already" in proc.stderr
    proc = cli("verify-resume", "--output", str(tmp_path / "p"), "--trainer", "command", "--command", "false {output}")
    assert proc.returncode == 2 and "exited 1" in proc.stderr
    proc = cli("verify-resume", "--output", str(tmp_path / "q"), "--steps", "5", "--cut", "5")
    assert proc.returncode == 2


def test_comparison_reports_structure_and_non_finite():
    d = Deviation()
    compare({"a": [1.0, 2.0], "b": 1}, {"a": [1.0], "c": 1}, "x", d, 0, 0)
    assert any("length" in s for s in d.structural) and any("keys differ" in s for s in d.structural)
    d = Deviation()
    assert compare([float("nan")], [float("nan")], "x", d, 1e-12, 0) and d.non_finite == ["x[0]"]
    ref = {"steps": [{"step": 6, "ids": [1], "lr": 0.1, "loss": 1.0}], "final": {"parameters": [1.0]}}
    cand = {"steps": [{"step": 6, "ids": [1], "lr": 0.1, "loss": 1.0}], "final": {}}
    result = check_pair(ref, cand, 5, 1e-12, 0)
    assert not result["parameters"]["ok"] and "missing" in result["parameters"]["structural"][0]


def mini(*args: str, cold: bool = False) -> subprocess.CompletedProcess:
    """``python -B -m ckptfmt.trainer.mini ARGS``: a cold interpreter, or forked from the warm parent."""
    start = subprocess.run if cold else warm.run
    return start([sys.executable, "-B", "-m", "ckptfmt.trainer.mini", *args], capture_output=True, text=True,
                 timeout=60)


# The trainer's entry point as ``python -m ckptfmt.trainer.mini`` runs it, for a warm child (run
# with -m, a module the warm parent has imported gets a warning from runpy on stderr).
MINI_MAIN = [sys.executable, "-B", "-c", "import sys; from ckptfmt.trainer.mini import main; sys.exit(main())"]


@pytest.mark.timeout(30)
def test_mini_runs_standalone_with_the_seed_flags(tmp_path):
    assert mini("--steps", "5", "--output", str(tmp_path / "cut")).returncode == 0
    ckpt = tmp_path / "cut" / "step_000005.bin"
    import blake3
    assert (tmp_path / "cut" / "step_000005.bin.b3").read_text() == \
        f"{blake3.blake3(ckpt.read_bytes()).hexdigest()}  step_000005.bin\n"
    assert mini("--steps", "5", "--resume", str(ckpt), "--output", str(tmp_path / "r")).returncode == 0
    assert (tmp_path / "r" / "step_000010.bin").exists()
    doc = json.loads(ckpt.with_suffix(".json").read_text())
    doc.pop("scheduler")
    mf.write(ckpt.with_suffix(".json"), doc)                  # a writer that sealed it without one
    proc = mini("--steps", "5", "--resume", str(ckpt), "--output", str(tmp_path / "r2"), cold=True)
    assert proc.returncode == 2 and "lacks scheduler" in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    existing = mini("--steps", "1", "--output", str(tmp_path / "r"))          # existing output refused
    assert existing.returncode == 2 and "exists already" in existing.stderr, existing.stderr


MINI_TAMPER = [  # (change to the cut's manifest, what the refusal names)
    ("d['code']['mini'] = '0' * 64", "code"),
    ("d['data']['identity']['rows'] = 25", "data.identity"),
    ("d['versions']['torch'] = '1.0'", "versions"),
    ("d['config']['lr'] = 0.5", "config"),
    ("d['progress']['step'] = 4", "progress"),
    ("d['data']['cursor'] = d['progress']['cursor'] = 99", "cursor"),
    ("d['data']['permutation'] = [0] * 24", "permutation"),
    ("del d['code']", "lacks code"),
    ("del d['versions']", "lacks versions"),
]


@pytest.mark.timeout(30)
def test_mini_refuses_an_inconsistent_resume_by_name(tmp_path):
    """Seed 001: the loader checks the progress, the versions and the identity of code and data,
    and refuses an inconsistent state (it resumed all of these; a cursor past the data was a
    traceback). A refused resume leaves no output directory behind."""
    run = lambda *a: warm.run([*MINI_MAIN, *a], capture_output=True, text=True, timeout=60)  # noqa: E731
    assert run("--steps", "5", "--output", str(tmp_path / "cut")).returncode == 0
    ckpt = tmp_path / "cut" / "step_000005.bin"
    original = ckpt.with_suffix(".json").read_text()
    for i, (change, named) in enumerate(MINI_TAMPER):
        d = json.loads(original)
        exec(change)
        mf.write(ckpt.with_suffix(".json"), d)         # sealed: what is refused is the state, not damage
        out = tmp_path / f"r{i}"
        proc = run("--steps", "5", "--resume", str(ckpt), "--output", str(out))
        assert (proc.returncode, "Traceback" in proc.stderr) == (2, False), (change, proc.stderr)
        assert named in proc.stderr and len(proc.stderr.splitlines()) == 1, (change, proc.stderr)
        assert not out.exists(), change
    d = json.loads(original)
    d["config"]["lr"] = 0.5
    ckpt.with_suffix(".json").write_text(json.dumps(d))     # edited after its seal: damage, named
    proc = run("--steps", "5", "--resume", str(ckpt), "--output", str(tmp_path / "edited"))
    assert proc.returncode == 2 and "field 'config' does not match the manifest's seal" in proc.stderr, proc.stderr
    ckpt.with_suffix(".json").write_text(original)
    assert run("--steps", "5", "--resume", str(ckpt), "--output", str(tmp_path / "ok")).returncode == 0


def test_the_console_says_why_a_check_with_no_deviation_failed(capsys):
    """A non-finite value or a structural difference fails a check whose max deviation is 0: the
    console line names it (it said 'resume FAIL (max dev 0)' and nothing more)."""
    from ckptfmt.cli.train import _print_verification
    ok = {"max_deviation": 0.0, "ok": True, "structural": [], "non_finite": []}
    r = {"trainer": "command", "steps": 10, "cut": 5, "atol": 1e-12, "rtol": 0.0, "positive": False,
         "negative_divergence_detected": True, "all_checks_passed": False,
         "failed_checks": ["resume.losses", "resume.steps"],
         "checks": {"resume": {"losses": {**ok, "ok": False, "non_finite": ["losses[4]"]},
                               "steps": {**ok, "ok": False, "structural": ["steps: length 5 != 6", "x"]}},
                    "resume_without_rng": {"losses": ok, "steps": ok}}}
    _print_verification(r)
    out = capsys.readouterr().out
    assert "resume FAIL (max dev 0; non-finite: losses[4])" in out
    assert "resume FAIL (max dev 0; structural: steps: length 5 != 6 (+1 more))" in out


RESUME_BUGS = f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'tests' / 'resume_bugs.py'))}"


@pytest.mark.timeout(60)
def test_a_loop_that_writes_no_summary_is_checked_piece_by_piece_from_its_run(tmp_path, capsys):
    """A loop on the manager that writes no summary.json (tests/resume_bugs.py): its run's history
    is the record, so the checks table has a row for every component the history records (each
    RNG, the data position, the lr, the optimizer's step, the scheduler, the loss) and for the
    final generation's weights, m and v; a broken piece fails its own row from the resume step on."""
    command = RESUME_BUGS + " --updates {steps} --output {output} {resume} {omit_rng}"
    proc = verify_resume("--output", tmp_path / "ok", "--trainer", "command", "--command", command,
                         "--steps", "6", "--cut", "3", "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    v = json.loads(proc.stdout)
    resume, negative = v["checks"]["resume"], v["checks"]["resume_without_rng"]
    assert list(resume) == ["steps", "rng.python", "rng.numpy", "rng.torch", "rng.noise", "state.data", "lr.0",
                            "update.lr.0", "optimizer.step", "scheduler", "loss", "weights", "m", "v"]
    assert list(negative) == list(resume) and list(v["checks"]["cut"]) == list(resume)[:-3]
    assert all(c["ok"] and c["max_deviation"] == 0 for c in resume.values())
    assert (negative["rng.torch"]["ok"], negative["rng.torch"]["first_difference"]) == (False, 4)
    assert negative["state.data"]["ok"] and not negative["weights"]["ok"]
    proc = verify_resume("--output", tmp_path / "bug", "--trainer", "command", "--command",
                         command.replace("--updates", "--bug cursor-off-by-one --updates"), "--steps", "6", "--cut", "3",
                         "--json")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    v = json.loads(proc.stdout)
    assert v["failed_checks"] == ["resume.state.data", "resume.loss", "resume.weights", "resume.m", "resume.v"]
    assert v["checks"]["resume"]["state.data"]["first_difference"] == 4
    from ckptfmt.cli.train import _print_verification
    _print_verification(v)
    assert re.search(r"state\.data +resume FAIL \(max dev 0; first at step 4\)", capsys.readouterr().out)


@pytest.mark.timeout(60)
def test_a_correct_loop_that_never_seeds_numpy_and_times_its_steps_passes(tmp_path, capsys):
    """A loop that never seeds (nor draws from) NumPy's and Python's global RNGs: their digests
    differ from the first record on while the loss agrees, a difference of the runs, left out by
    bisect's rule and said; its timing metric fails until ``--ignore step_s`` leaves it out."""
    command = RESUME_BUGS + " --unseeded --updates {steps} --output {output} {resume} {omit_rng}"
    args = ("--trainer", "command", "--command", command, "--steps", "6", "--cut", "3", "--json")
    proc = verify_resume("--output", tmp_path / "timed", *args)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    assert json.loads(proc.stdout)["failed_checks"] == ["resume.metric.step_s", "cut.metric.step_s"]
    proc = verify_resume("--output", tmp_path / "ok", *args, "--ignore", "step_s")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    v = json.loads(proc.stdout)
    assert v["left_out"] == {"ignored": ["step_s"], "from_start": ["rng.python", "rng.numpy"]}
    assert "rng.numpy" not in v["checks"]["resume"] and "metric.step_s" not in v["checks"]["resume"]
    assert not v["checks"]["resume_without_rng"]["rng.torch"]["ok"]
    from ckptfmt.cli.train import _print_verification
    _print_verification(v)
    assert "left out: rng.python, rng.numpy (differ from the first record on" in capsys.readouterr().out
