"""The reference trainer in fresh processes with real signals."""
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

import ckptfmt  # noqa: E402
from ckptfmt.run import history as hist  # noqa: E402
from ckptfmt.run import Run  # noqa: E402
from ckptfmt.tools.validate import validate_run  # noqa: E402

from conftest import commit_rewritten, last_step, without_root_digests  # noqa: E402
import warm  # noqa: E402

PY = sys.executable
N = 120


def cmd(run, steps, *extra):
    return [PY, "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", str(steps), "--config", "tiny",
            "--checkpoint-every", "20", "--sample-every", "25", "--log-every", "100000", *map(str, extra)]


def train(run, steps, *extra, **kw):
    return warm.run(cmd(run, steps, *extra), capture_output=True, text=True, timeout=300, **kw)


def start(run, steps, *extra):
    return warm.Popen(cmd(run, steps, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(pred, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)


def gens(run: Path) -> list:
    """Committed generations (a .bin may exist before its manifest commits)."""
    return [g for g in Run(run).generations() if g.committed] if run.is_dir() else []


def canonical(run):
    keep = ("step", "loss", "loss_ema", "lr", "source", "tokens")
    return [{k: r[k] for k in keep} for r in hist.read(run / ".loss.json").canonical()]


def resumes_past_60_bit_exact(run, straight, why):
    """``train`` to N skips generation 60 saying ``why``, resumes from 40, commits 60 again and
    ends byte-identical to the straight run, history included; the run then validates."""
    proc = train(run, N)
    assert proc.returncode == 0, proc.stderr
    assert f"skipping generation 60: {why}" in proc.stderr
    assert "resumed from step_000040.bin" in proc.stderr
    assert final(run, 60) == final(straight, 60) and final(run) == final(straight)
    assert canonical(run) == canonical(straight)[:N]
    assert validate_run(run).ok


def final(run, step=N):
    return ckptfmt.open(run / f"step_{step:06d}.bin", verify=True).fingerprint()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = train(run, N)
    assert proc.returncode == 0, proc.stderr
    return run


def test_steps_n_always_leaves_step_n(straight):
    assert [g.step for g in Run(straight).generations()] == [20, 40, 60, 80, 100, 120]
    proc = train(straight, 130)
    assert proc.returncode == 0 and Run(straight).latest().step == 130


def test_sigterm_and_resume_is_byte_identical(tmp_path, straight):
    run = tmp_path / "run"
    proc = start(run, N)
    wait_for(lambda: last_step(run) >= 37, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    cut = Run(run).latest().step
    assert cut % 20 != 0 or cut != 40, "cut should land between checkpoints"
    assert "after the signal" in err
    proc = train(run, N)
    assert proc.returncode == 0, proc.stderr
    assert final(run) == final(straight)
    assert canonical(run) == canonical(straight)[:N]


def test_sigkill_and_resume_is_byte_identical(tmp_path, straight):
    run = tmp_path / "run"
    proc = start(run, N)
    wait_for(lambda: last_step(run) >= 55, proc)
    proc.kill()
    proc.wait()
    proc = train(run, N)
    assert proc.returncode == 0, proc.stderr
    assert final(run) == final(straight)
    assert canonical(run) == canonical(straight)[:N]
    assert validate_run(run).ok


def test_async_save_writes_the_same_bytes(tmp_path, straight):
    run = tmp_path / "run"
    proc = train(run, N, "--async-save")
    assert proc.returncode == 0, proc.stderr
    for s in (20, 60, 120):
        assert final(run, s) == final(straight, s)


def test_sigusr1_checkpoints_and_training_continues(tmp_path):
    run = tmp_path / "run"
    proc = start(run, 100000, "--checkpoint-every", "100000")
    try:
        wait_for(lambda: last_step(run) >= 30, proc)
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: gens(run), proc)
        gen = Run(run).latest()
        at = last_step(run)
        wait_for(lambda: last_step(run) >= at + 20, proc)       # still training
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert gen.step >= 30 and validate_run(run).ok
    reasons = [e.get("reason") for e in hist.read(run / ".loss.json").events() if e["event"] == "checkpoint"]
    assert reasons[0] == "SIGUSR1" and reasons[-1] == "SIGTERM"


def test_a_sigusr1_checkpoint_under_retention_says_how_to_keep_it(tmp_path):
    """Seed 000: SIGUSR1 captures a known good moment; retention counts it like any other
    generation (a timer sending SIGUSR1 would otherwise fill the disk), so the log says how to
    pin it."""
    run = tmp_path / "run"
    proc = start(run, 100000, "--checkpoint-every", "10", "--keep-last", "1")
    try:
        wait_for(lambda: last_step(run) >= 13, proc)
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: any(e.get("reason") == "SIGUSR1" for e in hist.read(run / ".loss.json").events()), proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    step = next(e["step"] for e in hist.read(run / ".loss.json").events() if e.get("reason") == "SIGUSR1")
    assert f"step {step}: checkpoint (SIGUSR1)" in err
    assert f"; retention counts it: to keep it, ckptfmt pin {run} {step}\n" in err


def test_a_storm_of_sigusr1_leaves_only_valid_files(tmp_path):
    run = tmp_path / "run"
    proc = start(run, 100000, "--checkpoint-every", "100000", "--keep-last", "3")
    rng = random.Random(7)
    try:
        wait_for(lambda: last_step(run) >= 5, proc)
        for _ in range(40):
            proc.send_signal(signal.SIGUSR1)
            time.sleep(rng.uniform(0, 0.03))
    finally:
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)          # a second SIGTERM must not abandon the final save
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    report = validate_run(run)
    assert report.ok, report.findings
    assert 1 <= len(Run(run).generations()) <= 3
    assert not list(run.glob(".ckptfmt-tmp*"))
    checkpoints = [e for e in hist.read(run / ".loss.json").events() if e["event"] == "checkpoint"]
    assert len(checkpoints) >= 5


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (/proc's SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) & (1 << (sig - 1)))


def test_sigterm_during_startup_writes_nothing(tmp_path):
    run = tmp_path / "run"
    proc = start(run, 50)
    deadline = time.monotonic() + 60   # the handler is in (the CLI's own imports done), torch not yet
    while not _catches(proc.pid, signal.SIGTERM) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert not list(run.glob("step_*"))


def test_config_change_is_refused_without_a_pivot(tmp_path):
    run = tmp_path / "run"
    assert train(run, 20).returncode == 0
    proc = train(run, 40, "--seed", "3")
    assert proc.returncode == 1 and "config differs" in proc.stderr and "seed: run has 0, asked 3" in proc.stderr
    assert "pivot" not in proc.stderr              # a pivot cannot change the seed: no hint that it could
    proc = train(run, 40, "--set", 'caps={"code":0.5,"topics":0.5,"docstrings":0.5}')
    assert proc.returncode == 1 and "ckptfmt pivot" in proc.stderr
    assert Run(run).latest().step == 20


def test_an_amp_change_is_refused_naming_the_option(tmp_path):
    run = tmp_path / "run"
    assert train(run, 20).returncode == 0
    proc = train(run, 40, "--amp", "bf16")
    assert proc.returncode == 1 and "trained with --amp none" in proc.stderr and "pass --amp none" in proc.stderr
    assert proc.stderr.count("Traceback") == 0 and Run(run).latest().step == 20


def test_a_device_change_is_refused_naming_the_flags_and_goes_on_when_allowed(tmp_path):
    """A CUDA run (simulated: its manifest says what a CUDA process writes) resumed on the CPU."""
    run = tmp_path / "run"
    assert train(run, 20, "--device", "cpu").returncode == 0
    mpath = run / "step_000020.json"
    doc = json.loads(mpath.read_text())
    doc["run"]["device"] = "cuda:0"
    doc["rng"]["torch_cuda"] = {"device": 0, "state": "AAAAAAAAAAAAAAAAAAAAAA=="}
    commit_rewritten(mpath, doc)                           # as the CUDA process committed it
    proc = train(run, 40, "--device", "cpu")
    assert proc.returncode == 1 and proc.stderr.count("Traceback") == 0
    assert ("step_000020.bin: the run trained on cuda:0, this start runs on cpu: resume it where CUDA is "
            "available (--device cuda), or pass --allow-device-change to go on on cpu") in proc.stderr
    assert Run(run).latest().step == 20
    proc = train(run, 40, "--device", "cpu", "--allow-device-change")
    assert proc.returncode == 0, proc.stderr
    assert "device changed from cuda:0 to cpu" in proc.stderr and Run(run).latest().step == 40
    events = [e for e in hist.read(run / ".loss.json").events() if e["event"] == "device_change"]
    assert [(e["step"], e["saved"], e["now"]) for e in events] == [(20, "cuda:0", "cpu")]


def test_pivot_allows_new_caps_with_a_fresh_bandit(tmp_path):
    run = tmp_path / "run"
    assert train(run, 40).returncode == 0
    state_before = json.loads((run / ".state.json").read_text())
    assert subprocess.run([PY, "-m", "ckptfmt.cli", "pivot", str(run), "--note", "caps"], capture_output=True).returncode == 0
    new_caps = '{"code":0.4,"topics":0.8,"docstrings":0.8}'
    proc = train(run, 60, "--set", f"caps={new_caps}")
    assert proc.returncode == 0, proc.stderr
    doc = ckptfmt.open(run / "step_000060.bin").manifest
    assert doc["config"]["caps"] == json.loads(new_caps) and doc["state"]["bandit"]["phase"] == 1
    assert doc["state"]["bandit"]["phase_steps"] == 20                 # fresh bandit: counts restart at the pivot
    assert sum(a["pulls"] for a in state_before["arms"].values()) == 40
    assert (run / "archive" / "step_000040" / "state.json").exists()
    steps = [r["step"] for r in hist.read(run / ".loss.json").canonical()]
    assert steps == list(range(1, 61))                       # the loss history runs on unbroken


def test_missing_resume_component_is_refused_by_name(tmp_path):
    run = tmp_path / "run"
    assert train(run, 20).returncode == 0
    mpath = run / "step_000020.json"
    doc = json.loads(mpath.read_text())
    del doc["scheduler"]
    del doc["rng"]["generators"]
    commit_rewritten(mpath, doc)                           # a writer that committed it without them
    proc = train(run, 40)
    assert proc.returncode == 1
    assert "the checkpoint lacks scheduler, rng.generators.bandit" in proc.stderr
    assert Run(run).latest().step == 20 and len(Run(run).generations()) == 1


def test_second_trainer_is_refused(tmp_path):
    run = tmp_path / "run"
    proc = start(run, 100000)
    try:
        wait_for(lambda: last_step(run) >= 1, proc)
        other = train(run, 10)
        assert other.returncode == 2 and f"locked by trainer pid {proc.pid}" in other.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_failed_final_save_exits_75_and_keeps_the_previous_generation(tmp_path):
    run = tmp_path / "run"
    flag = tmp_path / "fail-now"
    wrapper = (
        "import os, sys\n"
        "from ckptfmt import fsio\n"
        f"def hook(op, path):\n"
        f"    if op == 'fsync' and os.path.exists({str(flag)!r}) and 'step_' in path:\n"
        "        raise OSError(5, 'Input/output error (injected)')\n"
        "fsio.hook = hook\n"
        "from ckptfmt.cli import main\n"
        "sys.argv = ['ckptfmt'] + sys.argv[1:]\n"
        "main()\n")
    argv = [PY, "-c", wrapper] + cmd(run, 100000)[3:]
    proc = warm.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: gens(run) and last_step(run) > 25, proc)
    before = Run(run).latest()
    data = before.bin.read_bytes()
    flag.write_text("x")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert "checkpoint failed" in err
    assert Run(run).latest(deep=True).step == before.step and before.bin.read_bytes() == data
    assert not list(run.glob(".ckptfmt-tmp*"))


def test_no_valid_generation_is_never_a_fresh_start(tmp_path):
    run = tmp_path / "run"
    assert train(run, 20).returncode == 0
    (run / "step_000020.bin").write_bytes(b"\0" * 100)
    proc = train(run, 40)
    assert proc.returncode == 1 and "no valid generation" in proc.stderr


def test_damaged_newest_generation_is_skipped_and_replaced(tmp_path, straight):
    """A bit flip in the newest .bin: the resume falls back to the one before (with a warning),
    rewrites the damaged step, and ends byte-identical to the straight run."""
    run = tmp_path / "run"
    assert train(run, 60).returncode == 0
    path = run / "step_000060.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 4
    path.write_bytes(bytes(data))
    resumes_past_60_bit_exact(run, straight, "blake3 mismatch")


@pytest.mark.parametrize("edit", ["config", "scheduler"])
def test_an_edited_field_of_the_newest_manifest_is_a_damaged_generation_never_a_config_error(tmp_path, straight, edit):
    """One value of the newest manifest changed, the JSON still valid (``weight_decay`` in the
    config, ``last_epoch`` of the scheduler): validate names the manifest and exits 1, and the
    resume falls back to the generation before instead of blaming the command line or resuming
    a schedule that is not the run's; it ends byte-identical to the straight run."""
    run = tmp_path / "run"
    assert train(run, 60).returncode == 0
    path = run / "step_000060.json"
    doc = json.loads(path.read_text())
    if edit == "config":
        doc["config"]["weight_decay"] = doc["config"]["weight_decay"] * 2
    else:
        doc["scheduler"]["last_epoch"] += 2
    path.write_text(json.dumps(doc, indent=1, sort_keys=True))
    assert not validate_run(run).ok
    proc = train(run, N)
    assert proc.returncode == 0, proc.stderr
    assert f"skipping generation 60: field '{edit}' does not match the manifest's seal" in proc.stderr
    assert "resumed from step_000040.bin" in proc.stderr and "config differs" not in proc.stderr
    assert final(run) == final(straight) and canonical(run) == canonical(straight)[:N]
    assert validate_run(run).ok


def test_a_generation_swapped_in_from_another_run_is_passed_over_and_the_run_ends_bit_exact(tmp_path, straight):
    """Step 60 of another run (another seed) copied in whole: each part matches its own digests,
    but its root digest is not the one this run's history recorded when it committed step 60.
    validate names it (exit 1), the resume falls back to step 40 and ends byte-identical to the
    straight run, and the step 60 committed again is recorded and validates."""
    run, other = tmp_path / "run", tmp_path / "other"
    assert train(run, 60).returncode == 0
    assert train(other, 60, "--seed", "7").returncode == 0
    for part in other.glob("step_000060.*"):
        (run / part.name).write_bytes(part.read_bytes())
    report = validate_run(run)
    assert [f.code for f in report.findings if f.level == "defect"] == ["not_committed_here"]
    resumes_past_60_bit_exact(run, straight, "not the generation this run committed at step 60")


def test_resume_hashes_the_generation_once(tmp_path, monkeypatch):
    """The deep latest-valid check hashes the newest generation; opening it must not hash it
    again (a second full read of a 1.46 GB file at every restart)."""
    from ckptfmt import fingerprint
    from ckptfmt.trainer import config as cfgmod
    from ckptfmt.trainer.loop import Trainer
    run = tmp_path / "run"
    assert train(run, 20).returncode == 0
    hashed = []
    of_buffer = fingerprint.of_buffer
    monkeypatch.setattr(fingerprint, "of_buffer", lambda view, *a: hashed.append(len(view)) or of_buffer(view, *a))
    trainer = Trainer(str(run), cfgmod.get("tiny"), log=lambda msg: None)
    trainer.build()
    try:
        assert trainer.resume() == 20
    finally:
        trainer.run.history.close()
    assert hashed == [(run / "step_000020.bin").stat().st_size]


def test_a_run_written_before_the_manager_resumes_bit_exactly(tmp_path):
    """Manifests of the trainer before it used the checkpoint manager (data, bandit and rng.numpy
    at the top level) resume, and the run ends bit-identical to a straight one."""
    straight, old = tmp_path / "straight", tmp_path / "old"
    assert train(straight, 40).returncode == 0
    assert train(old, 20).returncode == 0
    mpath = old / "step_000020.json"
    doc = json.loads(mpath.read_text())
    state, rng = doc.pop("state"), doc.pop("rng")
    for key in ("buffers", "progress", "seal"):           # that trainer wrote no seal either
        doc.pop(key)
    doc["data"], doc["bandit"] = state["data"], state["bandit"]
    doc["rng"] = {"python": rng["python"], "torch_cpu": rng["torch_cpu"],
                  "numpy": {name: g["state"] for name, g in rng["generators"].items()}}
    mpath.write_text(json.dumps(doc))
    without_root_digests(old)                              # nor root digests in its history
    proc = train(old, 40)
    assert proc.returncode == 0, proc.stderr
    assert final(old, 40) == final(straight, 40)


def test_the_manifest_records_the_kernels_that_ran(tmp_path):
    """The run's determinism facts are what was set, not a constant (CPU here; the CUDA settings
    are the same function's other branch, run by benchmarks/gpu_check.py on a GPU)."""
    run = tmp_path / "run"
    assert train(run, 20).returncode == 0
    facts = ckptfmt.open(run / "step_000020.bin").manifest["run"]
    assert facts["device"] == "cpu" and facts["deterministic"] is True
    assert facts["deterministic_mode"] == "warn" and facts["sdpa"] == "math"


def test_every_field_a_pivot_may_change_is_named_where_the_pivot_is_explained():
    """spec/RUN.md §6.2's list (config.POLICY_FIELDS) in `train --help`, `pivot --help` and the
    refusal's hint; they named 'caps, floors and the lr schedule' (sources and bandit_temperature
    left out)."""
    from ckptfmt.errors import ConfigMismatchError
    from ckptfmt.trainer import config as cfgmod
    helps = [subprocess.run([PY, "-m", "ckptfmt.cli", c, "--help"], capture_output=True, text=True).stdout
             for c in ("train", "pivot")]
    stored = cfgmod.get("tiny").to_dict()
    with pytest.raises(ConfigMismatchError) as err:
        cfgmod.check_compatible("r/step_000001.bin", {**stored, "bandit_temperature": 1.0}, cfgmod.get("tiny"),
                                pivot=False)
    for text in [" ".join(h.split()) for h in helps] + [str(err.value)]:
        assert all(f in text for f in cfgmod.POLICY_FIELDS), (text, cfgmod.POLICY_FIELDS)


def test_train_saves_on_a_new_best_and_keeps_by_the_policy_it_records(tmp_path):
    """``train --checkpoint-on-best loss_ema`` commits at each new best of the loss EMA (beside the
    cadence), retention keeps the best 2 by it and the newest, and ``ls`` shows why from the
    policy the trainer recorded; a resume goes on with the EMA the generation recorded."""
    run = tmp_path / "run"
    flags = ("--checkpoint-on-best", "loss_ema", "--keep-best", 2, "--metric", "loss_ema", "--keep-last", 1)
    proc = train(run, 30, *flags)
    assert proc.returncode == 0, proc.stderr
    reasons = {r["step"]: r["reason"] for r in hist.read(run / ".loss.json").events() if r["event"] == "checkpoint"}
    assert "best loss_ema" in reasons.values() and reasons[20] == "cadence" and 30 in reasons
    ema = {r["step"]: r["loss_ema"] for r in hist.read(run / ".loss.json").canonical()}
    best = sorted((ema[s], -s) for s, why in reasons.items() if why == "best loss_ema" or s in (20, 30))
    ls = json.loads(subprocess.run([PY, "-m", "ckptfmt.cli", "ls", str(run), "--json"], capture_output=True,
                                   text=True, timeout=60).stdout)
    kept = {g["step"]: g["kept_by"] for g in ls["generations"]}
    assert set(kept) == {-s for _, s in best[:2]} | {30}
    assert all("best loss_ema" in kept[-s] for _, s in best[:2]) and "last" in kept[30]
    assert ls["policy"]["retention"]["metric"] == "loss_ema"
    proc = train(run, 32, *flags)
    assert proc.returncode == 0, proc.stderr
    records = {r["step"]: r for r in hist.read(run / ".loss.json").canonical()}
    assert records[31]["loss_ema"] == 0.98 * records[30]["loss_ema"] + 0.02 * records[31]["loss"]


@pytest.mark.parametrize("flags,message", [
    (("--checkpoint-interval", "5x"), "--checkpoint-interval: not a duration: '5x'"),
    (("--keep-within", "soon"), "not a duration: 'soon'"),
    (("--keep-best", 2), "--keep-best needs --metric"),
    (("--keep-best", 2, "--metric", "val_loss"), "--metric: the trainer reports no metric 'val_loss' (it reports loss, "),
    (("--checkpoint-on-best", "loss-ema"), "--checkpoint-on-best: the trainer reports no metric 'loss-ema'"),
    (("--checkpoint-best-mode", "max"), "need --checkpoint-on-best METRIC"),
    (("--checkpoint-interval", "0s"), "not a duration: '0s'"),
])
def test_train_refuses_a_bad_policy_before_it_starts(tmp_path, flags, message):
    proc = train(tmp_path / "run", 5, *flags)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()
