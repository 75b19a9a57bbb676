"""The file commands on a run written straight to object storage, given its URL: ``export``,
``fork``, ``bisect``, ``pivot``, ``plot`` and ``inspect`` (a real S3-protocol server, moto's, on
127.0.0.1). Each gives what it gives on the same run imported into a local directory
(``import URL DEST``): the same exported bytes, the same comparison, the same figure, the same
inspection; a fork from the URL resumes bit-exactly; a URL that holds no run is one line, exit 2."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("s3fs")

from ckptfmt import format as fmt  # noqa: E402
from ckptfmt.run import history as hist  # noqa: E402
from ckptfmt.run.storerun import open_run  # noqa: E402
from ckptfmt.tools.plot import series  # noqa: E402
from ckptfmt.tools.restore import restore  # noqa: E402
from ckptfmt.torch import CheckpointManager  # noqa: E402
from conftest import cli  # noqa: E402
from s3server import fixtures  # noqa: E402
from storeloop import build, train  # noqa: E402

s3, _ = fixtures("cmds")
STEPS, EVERY = 12, 4


def body(s3, bucket: str, key: str) -> bytes:
    return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()


@pytest.fixture(scope="module")
def made(s3, tmp_path_factory):
    """A run trained to step 12 at s3://cmds/runs/x (generations 4, 8, 12), and the same run
    imported into a local directory also named x (a figure's legend names a run by its last name)."""
    bucket, url = s3.bucket("cmds"), "s3://cmds/runs/x"
    model, opt = build()
    noise = np.random.default_rng(1)
    with CheckpointManager(url, model, opt, generators={"noise": noise}, every=EVERY, digests=True) as mgr:
        train(mgr, model, opt, 0, STEPS, noise)
    local = tmp_path_factory.mktemp("imported") / "x"
    assert restore(url, local)["step"] == STEPS          # what import URL DEST does, in this process
    return bucket, url, local


def run_json(*args: str):
    done = cli(*args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_export_of_the_url_is_byte_for_byte_the_export_of_its_import(s3, made, tmp_path):
    bucket, url, local = made
    step = fmt.checkpoint_name(STEPS)
    there, here = run_json("export", url, str(tmp_path / "a")), run_json("export", str(local), str(tmp_path / "b"))
    assert there["steps"] == here["steps"] == [STEPS] and there["source_run"] == url
    parts = [step, fmt.manifest_name(STEPS), f"step_{STEPS:06d}.extra.safetensors"]
    for name in parts:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes() == \
            body(s3, bucket, f"runs/x/{name}"), name
    # its history is the segments joined, as a local run appends it
    assert (tmp_path / "a" / hist.NAME).read_bytes() == open_run(url).history.read_all()
    assert cli("validate", str(tmp_path / "a")).returncode == 0
    # a generation the import did not bring: exported from the URL, verified at the destination
    older = run_json("export", url, str(tmp_path / "c"), "--steps", "4,8")
    assert older["steps"] == [4, 8] and older["verified"]["validated"]["status"] == "verified"
    assert (tmp_path / "c" / fmt.checkpoint_name(8)).read_bytes() == body(s3, bucket, f"runs/x/{fmt.checkpoint_name(8)}")
    # weights only (the generation brought here, then converted): as of the import
    weights = f"{fmt.stem(STEPS)}.safetensors"
    run_json("export", url, str(tmp_path / "w"), "--weights-only")
    run_json("export", str(local), str(tmp_path / "v"), "--weights-only")
    assert (tmp_path / "w" / weights).read_bytes() == (tmp_path / "v" / weights).read_bytes()
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == sorted(p.name for p in (tmp_path / "v").iterdir())


def resumed_from(run: str, step: int) -> None:
    """A new manager on ``run``, other weights and generators: resumed at ``step`` and trained to STEPS."""
    model, opt = build(seed=99)                    # other weights: all must come from the fork
    noise = np.random.default_rng(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr = CheckpointManager(run, model, opt, generators={"noise": noise}, every=EVERY)
        assert mgr.restore() == step
        train(mgr, model, opt, step, STEPS, noise)
        mgr.close(STEPS)


@pytest.mark.parametrize("into", ["local", "url"])
def test_a_fork_from_the_url_resumes_bit_exactly(s3, made, tmp_path, into):
    """Into a local directory, or into another prefix of the store (written through the
    store's write path, under the new run's lease): the fork at step 8, resumed to step 12,
    commits the very bytes the run trained straight did."""
    bucket, url, _ = made
    dest = str(tmp_path / "child") if into == "local" else f"s3://{s3.bucket('child')}/runs/c"
    forked = run_json("fork", url, dest, "--step", "8")
    assert forked["step"] == 8 and forked["history_records"] == 8 and forked["dest"] == dest
    run = open_run(dest)
    doc = run.generations()[0].read_manifest()
    assert doc["provenance"]["parent_run"] == url and doc["provenance"]["parent_step"] == 8
    resumed_from(dest, 8)
    names = (fmt.checkpoint_name(STEPS), f"step_{STEPS:06d}.extra.safetensors")
    assert [open_run(dest).store.read_bytes(n) if into == "url" else (tmp_path / "child" / n).read_bytes()
            for n in names] == [body(s3, bucket, f"runs/x/{n}") for n in names]


def test_a_fork_into_a_url_that_holds_objects_is_refused_and_leaves_them(s3, made):
    bucket, url, local = made
    dest = f"s3://{bucket}/runs/x"
    before = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket, Prefix="runs/x/")["Contents"])
    done = cli("fork", str(local), dest, "--step", str(STEPS))
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and said == f"ckptfmt: {dest}: holds objects already; refusing to fork into it", said
    after = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket, Prefix="runs/x/")["Contents"])
    assert after == before


def test_a_local_run_forked_into_a_url_is_the_same_run_there(s3, made):
    _, url, local = made
    dest = f"s3://{s3.bucket('fromlocal')}/runs/f"
    assert run_json("fork", str(local), dest, "--step", str(STEPS))["history_records"] == STEPS
    assert run_json("bisect", str(local), dest)["identical"]
    assert cli("validate", dest).returncode == 0


def test_bisect_plot_and_inspect_of_the_url_say_what_they_say_of_its_import(made, tmp_path):
    _, url, local = made
    same = run_json("bisect", url, str(local))
    assert same["identical"] and same["common_generations"] == [STEPS] and same["history_steps"] == [STEPS, STEPS]
    drawn = [run_json("plot", run, "--out", str(tmp_path / f"{i}.png")) for i, run in enumerate((url, local))]
    assert [{k: v for k, v in d["runs"][0].items() if k != "run"} for d in drawn] == \
        [{"steps": STEPS, "events": 0, "smoothing": drawn[1]["runs"][0]["smoothing"]}] * 2
    assert drawn[0]["legend"] == drawn[1]["legend"]
    assert (tmp_path / "0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the curves drawn are the same numbers (the import holds one generation, the URL three)
    curves = [series(run) for run in (url, str(local))]
    assert curves[0]["generations"] == [4, 8, STEPS] and curves[1]["generations"] == [STEPS]
    assert all(curves[0][k] == curves[1][k] for k in ("steps", "loss", "ema"))
    there, here = run_json("inspect", url), run_json("inspect", str(local))
    assert [g["step"] for g in there["generations"]] == [4, 8, STEPS]
    assert there["latest"]["path"] == f"{url}/{fmt.checkpoint_name(STEPS)}"
    assert {k: v for k, v in there["latest"].items() if k != "path"} == \
        {k: v for k, v in here["latest"].items() if k != "path"}
    assert there["latest"]["fingerprint"] == "verified"


def test_bisect_of_the_url_finds_where_a_run_parted_from_it(s3, made, tmp_path):
    """A run that trained alike to step 8 and then on other data: the first differing step. Its
    history (both runs record state digests on the store, spec/RUN.md §3.9) parts at step 9, where
    the registered generator stops being the one drawn from (§6.5), whatever step the loss parts at."""
    _, url, _ = made
    other = f"s3://{s3.bucket('parted')}/runs/y"
    model, opt = build()
    noise = np.random.default_rng(1)
    with CheckpointManager(other, model, opt, generators={"noise": noise}, every=EVERY, digests=True) as mgr:
        train(mgr, model, opt, 0, 8, noise)
        train(mgr, model, opt, 8, STEPS, np.random.default_rng(5))
    losses = [[r["loss"] for r in open_run(u).history.read().canonical()] for u in (url, other)]
    parted = next(s for s, (a, b) in enumerate(zip(*losses), start=1) if a != b)
    assert parted > 8
    done = cli("bisect", url, other)
    steps, why = done.stdout.splitlines()
    assert done.returncode == 1 and steps == "generations: first differ at step 12 (last identical: " \
        "step 8); history: first differ at step 9", done.stdout + done.stderr
    assert why.startswith("step 9: rng.noise differs") and "weights, m and v at step 8 identical" in why, why


def test_a_pivot_of_the_url_archives_its_sidecars_on_the_store(s3, made):
    bucket, url, _ = made
    s3.client().put_object(Bucket=bucket, Key="runs/x/.samples.json", Body=b'{"seen": 3}\n')
    first = run_json("pivot", url, "--note", "polish")
    assert first["step"] == STEPS and first["archived"] == [".samples.json"]
    assert first["archive"] == f"archive/{fmt.stem(STEPS)}"
    assert body(s3, bucket, f"runs/x/archive/{fmt.stem(STEPS)}/samples.json") == b'{"seen": 3}\n'
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix="runs/x/").get("Contents", [])
    keys = {o["Key"] for o in listed}
    assert "runs/x/.samples.json" not in keys and not [k for k in keys if "/.writer." in k]
    assert json.loads(body(s3, bucket, "runs/x/.pivot.json"))["note"] == "polish"
    events = [(r["event"], r["step"], r.get("note")) for r in open_run(url).history.read().events()]
    assert ("pivot", STEPS, "polish") in events
    assert run_json("pivot", url)["archive"] == f"archive/{fmt.stem(STEPS)}.2"      # a second one beside it


def test_diff_of_a_generation_at_the_url(made):
    _, url, local = made
    same = run_json("diff", f"{url}/{fmt.checkpoint_name(STEPS)}", str(local / fmt.checkpoint_name(STEPS)))
    assert same["verdict"] == "bit-identical" and not same["companion_differs"] and same["header"]["step"] == [STEPS, STEPS]
    done = cli("diff", f"{url}/{fmt.checkpoint_name(8)}", f"{url}/{fmt.checkpoint_name(STEPS)}", "--json")
    parted = json.loads(done.stdout)
    assert done.returncode == 1 and parted["header"]["step"] == [8, STEPS]
    assert all(r["n_diff"] > 0 for r in parted["regions"].values())
    done = cli("diff", f"{url}/{fmt.checkpoint_name(5)}", str(local / fmt.checkpoint_name(STEPS)))
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and said == f"ckptfmt: {url}/{fmt.checkpoint_name(5)}: no committed generation " \
        "of that name at the URL", said


def test_a_generation_damaged_at_the_url_is_never_copied_or_compared(s3, made, tmp_path):
    """A copy of the run whose step-8 .bin has one bit flipped on the store: export and fork of
    that step and diff of it refuse it (exit 1, one line naming it) and leave nothing behind."""
    bucket, _, _ = made
    client = s3.client()
    for o in client.list_objects_v2(Bucket=bucket, Prefix="runs/x/")["Contents"]:
        client.copy_object(Bucket=bucket, Key="runs/damaged/" + o["Key"][len("runs/x/"):],
                           CopySource={"Bucket": bucket, "Key": o["Key"]})
    key = f"runs/damaged/{fmt.checkpoint_name(8)}"
    data = bytearray(body(s3, bucket, key))
    data[100] ^= 0x04
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    url = f"s3://{bucket}/runs/damaged"
    for argv in (("export", url, str(tmp_path / "e"), "--steps", "8"), ("fork", url, str(tmp_path / "f"), "--step", "8"),
                 ("diff", f"{url}/{fmt.checkpoint_name(8)}", f"{url}/{fmt.checkpoint_name(8)}")):
        done = cli(*argv)
        said = (done.stdout + done.stderr).strip()
        assert done.returncode == 1 and len(said.splitlines()) == 1 and fmt.checkpoint_name(8) in said, said
    assert not list(tmp_path.iterdir())
    leases = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="runs/damaged/.lease.").get("Contents", [])]
    assert leases == []                                  # each reader's lease went with it


@pytest.mark.parametrize("argv", [
    ("export", "{none}", "{tmp}/out"),
    ("fork", "{none}", "{tmp}/out", "--step", "4"),
    ("bisect", "{none}", "{url}"),
    ("pivot", "{none}"),
    ("plot", "{none}", "--out", "{tmp}/loss.png"),
    ("inspect", "{none}"),
    ("diff", "{none}/step_000004.bin", "{url}/step_000004.bin"),
])
def test_a_url_that_holds_no_run_is_one_line_exit_2(made, tmp_path, argv):
    _, url, _ = made
    done = cli(*[a.format(none="s3://cmds/runs/nothing", url=url, tmp=tmp_path) for a in argv])
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and said == "ckptfmt: s3://cmds/runs/nothing: no run at this URL " \
        "(an empty or mistyped prefix?)", said
    assert not list(tmp_path.iterdir())


def test_validate_of_a_generation_url_validates_that_generation_as_of_a_local_file(s3, made):
    """``validate URL/step_N.bin`` checks that generation (as ``validate DIR/step_N.bin`` does):
    OK when it verifies, DAMAGED when its bytes were flipped; its ``.json`` alone is refused as
    locally (pass its ``.bin``), and one not there is exit 2 as a missing file; ``ls``, ``gc`` and
    ``pin`` refuse such a URL in one line naming the run, never reading it as a prefix."""
    bucket, url, _ = made
    done = run_json("validate", f"{url}/{fmt.checkpoint_name(8)}")
    assert done["ok"] and [(g["step"], g["status"]) for g in done["generations"]] == [(8, "verified")]
    for name, said in ((fmt.manifest_name(8), "validate cannot read a generation's manifest alone (pass its "
                        f"{fmt.checkpoint_name(8)})"), (fmt.checkpoint_name(5), "no such object in the run at the URL")):
        done = cli("validate", f"{url}/{name}")
        assert done.returncode == 2 and (done.stdout + done.stderr).strip() == f"ckptfmt: {url}/{name}: {said}"
    for argv in (("ls",), ("gc", "--keep-last", "1"), ("pin", "8")):
        done = cli(argv[0], f"{url}/{fmt.checkpoint_name(8)}", *argv[1:])
        assert done.returncode == 2 and (done.stdout + done.stderr).strip() == \
            f"ckptfmt: {url}/{fmt.checkpoint_name(8)}: names a generation's {fmt.checkpoint_name(8)}, not a run: " \
            f"the run is {url}", done.stdout + done.stderr
    assert not [o for o in s3.client().list_objects_v2(Bucket=bucket, Prefix=f"runs/x/{fmt.checkpoint_name(8)}/")
                .get("Contents", [])]                    # no lease taken under the generation's name
    key = f"runs/x/{fmt.checkpoint_name(4)}"
    data = bytearray(body(s3, bucket, key))
    data[100] ^= 0x04
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
    try:
        done = cli("validate", f"{url}/{fmt.checkpoint_name(4)}")
        assert done.returncode == 1 and "DAMAGED" in done.stdout and "blake3" in done.stdout, done.stdout
    finally:
        data[100] ^= 0x04
        s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))


def test_ls_of_a_prefix_without_a_generation_says_no_checkpoint_exit_1(made):
    done = cli("ls", "s3://cmds/runs/nothing")
    assert done.returncode == 1 and done.stdout.splitlines() == [
        "s3://cmds/runs/nothing",
        "  NO CHECKPOINT: s3://cmds/runs/nothing: no generation at this URL (an empty or mistyped prefix?)"]


@pytest.mark.parametrize("url,package", [("gs://b/r", "gcsfs"), ("az://c/r", "adlfs")])
def test_a_url_whose_fsspec_filesystem_is_missing_names_that_package(url, package):
    pytest.importorskip("fsspec")
    try:
        __import__(package)
        pytest.skip(f"{package} is installed here")
    except ImportError:
        pass
    done = cli("ls", url)
    assert done.returncode == 2 and (done.stdout + done.stderr).strip() == \
        f"ckptfmt: {url}: {url.split(':')[0]}:// URLs need fsspec's {package}: pip install {package}"
