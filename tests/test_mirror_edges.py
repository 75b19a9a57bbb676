"""Edges of mirror / import / validate URL found in review: what a user meets from outside
(diverged generations, odd URLs, an empty prefix, a destination that is the run itself), against
the same real S3 server as test_mirror.py (moto_server over HTTP through s3fs)."""
from __future__ import annotations

import json

import numpy as np

import ckptfmt
from ckptfmt.run import Run
from ckptfmt.run.ops import ls_run
from conftest import arrays, cli
from s3server import fixtures
from test_mirror import make_run


s3, bucket = fixtures("edge")


def nan_generation(run, step: int, n: int = 1000) -> None:
    w, m, v = arrays(n, step)
    w[3] = np.nan
    ckptfmt.save_generation(run, step, w, m, v)


def test_import_passes_over_a_diverged_newest_generation_as_resume_does(s3, bucket, tmp_path):
    """The newest generation at the URL diverged (its facts count a NaN): import took it, and
    a resume in DEST then refused ("no finite generation"), where the run that never left the
    machine resumes from the newest finite one. Import takes that one and says what it passed
    over; --step takes the diverged one; with none finite, the newest diverged one comes."""
    run = make_run(tmp_path / "run", steps=(10, 20))
    nan_generation(run, 30)
    url = f"s3://{bucket}/div"
    assert cli("mirror", str(run), url).returncode == 0
    proc = cli("import", url, str(tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "a").glob("step_*.bin")) == ["step_000020.bin"]
    assert (tmp_path / "a" / "step_000020.bin").read_bytes() == (run / "step_000020.bin").read_bytes()
    assert "passing over diverged generation 30 (weights: 1 non-finite values)" in proc.stderr
    assert Run(tmp_path / "a").latest().step == 20
    proc = cli("import", url, str(tmp_path / "b"), "--step", "30", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["step"] == 30, proc.stderr
    only = tmp_path / "only"
    only.mkdir()
    nan_generation(only, 40)
    assert cli("mirror", str(only), f"s3://{bucket}/only").returncode == 0
    proc = cli("import", f"s3://{bucket}/only", str(tmp_path / "c"), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["step"] == 40, proc.stderr


def test_validate_of_an_empty_or_mistyped_prefix_is_not_ok(s3, bucket, tmp_path):
    """``validate s3://bucket/typo`` said OK (exit 0) where a local directory without a
    generation says NO CHECKPOINT (exit 1): a mistyped backup check passed."""
    url = f"s3://{bucket}/typo"
    proc = cli("validate", url)
    assert proc.returncode == 1, proc.stdout
    assert proc.stdout.splitlines()[:2] == [f"{url}: NO CHECKPOINT",
                                            "  defect: no committed generation at this URL (an empty or mistyped prefix?)"]
    run = make_run(tmp_path / "run", steps=(10,))
    assert cli("mirror", str(run), url).returncode == 0
    doc = json.loads(cli("validate", url, "--json").stdout)
    assert doc["ok"] is True and "problem" not in doc


def test_a_file_url_that_is_the_run_itself_is_refused_and_nothing_is_deleted(tmp_path):
    """``mirror RUN file://RUN --keep-last 1`` applied the destination's retention to the run
    itself: it deleted local generations, past the run's leases and lock."""
    run = make_run(tmp_path / "run", steps=(10, 20, 30))
    before = sorted(p.name for p in run.iterdir())
    (tmp_path / "link").symlink_to(run)
    for url in (f"file://{run}", f"file://{run}/", f"file://{tmp_path}/link"):
        proc = cli("mirror", str(run), url, "--keep-last", "1")
        assert proc.returncode == 2, proc.stdout
        assert proc.stderr.strip().splitlines() == [
            f"ckptfmt: {url.rstrip('/')}: is the run directory {run} itself; mirror to another place"]
        assert sorted(p.name for p in run.iterdir()) == before
    assert cli("mirror", str(run), f"file://{tmp_path}/elsewhere", "--keep-last", "1").returncode == 0
    assert sorted(p.name for p in run.iterdir()) == sorted(before + [".mirrors.json", ".mirrors.lock"])


def test_a_trailing_slash_names_the_same_destination(s3, bucket, tmp_path):
    """``s3://b/x/`` and ``s3://b/x`` were recorded as two destinations: after mirroring to
    one, ls said the other was behind for ever."""
    run = make_run(tmp_path / "run", steps=(10,))
    assert cli("mirror", str(run), f"s3://{bucket}/x/").returncode == 0
    ckptfmt.save_generation(run, 20, *arrays(1000, 20))
    proc = cli("mirror", str(run), f"s3://{bucket}/x", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["url"] == f"s3://{bucket}/x", proc.stderr
    assert json.loads((run / ".mirrors.json").read_text())["destinations"].keys() == {f"s3://{bucket}/x"}
    assert f"mirror s3://{bucket}/x: up to date" in cli("ls", str(run)).stdout


def test_an_empty_path_segment_is_refused_before_anything_is_sent(s3, bucket, tmp_path):
    """``s3://b//x`` stored its objects under the key prefix "/x/", which a listing of the URL
    never finds: mirror said it uploaded every generation (recording them confirmed) while "at
    the URL" stayed empty, and import then found nothing."""
    run = make_run(tmp_path / "run", steps=(10,))
    for url in (f"s3://{bucket}//x", f"s3://{bucket}/a//b"):
        proc = cli("mirror", str(run), url)
        assert proc.returncode == 2, proc.stdout
        assert proc.stderr.splitlines() == [f"ckptfmt: {url}: empty path segment ('//') in the URL; "
                                            "write it without one"]
    assert s3.client().list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    assert not (run / ".mirrors.json").exists()


def test_a_watch_stops_on_a_refused_url_instead_of_retrying_it(s3, bucket, tmp_path):
    """A watch took every RemoteError for a network failure: a URL that is the run itself, or
    has an empty path segment, was a warning retried every interval, for ever. It is
    refused at once, exit 2, also while the run directory does not exist yet."""
    run = make_run(tmp_path / "run", steps=(10,))
    for where, url in ((run, f"file://{run}"), (run, f"s3://{bucket}//x"), (tmp_path / "later", f"s3://{bucket}//x")):
        proc = cli("mirror", str(where), url, "--watch", "--interval", "0.2", timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and "retrying" not in proc.stderr, proc.stderr


def test_keep_every_alone_is_retention_at_the_url_as_gc_applies_it(tmp_path):
    """``mirror RUN URL --keep-every N`` alone is a policy as ``gc --keep-every N`` is: the
    milestones and the guards (the newest) stay at the URL, nothing else (it was refused once,
    when the destination's retention knew only --keep-last with --keep-every)."""
    run = make_run(tmp_path / "run", steps=(5, 10, 15, 20, 25))
    proc = cli("mirror", str(run), f"file://{tmp_path}/m", "--keep-every", "10", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["at_destination"] == [10, 20, 25]
    assert cli("gc", str(run), "--keep-every", "10").returncode == 0
    assert sorted(int(p.stem[5:]) for p in run.glob("step_*.json")) == [10, 20, 25]


def test_watch_started_before_the_run_directory_waits_for_it(s3, bucket, tmp_path):
    """`mirror RUN URL --watch &` started just before the trainer (as the README puts it beside
    one) exited 2 on the missing directory; it says once that it waits, and mirrors when it comes."""
    import select
    import signal
    import subprocess
    import sys
    import time
    run, url = tmp_path / "run", f"s3://{bucket}/early"
    proc = subprocess.Popen([sys.executable, "-m", "ckptfmt.cli", "mirror", str(run), url, "--watch",
                             "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stderr], [], [], 120)     # it said it waits (no fixed sleep:
        said = proc.stderr.readline() if ready else ""              # a loaded machine imports slowly)
        assert proc.poll() is None
        make_run(run, steps=(10,))
        deadline = time.monotonic() + 60        # confirmed, and the pass done (its sidecars are there)
        while time.monotonic() < deadline and not ([m["newest_confirmed"] for m in ls_run(run)["mirrors"]] == [10]
                                                   and cli("validate", url).returncode == 0):
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert (said + err).splitlines() == [f"ckptfmt: {run}: no run directory yet; the first pass runs when it appears"]
    assert [m["newest_confirmed"] for m in ls_run(run)["mirrors"]] == [10] and cli("validate", url).returncode == 0


def test_two_mirrors_recording_at_once_keep_each_others_confirmations(tmp_path):
    """Two mirrors of one run to two destinations (the trainer's --mirror and a --watch to
    another tier) each read, change and replace .mirrors.json; without an order one replace
    dropped the other's confirmations (ls then said that destination was behind for ever)."""
    import subprocess
    import sys
    from ckptfmt.run import mirrors
    code = ("import sys; from ckptfmt.run import mirrors\n"
            "for step in range(1, 101): mirrors.record(sys.argv[1], sys.argv[2], confirmed={step: 'ab'})")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), url])
             for url in ("s3://b/one", "file:///two")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    recorded = mirrors.read(tmp_path)["destinations"]
    assert {url: len(d["confirmed"]) for url, d in recorded.items()} == {"s3://b/one": 100, "file:///two": 100}
    assert (tmp_path / ".mirrors.lock").read_bytes() == b""
