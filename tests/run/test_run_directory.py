import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import ckptfmt
from ckptfmt.run import history as hist
from ckptfmt.errors import NoValidGenerationError, RunLockedError, SaveError
from ckptfmt.run import Run, RunLock, plan_retention
from ckptfmt.run.ops import bisect, fork, ls_run, pivot
from ckptfmt.tools.validate import validate_run
from ckptfmt import shards
from ckptfmt.run import roots, zombie_arms
from conftest import arrays, cli, make

warnings.simplefilter("ignore", UserWarning)


# ---------------------------------------------------------------- fallback chain
def corrupt(run_dir, step, how):
    b = run_dir / f"step_{step:06d}.bin"
    j = run_dir / f"step_{step:06d}.json"
    if how == "bit_flip":
        data = bytearray(b.read_bytes())
        data[len(data) // 2] ^= 4
        b.write_bytes(bytes(data))
    elif how == "truncation":
        b.write_bytes(b.read_bytes()[:-1])
    elif how == "missing_manifest":
        j.unlink()
    elif how == "zero_length":
        b.write_bytes(b"")
    elif how == "other_steps_manifest":
        j.write_text((run_dir / "step_000100.json").read_text())
    elif how == "missing_bin":
        b.unlink()


HOW = ["bit_flip", "truncation", "missing_manifest", "zero_length", "other_steps_manifest", "missing_bin"]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_latest_valid_falls_back_to_the_k_plus_first(tmp_path, how, k):
    steps = [100, 200, 300, 400, 500]
    for s in steps:
        make(tmp_path, s, seed=s)
    for s in steps[len(steps) - k:]:
        corrupt(tmp_path, s, how if not (how == "other_steps_manifest" and s == 100) else "bit_flip")
    expected = steps[len(steps) - 1 - k]
    assert Run(tmp_path).latest(deep=True).step == expected
    if how != "bit_flip":           # a bit flip is only visible to the deep check
        assert Run(tmp_path).latest().step == expected


@pytest.mark.parametrize("how", HOW)
def test_all_corrupt_is_a_typed_error_never_a_fresh_start(tmp_path, how):
    for s in (100, 200):
        make(tmp_path, s, seed=s)
    corrupt(tmp_path, 200, how)
    corrupt(tmp_path, 100, "bit_flip" if how == "other_steps_manifest" else how)
    with pytest.raises(NoValidGenerationError, match="no valid generation"):
        Run(tmp_path).latest(deep=True)


def test_empty_run_has_no_latest(tmp_path):
    assert Run(tmp_path).latest() is None


def test_numeric_order_and_no_overwrite(tmp_path):
    for s in (1_000_001, 999_998, 1_000_000, 999_999):
        make(tmp_path, s, n=3)
    run = Run(tmp_path)
    assert [g.step for g in run.generations()] == [999_998, 999_999, 1_000_000, 1_000_001]
    assert run.latest().step == 1_000_001
    before = (tmp_path / "step_1000001.bin").read_bytes()
    with pytest.raises(SaveError, match="committed already"):
        run.commit(1_000_001, *arrays(3, seed=5), manifest={})
    assert (tmp_path / "step_1000001.bin").read_bytes() == before


def test_damaged_committed_generation_is_replaced_on_commit(tmp_path):
    make(tmp_path, 100, n=3)
    corrupt(tmp_path, 100, "bit_flip")              # only the deep check sees it
    run = Run(tmp_path)
    result = run.commit(100, *arrays(3, seed=5), manifest={})
    assert run.latest(deep=True).step == 100
    assert ckptfmt.open(result.path, verify=True).weights.tobytes() == arrays(3, seed=5)[0].tobytes()


def test_uncommitted_leftover_is_replaced_on_commit(tmp_path):
    ckptfmt.save(tmp_path / "step_000100.bin", 100, *arrays(3), write_manifest=False)
    make(tmp_path, 50)
    run = Run(tmp_path)
    assert run.latest().step == 50
    run.commit(100, *arrays(3, seed=1), manifest={})
    assert run.latest(deep=True).step == 100


# ---------------------------------------------------------------- retention
@pytest.mark.parametrize("steps,keep_last,keep_every,pinned,protect,deleted", [
    ([100, 200, 300, 400, 500], 2, None, [], [], [100, 200, 300]),
    ([100, 200, 300, 400, 500], 2, 200, [], [], [100, 300]),
    ([100, 200, 300, 400, 500], 1, None, [100], [], [200, 300, 400]),
    ([100, 200, 300, 400, 500], 1, None, [], [300], [100, 200, 400]),
    ([500, 100, 300], 5, None, [], [], []),
    ([], 3, 10, [], [], []),
    ([999_998, 999_999, 1_000_000, 1_000_001], 1, 1_000_000, [], [], [999_998, 999_999]),
])
def test_retention_policy_table(steps, keep_last, keep_every, pinned, protect, deleted):
    assert plan_retention(steps, keep_last=keep_last, keep_every=keep_every, pinned=pinned, protect=protect) == deleted


def test_retention_refuses_keep_last_zero():
    with pytest.raises(ValueError):
        plan_retention([1], keep_last=0)


def test_gc_never_deletes_the_newest_valid_and_only_its_own(tmp_path):
    for s in (100, 200, 300):
        make(tmp_path, s, seed=s)
    corrupt(tmp_path, 300, "bit_flip")            # newest is damaged: 200 is the newest valid
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step_0000100.bin").write_text("look-alike")
    deleted = Run(tmp_path).gc(keep_last=1)
    assert deleted == [100]
    assert (tmp_path / "step_000200.bin").exists() and (tmp_path / "notes.txt").exists()
    assert (tmp_path / "step_0000100.bin").exists()


def test_sweep_removes_only_our_temp_files(tmp_path):
    (tmp_path / ".ckptfmt-tmp.step_000100.bin.1.ab").write_bytes(b"x" * 10)
    (tmp_path / ".other").write_bytes(b"x")
    make(tmp_path, 1)
    removed = Run(tmp_path).sweep_temps()
    assert [p.name for p in removed] == [".ckptfmt-tmp.step_000100.bin.1.ab"]
    assert sorted(os.listdir(tmp_path)) == [".other", "step_000001.bin", "step_000001.json"]


def test_sweep_leaves_a_live_processs_sidecar_temp(tmp_path):
    """A trainer restarting beside `mirror --watch` swept the mirror's temp file of .mirrors.json
    between its write and its rename ('commit failed: No such file or directory', exit 2). A
    sidecar's temp file of a live process stays; a dead one's goes, and a generation's goes
    whatever pid its name holds (only the lock holder writes those; pids are reused)."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        names = {f".ckptfmt-tmp..mirrors.json.{live.pid}.ab": True, f".ckptfmt-tmp..mirrors.json.{dead.pid}.cd": False,
                 f".ckptfmt-tmp.step_000002.bin.{live.pid}.ef": False}
        for name in names:
            (tmp_path / name).write_bytes(b"x")
        removed = {p.name for p in Run(tmp_path).sweep_temps()}
    finally:
        live.kill()
        live.wait()
    assert removed == {name for name, stays in names.items() if not stays}
    assert sorted(os.listdir(tmp_path)) == [name for name, stays in names.items() if stays]


# ---------------------------------------------------------------- lock
def test_second_writer_is_refused_naming_the_holder(tmp_path):
    code = ("import sys, time; from ckptfmt.run import RunLock\n"
            f"l = RunLock({str(tmp_path)!r}, purpose='trainer').acquire()\n"
            "print('locked', flush=True); time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=f"trainer pid {proc.pid} on"):
            RunLock(tmp_path).acquire()
        with pytest.raises(RunLockedError):
            pivot(tmp_path)
    finally:
        proc.kill()
        proc.wait()
    lock = RunLock(tmp_path).acquire()           # the dead holder's lock is stale: taken over
    assert lock.stale and lock.stale["pid"] == proc.pid
    lock.release()


# ---------------------------------------------------------------- history
def test_history_append_read_and_canonical(tmp_path):
    h = hist.History(tmp_path / ".loss.json")
    for s in range(1, 6):
        h.append({"step": s, "loss": float(s)})
    h.event("resume", 3)                  # crash after 5, resumed from 3: 4 and 5 are lost
    for s in range(4, 7):
        h.append({"step": s, "loss": 10.0 + s})
    h.close()
    r = hist.read(tmp_path / ".loss.json")
    assert len(r.records) == 9 and not r.problems
    assert [(c["step"], c["loss"]) for c in r.canonical()] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0)]


@pytest.mark.parametrize("tail", [b'{"step": 4, "lo', b"\0\0\0\0\0\0", b'{"step": 4}\n\0\0\0\0', b"garbage\n\0\0"])
def test_torn_or_nul_tail_is_recovered(tmp_path, tail):
    path = tmp_path / ".loss.json"
    path.write_bytes(b'{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n' + tail)
    r = hist.read(path)
    assert not r.problems and r.warnings
    assert [c["step"] for c in r.canonical()][:2] == [1, 2]
    h = hist.History(path)              # a writer ends the torn line, then resumes cleanly
    h.event("resume", 2)
    h.append({"step": 3, "loss": 3.0})
    h.close()
    r = hist.read(path)
    assert not r.problems and [c["step"] for c in r.canonical()] == [1, 2, 3]


def test_corruption_in_the_middle_is_reported(tmp_path):
    path = tmp_path / ".loss.json"
    path.write_bytes(b'{"step": 1, "loss": 1.0}\nXXXX\n{"step": 3, "loss": 3.0}\n')
    r = hist.read(path)
    assert r.problems and "line 2" in r.problems[0]


def test_nan_is_written_in_a_defined_way(tmp_path):
    h = hist.History(tmp_path / ".loss.json")
    h.append({"step": 1, "loss": hist.encode_float(float("nan"))})
    h.append({"step": 2, "loss": hist.encode_float(float("-inf"))})
    h.close()
    lines = (tmp_path / ".loss.json").read_text().splitlines()
    assert lines == ['{"step":1,"loss":"nan"}', '{"step":2,"loss":"-inf"}']
    assert hist.decode_float("-inf") == float("-inf")


# ---------------------------------------------------------------- pivot, fork, bisect, zombies
def test_pivot_archives_samples_and_state_but_keeps_history_and_generations(tmp_path):
    make(tmp_path, 100)
    (tmp_path / ".loss.json").write_text('{"step": 100, "loss": 1.0}\n')
    (tmp_path / ".samples.json").write_text("[1]")
    (tmp_path / ".state.json").write_text('{"arms": {}}')
    rec = pivot(tmp_path, note="new caps")
    assert rec["step"] == 100 and sorted(rec["archived"]) == [".samples.json", ".state.json"]
    assert (tmp_path / "archive" / "step_000100" / "samples.json").read_text() == "[1]"
    assert not (tmp_path / ".samples.json").exists() and (tmp_path / "step_000100.bin").exists()
    events = hist.read(tmp_path / ".loss.json").events()
    assert events[-1]["event"] == "pivot" and events[-1]["note"] == "new caps"
    assert json.loads((tmp_path / ".pivot.json").read_text())["step"] == 100
    assert pivot(tmp_path)["archive"] == "archive/step_000100.2"


def test_pivot_is_at_the_generation_the_trainer_resumes_from(tmp_path):
    """A newest generation damaged after its commit is skipped by the trainer (latest, deep):
    the pivot must be recorded at the one before it, or it never applies."""
    make(tmp_path, 100)
    make(tmp_path, 200, seed=2)
    corrupt(tmp_path, 200, "bit_flip")
    (tmp_path / ".state.json").write_text('{"arms": {}}')
    rec = pivot(tmp_path, note="new caps")
    assert rec["step"] == 100 and rec["archive"] == "archive/step_000100"
    assert json.loads((tmp_path / ".pivot.json").read_text())["step"] == 100
    assert hist.read(tmp_path / ".loss.json").events()[-1]["step"] == 100


# ---------------------------------------------------------------- which generation the run committed
def committed_with_roots(run_dir, steps, seed=0):
    """Generations committed as a writer commits them: each then named by a checkpoint event
    with its root digest."""
    run_dir.mkdir(exist_ok=True)
    h = hist.History(run_dir / hist.NAME)
    for s in steps:
        make(run_dir, s, seed=seed + s)
        h.event("checkpoint", s, reason="cadence", root=roots.of_step(run_dir, s))
    h.close()


def swap_in(run_dir, other_dir, step):
    for suffix in (".bin", ".json"):
        name = f"step_{step:06d}{suffix}"
        (run_dir / name).write_bytes((other_dir / name).read_bytes())


def test_a_generation_swapped_in_from_another_run_is_passed_over_and_damage_in_validate_ls_and_fork(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    committed_with_roots(run, [100, 200])
    committed_with_roots(other, [200], seed=7)
    swap_in(run, other, 200)
    assert ckptfmt.open(run / "step_000200.bin", verify=True)      # every part matches its own digests
    with pytest.warns(UserWarning, match="skipping generation 200: not the generation this run committed at step 200"):
        assert Run(run).latest(deep=True).step == 100
    assert Run(run).latest().step == 100                            # shallow too: a manifest read
    report = validate_run(run)
    assert not report.ok and [f.code for f in report.findings if f.level == "defect"] == ["not_committed_here"]
    assert any(str(run / "step_000200.json") in f.message for f in report.findings if f.code == "not_committed_here")
    rows = {r["step"]: r for r in ls_run(run)["generations"]}
    assert rows[100]["valid"] and rows[200]["status"].startswith("damaged: not the generation this run committed")
    proc = cli("ls", str(run))
    assert proc.returncode == 0 and "damaged: not the generation" in proc.stdout
    assert "committed: names, sizes, headers and manifests checked; ls --deep (or validate) hashes every byte" \
        in proc.stdout
    with pytest.raises(ckptfmt.errors.CheckpointError, match="cannot fork from it: not the generation"):
        fork(run, 200, tmp_path / "child")
    proc = cli("export", str(run), str(tmp_path / "exported"), "--steps", "200")
    assert proc.returncode == 1 and "cannot export step 200: not the generation" in proc.stderr, proc.stderr
    Run(run).commit(200, *arrays(100, seed=200), manifest={})         # replaced, not "committed already"
    roots.record(run, "checkpoint", 200)
    assert Run(run).latest(deep=True).step == 200 and validate_run(run).ok


def test_the_newest_record_of_a_step_wins_and_a_step_without_one_is_not_checked(tmp_path):
    """A writer killed between its commit and its event, after the run fell back past that step
    (a resume at an earlier step), leaves the older record standing: the new generation is passed
    over and replaced when the run commits the step again; no record, no check."""
    run, other = tmp_path / "run", tmp_path / "other"
    committed_with_roots(run, [100, 200])
    h = hist.History(run / hist.NAME)
    h.event("resume", 100)
    h.close()
    first = roots.recorded(run / hist.NAME)
    committed_with_roots(other, [200, 300], seed=7)
    swap_in(run, other, 200)                        # committed again in the new timeline, its event lost
    assert roots.recorded(run / hist.NAME) == first and first[200] != roots.of_step(run, 200)
    assert Run(run).latest(deep=True).step == 100
    Run(run).commit(200, *arrays(100, seed=200), manifest={})         # the step reached again: replaced
    roots.record(run, "checkpoint", 200)
    assert Run(run).latest(deep=True).step == 200
    swap_in(run, other, 300)                        # no record of step 300 at all
    assert Run(run).latest(deep=True).step == 300


def test_a_newer_event_without_a_root_unrecords_the_step_and_an_odd_history_records_nothing(tmp_path):
    """A writer that records no root (a release before root digests) committing a step again
    leaves it unchecked, never judged by the older record; a history that is a directory or a
    FIFO records nothing, and latest-valid neither fails nor waits on it."""
    run = tmp_path / "run"
    committed_with_roots(run, [100])
    h = hist.History(run / hist.NAME)
    h.event("checkpoint", 100, reason="cadence")
    h.close()
    assert roots.recorded(run / hist.NAME) == {}
    for odd in ("directory", "fifo"):
        other = tmp_path / odd
        other.mkdir()
        make(other, 5)
        (other / hist.NAME).mkdir() if odd == "directory" else os.mkfifo(other / hist.NAME)
        assert roots.recorded(other / hist.NAME) == {} and Run(other).latest(deep=True).step == 5


def test_a_generation_converted_into_a_run_is_named_in_its_history(tmp_path):
    """``convert step_N.bin RUN --to shards`` into a run whose history recorded another
    generation at step N (one retention deleted): the conversion's own event names the new one,
    so the run validates and resumes from it; a run without a history gets no history."""
    from ckptfmt.tools.convert import convert
    run, src = tmp_path / "run", tmp_path / "src"
    committed_with_roots(run, [100, 200])
    Run(run).generations()[1].remove()                  # retention deleted step 200; its record stays
    committed_with_roots(src, [200], seed=7)
    convert(str(src / "step_000200.bin"), str(run), to="shards")
    assert roots.recorded(run / hist.NAME)[200] == roots.of_step(run, 200)
    assert Run(run).latest(deep=True).step == 200 and validate_run(run).ok
    convert(str(src / "step_000200.bin"), str(tmp_path / "bare"), to="shards")
    assert not (tmp_path / "bare" / hist.NAME).exists()


def test_fork_copies_verified_with_provenance(tmp_path):
    parent = tmp_path / "parent"
    parent.mkdir()
    for s in (100, 200):
        make(parent, s, seed=s)
    h = hist.History(parent / ".loss.json")
    for s in range(1, 201):
        h.append({"step": s, "loss": 1.0 / s})
    h.close()
    out = fork(parent, 100, tmp_path / "child")
    child = tmp_path / "child"
    assert out["history_records"] == 100
    assert (child / "step_000100.bin").read_bytes() == (parent / "step_000100.bin").read_bytes()
    doc = json.loads((child / "step_000100.json").read_text())
    assert doc["provenance"]["parent_step"] == 100 and doc["provenance"]["parent_blake3"] == doc["blake3"]
    assert ckptfmt.open(child / "step_000100.bin", verify=True)
    assert [c["step"] for c in hist.read(child / ".loss.json").canonical()] == list(range(1, 101))
    assert roots.recorded(child / hist.NAME) == {100: roots.of_step(child, 100)}    # the fork names what it brought
    assert roots.of_step(child, 100) != roots.of_step(parent, 100)                  # its manifest has provenance
    with pytest.raises(ckptfmt.errors.DestinationExistsError):
        fork(parent, 100, child)
    corrupt(parent, 200, "bit_flip")
    with pytest.raises(ckptfmt.errors.CheckpointError, match="cannot fork"):
        fork(parent, 200, tmp_path / "c2")


def test_bisect_finds_the_first_difference(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        for s in (100, 200, 300):
            make(d, s, seed=s if (d == a or s < 300) else 999)
        h = hist.History(d / ".loss.json")
        for s in range(1, 301):
            h.append({"step": s, "loss": 1.0 if (d == a or s < 250) else 2.0})
        h.close()
    r = bisect(a, b)
    assert r["first_generation_difference"] == 300 and r["last_identical_generation"] == 200
    assert r["first_history_difference"] == 250 and not r["identical"]


def test_bisect_compares_generations_of_different_shapes_by_content(tmp_path):
    """A .bin and the same generation sharded (in 2 or in 3), companions included, are identical
    whatever digest each manifest records, and so is a fork of the sharded one (its manifest adds
    provenance); other values or another companion at a step are its first difference."""
    a, b, other = tmp_path / "a", tmp_path / "b", tmp_path / "other"
    extra = {"buffers/x": np.arange(3, dtype="<f4")}
    for d in (a, b, other, tmp_path / "changed", tmp_path / "moved"):
        d.mkdir()
    for s in (100, 200, 300):
        make(a, s, seed=s, extra_tensors=extra)
    make(b, 100, seed=100, extra_tensors=extra)                     # the same .bin
    shards.split(a / "step_000200.bin", b, 2)                        # the same values, sharded
    shards.split(a / "step_000300.bin", other, 3)
    for run in (a, b, other):
        h = hist.History(run / ".loss.json")
        for s in range(1, 301):
            h.append({"step": s, "loss": 1.0 / s})
        h.close()
    recorded = [json.loads((d / "step_000200.json").read_text())["blake3"] for d in (a, b)]
    assert recorded[0] != recorded[1]                                # a .bin's digest, a root over shards
    r = bisect(a, b)
    assert r["identical"] and r["first_generation_difference"] is None and r["last_identical_generation"] == 200
    assert bisect(b, other)["identical"]                             # 2 shards against 3 of the same values
    fork(b, 200, tmp_path / "child")
    assert json.loads((tmp_path / "child" / "step_000200.json").read_text())["provenance"]["parent_step"] == 200
    r = bisect(a, tmp_path / "child")
    assert r["common_generations"] == [200] and r["first_generation_difference"] is None
    done = cli("bisect", str(a), str(b))
    assert done.returncode == 0 and "generations: identical" in done.stdout

    shards.split(make(tmp_path / "changed", 300, seed=999, extra_tensors=extra), b, 3)
    r = bisect(a, b)
    assert r["first_generation_difference"] == 300 and r["last_identical_generation"] == 200 and not r["identical"]
    done = cli("bisect", str(a), str(b))
    assert done.returncode == 1 and "first differ at step 300 (last identical: step 200)" in done.stdout
    make(tmp_path / "moved", 300, seed=300, extra_tensors={"buffers/x": np.ones(3, dtype="<f4")})
    assert bisect(tmp_path / "moved", other)["first_generation_difference"] == 300    # the companion differs

    shard = other / "step_000300.shards" / "00001-of-00003.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ckptfmt.errors.FingerprintMismatchError, match="00001-of-00003.bin"):
        bisect(a, other)                 # read to be compared: a shard that is not its row's is named


def test_zombie_arms_are_flagged(tmp_path):
    make(tmp_path, 100, manifest={"config": {"sources": ["code", "topics"]}})
    (tmp_path / ".state.json").write_text(json.dumps({"arms": {"code": {}, "repo-docstrings": {}}}))
    assert zombie_arms(Run(tmp_path)) == ["repo-docstrings"]
    report = validate_run(tmp_path)
    assert report.ok and any(f.code == "zombie_arm" and "repo-docstrings" in f.message for f in report.findings)
    make(tmp_path, 200, manifest={"config": {"sources": ["code", "topics"]}})
    damaged = tmp_path / "step_000200.json"
    damaged.write_text(damaged.read_text().replace('"topics"', '"topicz"'))     # edited after its seal
    assert zombie_arms(Run(tmp_path)) == ["repo-docstrings"]     # from the newest manifest that reads


# ---------------------------------------------------------------- validate / ls of a run
def test_validate_run_reports_leftovers_as_warnings_and_damage_as_defects(tmp_path):
    make(tmp_path, 100)
    ckptfmt.save(tmp_path / "step_000200.bin", 200, *arrays(100), write_manifest=False)
    (tmp_path / ".ckptfmt-tmp.step_000300.bin.9.ff").write_bytes(b"partial")
    r = validate_run(tmp_path)
    assert r.ok and {"uncommitted", "leftover_temp"} <= {f.code for f in r.findings}
    corrupt(tmp_path, 100, "bit_flip")
    r = validate_run(tmp_path)
    assert not r.ok and "fingerprint_mismatch" in {f.code for f in r.findings}


def test_hostile_entries_are_skipped_with_a_reason(tmp_path):
    make(tmp_path, 100)
    os.symlink("/dev/zero", tmp_path / "step_000200.bin")
    os.mkfifo(tmp_path / "step_000300.bin")
    os.mkdir(tmp_path / "step_000400.bin")
    (tmp_path / "step_0000500.bin").write_bytes(b"x")
    outside = tmp_path.parent / "outside.bin"
    outside.write_bytes(b"y")
    os.symlink(outside, tmp_path / "step_000600.json")
    run = Run(tmp_path)
    assert [g.step for g in run.generations()] == [100] and run.latest().step == 100
    reasons = " ".join(f"{p.name}:{why}" for p, why in run.listing().foreign)
    for name in ("step_000200.bin", "step_000300.bin", "step_000400.bin", "step_0000500.bin", "step_000600.json"):
        assert name in reasons
    assert validate_run(tmp_path).ok
    assert [g["step"] for g in ls_run(tmp_path)["generations"]] == [100]


def test_bare_run_is_valid_but_unverified(tmp_path):
    from conftest import seed_write
    for s in (1, 2):
        seed_write(tmp_path / f"step_{s:06d}.bin", s, *arrays(5))
    r = validate_run(tmp_path)
    assert r.ok and any(f.code == "bare_run" for f in r.findings) and r.status == "unverified"
    assert Run(tmp_path).latest(allow_bare=True).step == 2
    rows = ls_run(tmp_path)["generations"]      # ls agrees with validate (FORMAT §4.4): bare, not uncommitted
    assert [(g["step"], g["valid"], g["status"]) for g in rows] == [(1, True, "bare (unverified)"), (2, True, "bare (unverified)")]
    seed_write(tmp_path / "step_000003.bin", 4, *arrays(5))     # name and header disagree: a defect still
    assert ls_run(tmp_path)["generations"][-1]["status"] == "damaged: name says step 3, header says step 4"


def test_a_bare_file_under_another_steps_name_is_skipped_with_the_readers_message(tmp_path):
    """Bare and committed generations are checked by the one reader: a header that disagrees
    with the name reads the same in both (it was worded twice, once in a branch never reached)."""
    from conftest import seed_write
    from ckptfmt.run.generations import check_bare
    seed_write(tmp_path / "step_000001.bin", 1, *arrays(5))
    seed_write(tmp_path / "step_000002.bin", 3, *arrays(5))
    with pytest.warns(UserWarning, match="skipping generation 2: name says step 2, header says step 3"):
        assert Run(tmp_path).latest(allow_bare=True).step == 1
    assert check_bare(Run(tmp_path).generations()[1]) == "name says step 2, header says step 3"
    assert Run(tmp_path).generations()[1].check() == "not committed: no manifest"


def test_plot_series_marks_events(tmp_path):
    from ckptfmt.tools.plot import series
    make(tmp_path, 2)
    h = hist.History(tmp_path / ".loss.json")
    for s in (1, 2, 3):
        h.append({"step": s, "loss": 1.0, "source": "code" if s < 3 else "topics"})
    h.event("resume", 2)
    h.append({"step": 3, "loss": 0.5, "source": "code"})
    h.event("pivot", 3)
    h.close()
    d = series(str(tmp_path), ema=0.0, window=10)
    assert d["steps"] == [1, 2, 3] and d["loss"] == [1.0, 1.0, 0.5] and d["generations"] == [2]
    assert [e["event"] for e in d["events"]] == ["resume", "pivot"] and d["shares"]["code"] == [1.0]


# ---------------------------------------------------------------- stateful model
class RunMachine(RuleBasedStateMachine):
    """save / crash mid-save / corrupt / prune / resume against a model of what is valid."""

    def __init__(self):
        super().__init__()
        import tempfile
        self.dir = tempfile.mkdtemp()
        self.run = Run(self.dir)
        self.next_step = 1
        self.valid: set[int] = set()
        self.present: set[int] = set()

    @rule()
    def save(self):
        self.run.commit(self.next_step, *arrays(8, seed=self.next_step), manifest={})
        self.valid.add(self.next_step)
        self.present.add(self.next_step)
        self.next_step += 1

    @rule()
    def crash_mid_save(self):
        from ckptfmt import fsio

        def die(op, path):
            if op == "rename" and path.endswith(".json"):
                raise OSError(5, "simulated crash before the commit point")
        fsio.hook = die
        try:
            self.run.commit(self.next_step, *arrays(8), manifest={})
        except SaveError:
            pass
        finally:
            fsio.hook = None
        self.present.add(self.next_step)           # the .bin landed, the manifest did not
        self.next_step += 1

    @rule(data=st.data())
    def corrupt_one(self, data):
        if not self.valid:
            return
        step = data.draw(st.sampled_from(sorted(self.valid)))
        corrupt(self.run.path, step, data.draw(st.sampled_from(["bit_flip", "truncation", "missing_manifest"])))
        self.valid.discard(step)

    @rule(keep=st.integers(1, 3))
    def prune(self, keep):
        try:
            deleted = self.run.gc(keep_last=keep)
        except NoValidGenerationError:
            return
        assert max(self.valid, default=None) not in deleted
        self.valid -= set(deleted)

    @invariant()
    def loader_returns_the_newest_valid(self):
        if not self.present:
            return
        try:
            got = self.run.latest(deep=True)
        except NoValidGenerationError:
            got = None
        assert (got.step if got else None) == max(self.valid, default=None)


RunMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=15, deadline=None)
TestRunMachine = RunMachine.TestCase


def test_a_lock_marked_never_written_is_still_the_one_lock(tmp_path):
    """gc on a directory no writer held leaves .lock marked never written (RUN.md §2.2); it
    once removed it, and a writer that had opened the old .lock and a later one on a new .lock
    both held "the" lock."""
    import fcntl
    waiting = None
    with RunLock(tmp_path, purpose="gc", writes_generations=False):
        waiting = os.open(tmp_path / ".lock", os.O_RDWR)         # a writer opened it, not yet locked
    fcntl.flock(waiting, fcntl.LOCK_EX | fcntl.LOCK_NB)            # it gets the lock after gc
    try:
        with pytest.raises(RunLockedError):
            RunLock(tmp_path, purpose="trainer").acquire()         # and nobody else does
    finally:
        os.close(waiting)
    assert json.loads((tmp_path / ".lock").read_text()) == {"never_written": True}
    with RunLock(tmp_path, purpose="trainer"):                     # a writer that writes generations
        pass
    assert (tmp_path / ".lock").read_bytes() == b""                # ...leaves it empty, as before


@pytest.mark.parametrize("other", ["safetensors", "npz"])
def test_a_committed_bin_replaced_by_a_file_of_another_kind_is_damage_not_a_foreign_file(tmp_path, other):
    """A run's generation is read as its shape says: a step_N.bin whose bytes are a safetensors
    file or an .npz is a damaged .bin (exit 1), never "unverified, foreign" (exit 0)."""
    import numpy as np
    for s in (1, 2, 3):
        make(tmp_path, s, n=8, seed=s)
    target = tmp_path / "step_000002.bin"
    if other == "safetensors":
        from safetensors.numpy import save_file
        save_file({"a": np.ones(3, np.float32)}, str(target))
    else:
        with open(target, "wb") as f:
            np.savez(f, a=np.ones(3, np.float32))
    report = validate_run(tmp_path)
    assert not report.ok and any(str(target) in f.message for f in report.findings if f.level == "defect")
