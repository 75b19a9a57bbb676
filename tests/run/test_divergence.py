"""The divergence guard: a generation whose recorded values hold NaN or inf is committed
but marked diverged; ls shows it, validate fails naming region and count, retention keeps the
newest finite generation, and latest-valid resume picks it and says why."""
import json
import sys
import warnings

import numpy as np
import pytest

from ckptfmt.errors import NoValidGenerationError
from ckptfmt.run import Run
from ckptfmt.run.ops import ls_run
from conftest import arrays, cli
import warm  # noqa: E402

PY = sys.executable


def diverged_run(path, steps=(100, 200, 300, 400), nan_from=300):
    """Generations at ``steps``; from ``nan_from`` on, weights and m hold a NaN (a run that
    diverged between 200 and 300 and went on committing)."""
    run = Run(path, create=True)
    for step in steps:
        w, m, v = arrays(64, seed=step)
        if step >= nan_from:
            w[5], m[5] = np.nan, np.nan
        run.commit(step, w, m, v, manifest={})
    return run


def test_latest_valid_picks_the_newest_finite_generation_and_says_why(tmp_path):
    run = diverged_run(tmp_path)
    with pytest.warns(UserWarning, match=r"latest finite generation is 200: generation\(s\) 400 \(weights: 1, "
                                         r"m: 1 non-finite values\); 300 .* diverged"):
        assert run.latest(deep=True).step == 200
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run.latest(deep=True, allow_nonfinite=True).step == 400


def test_gc_keep_last_1_keeps_the_newest_finite_and_the_newest(tmp_path):
    diverged_run(tmp_path)
    proc = cli("gc", str(tmp_path), "--keep-last", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["deleted"] == [100, 300]
    assert [g.step for g in Run(tmp_path).generations()] == [200, 400]
    # a newer finite generation lifts the protection: then 200 and 400 may go
    w, m, v = arrays(64, seed=500)
    Run(tmp_path).commit(500, w, m, v, manifest={})
    assert json.loads(cli("gc", str(tmp_path), "--keep-last", "1", "--json").stdout)["deleted"] == [200, 400]


def test_ls_shows_diverged_generations_with_counts(tmp_path):
    diverged_run(tmp_path)
    rows = {r["step"]: r for r in ls_run(tmp_path)["generations"]}
    assert [rows[s]["status"] for s in (100, 200, 300, 400)] == ["committed", "committed", "diverged", "diverged"]
    assert rows[400]["non_finite"] == {"weights": 1, "m": 1} and rows[400]["valid"]
    proc = cli("ls", str(tmp_path))
    assert proc.returncode == 0
    line = next(x for x in proc.stdout.splitlines() if x.strip().startswith("300"))
    assert "diverged (weights: 1, m: 1 non-finite values)" in line


def test_validate_exits_1_naming_region_and_count(tmp_path):
    diverged_run(tmp_path)
    proc = cli("validate", str(tmp_path))
    assert proc.returncode == 1 and "DIVERGED" in proc.stdout
    assert "step_000300.bin: diverged: region weights holds 1 non-finite values" in proc.stdout
    assert "step_000400.bin: diverged: region m holds 1 non-finite values" in proc.stdout
    report = json.loads(cli("validate", "--json", str(tmp_path)).stdout)
    assert report["status"] == "diverged" and report["details"]["diverged"] == [300, 400]
    one = json.loads(cli("validate", "--json", str(tmp_path / "step_000200.bin")).stdout)
    assert one["ok"] and one["details"]["values"] == "recorded"


def test_every_generation_diverged_is_refused_by_name(tmp_path):
    run = diverged_run(tmp_path, steps=(100, 200), nan_from=100)
    with pytest.raises(NoValidGenerationError, match="no finite generation to resume from.*resumes the newest, 200"):
        run.latest(deep=True)
    assert run.latest(allow_nonfinite=True).step == 200
    assert run.gc(keep_last=1) == [100]         # the newest valid one stays


def test_a_diverged_generation_is_replaced_when_the_run_reaches_its_step_again(tmp_path):
    """After resuming from 200, the run's own step 300 is a new timeline: the diverged 300 (its
    history lines stay in .loss.json) gives way, where a valid finite one is never overwritten."""
    run = diverged_run(tmp_path, steps=(100, 200, 300))
    w, m, v = arrays(64, seed=1)
    with pytest.warns(UserWarning, match="replacing diverged generation 300"):
        run.commit(300, w, m, v, manifest={})
    assert run.latest(deep=True).step == 300
    with pytest.raises(Exception, match="committed already"):
        run.commit(300, w, m, v, manifest={})


# ---------------------------------------------------------------- the checkpoint manager
torch = pytest.importorskip("torch")

from models import tiny_adamw, train_steps  # noqa: E402


def manager_run(tmp_path, **kwargs):
    from ckptfmt.torch import CheckpointManager
    model, opt = tiny_adamw(lr=0.1)
    logged = []
    mgr = CheckpointManager(tmp_path, model, opt, every=None, keep_last=None, handle_signals=False,
                            log=logged.append, **kwargs)
    return model, opt, mgr, logged


def test_manager_restores_the_newest_finite_generation_and_says_why(tmp_path):
    model, opt, mgr, _ = manager_run(tmp_path)
    for step in (100, 200, 300):
        train_steps(model, opt, 1)
        if step == 300:
            with torch.no_grad():
                model.weight[0, 0] = float("nan")
        mgr.save(step)
    mgr.close()
    _, _, again, logged = manager_run(tmp_path)
    assert again.restore() == 200
    assert "resuming from the newest finite generation, step_000200.bin" in logged[0]
    assert "300 (weights: 1 non-finite values)" in logged[0] and again.skipped_diverged
    again.close()
    model3, _, third, logged3 = manager_run(tmp_path)
    assert third.restore(allow_nonfinite=True) == 300 and torch.isnan(model3.weight[0, 0])
    assert logged3 == [f"{tmp_path / 'step_000300.bin'}: resuming a diverged generation "
                       "(weights: 1 non-finite values), as asked"]
    third.close()
    events = [json.loads(x) for x in (tmp_path / ".loss.json").read_text().splitlines()]
    resumes = [e for e in events if e.get("event") == "resume"]
    assert "skipped_diverged" in resumes[-2] and "skipped_diverged" not in resumes[-1]


# ---------------------------------------------------------------- the reference trainer
def train(run, steps, *extra):
    argv = [PY, "-m", "ckptfmt.cli", "train", "--run", str(run), "--config", "tiny", "--steps", str(steps),
            "--checkpoint-every", "50", "--sample-every", "0", "--log-every", "100000", *extra]
    return warm.run(argv, capture_output=True, text=True, timeout=300)


def test_trainer_stops_with_exit_3_at_a_non_finite_loss_and_resumes_the_last_finite(tmp_path):
    run = tmp_path / "run"
    first = train(run, 300, "--force-nonfinite-at", "250")
    assert first.returncode == 3, first.stderr
    assert "step 250: loss is nan: committed step 250 (diverged)" in first.stderr
    assert [g.step for g in Run(run).generations()] == [50, 100, 150, 200, 250]
    assert ls_run(run)["generations"][-1]["status"] == "diverged"
    assert cli("validate", str(run / "step_000250.bin")).returncode == 1
    stop = [json.loads(x) for x in (run / ".loss.json").read_text().splitlines() if '"stop"' in x]
    assert stop[-1]["step"] == 250 and stop[-1]["reason"] == "non-finite loss"

    second = train(run, 300)
    assert second.returncode == 0, second.stderr
    assert "resuming from the newest finite generation, step_000200.bin, not a newer one: generation(s) 250" \
        in second.stderr
    assert ls_run(run)["generations"][-1]["step"] == 300
    assert all(r["status"] == "committed" for r in ls_run(run)["generations"])   # 250 trained again
    assert cli("validate", str(run)).returncode == 0


def test_trainer_allow_nonfinite_resumes_the_diverged_generation(tmp_path):
    run = tmp_path / "run"
    assert train(run, 100, "--force-nonfinite-at", "100").returncode == 3
    again = train(run, 150, "--allow-nonfinite")
    assert again.returncode == 3, again.stderr           # NaN weights give a NaN loss at once
    assert "resumed from step_000100.bin" in again.stderr and "step 101: loss is nan" in again.stderr
    third = train(run, 150)                              # 100 and 101 diverged: back to 50
    assert third.returncode == 0 and "step_000050.bin, not a newer one: generation(s) 101" in third.stderr


def test_trainer_refuses_a_run_whose_every_generation_diverged(tmp_path):
    run = tmp_path / "run"
    assert train(run, 50, "--force-nonfinite-at", "30").returncode == 3
    refused = train(run, 60)
    assert refused.returncode == 1 and "no finite generation to resume from" in refused.stderr
    assert "--allow-nonfinite" in refused.stderr and "Traceback" not in refused.stderr
