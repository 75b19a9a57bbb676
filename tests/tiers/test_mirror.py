"""ckptfmt mirror / import URL against a real local S3 server (moto_server over HTTP, reached
through s3fs/botocore): what arrives is verified, the manifest is the commit marker there,
retention applies there, damage there is replaced, failures are one line with exit 2; and what a
user meets from outside (diverged generations, odd URLs, an empty prefix, a destination that is
the run itself)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import blake3
import numpy as np
import pytest

import ckptfmt
from ckptfmt import shards
from ckptfmt.run import Run, roots
from ckptfmt.run.ops import ls_run
from conftest import ROOT, arrays, cli
import warm  # noqa: E402
from s3server import S3Server, fixtures

PY = sys.executable


s3, bucket = fixtures("bkt")


def objects(s3, bucket: str, prefix: str = "") -> dict[str, bytes]:
    """Every object under ``prefix`` (keys relative to it) with its bytes, read with boto3."""
    client = s3.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    return {k[len(prefix):]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def make_run(path: Path, steps=(10, 20), n: int = 1000) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for i, step in enumerate(steps):
        extra = {"buffers/x": np.arange(5, dtype="<f4")} if i % 2 else None
        ckptfmt.save_generation(path, step, *arrays(n, step), manifest={"config": {"k": step}}, extra_tensors=extra)
    (path / ".loss.json").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 21)))
    (path / ".pins.json").write_text("[]\n")
    return path


def test_mirror_uploads_every_generation_verified_and_the_manifest_commits_it(s3, bucket, tmp_path):
    run = make_run(tmp_path / "run")
    proc = cli("mirror", str(run), f"s3://{bucket}/runs/a", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [u["step"] for u in doc["uploaded"]] == [10, 20] and doc["at_destination"] == [10, 20]
    there = objects(s3, bucket, "runs/a/")
    for name in ("step_000010.bin", "step_000010.json", "step_000020.bin", "step_000020.extra.safetensors",
                 "step_000020.json", ".loss.json", ".pins.json"):
        assert there[name] == (run / name).read_bytes(), name
    manifest = json.loads(there["step_000020.json"])
    assert blake3.blake3(there["step_000020.bin"]).hexdigest() == manifest["blake3"]
    index = json.loads(there[".mirror-index.json"])["sidecars"]
    assert index[".loss.json"]["blake3"] == blake3.blake3((run / ".loss.json").read_bytes()).hexdigest()
    again = json.loads(cli("mirror", str(run), f"s3://{bucket}/runs/a", "--json").stdout)
    assert again["uploaded"] == [] and again["present"] == [10, 20]


def test_sharded_generation_is_mirrored_and_restored(s3, bucket, tmp_path):
    src = make_run(tmp_path / "single", steps=(30,))
    run = tmp_path / "sharded"
    shards.split(src / "step_000030.bin", run, 3)
    url = f"s3://{bucket}/sh"
    assert cli("mirror", str(run), url).returncode == 0
    there = objects(s3, bucket, "sh/")
    for rank in range(3):
        name = f"step_000030.shards/{rank:05d}-of-00003.bin"
        assert there[name] == (run / name).read_bytes()
    proc = cli("import", url, str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stderr
    with shards.ShardedCheckpoint(tmp_path / "back" / "step_000030.json", verify=True) as sc:
        assert np.array_equal(sc.weights, ckptfmt.open(src / "step_000030.bin").weights)


def test_a_generation_at_a_url_is_the_same_type_as_a_local_one_and_is_removed_through_its_store(s3, bucket, tmp_path):
    """One listing for every store: the mirror's generations (a .bin one with its companion, a
    sharded one) are ``Generation``s with the local ones' steps, shapes and commit state, their
    parts named in the store; an object of a generation's name with the wrong kind is foreign;
    ``remove()`` takes each shape away at the URL, manifest first, leaving the other."""
    from ckptfmt.generation import Generation, by_step, list_dir, list_store
    from ckptfmt.store.objects import ObjectStore
    run = make_run(tmp_path / "run", steps=(10, 20))
    shards.split(make_run(tmp_path / "single", steps=(30,)) / "step_000030.bin", run, 2)
    url = f"s3://{bucket}/same"
    assert cli("mirror", str(run), url).returncode == 0
    s3.client().put_object(Bucket=bucket, Key="same/step_000040.shards", Body=b"not a folder")
    store = ObjectStore(url)
    there, here = by_step(store), {g.step: g for g in list_dir(run).generations}
    assert all(type(g) is Generation for g in there.values()) and sorted(there) == sorted(here) == [10, 20, 30]
    for step, gen in there.items():
        assert (gen.committed, gen.sharded, gen.companion is None) == \
            (here[step].committed, here[step].sharded, here[step].companion is None), step
        assert gen.store is store and gen.manifest.name == here[step].manifest.name
    assert there[20].size == (run / "step_000020.bin").stat().st_size + (run / "step_000020.extra.safetensors").stat().st_size
    for step, gen in there.items():                                # the same parts, checked in the store
        assert [(p.name, p.size, p.blake3) for p in gen.parts()] == \
            [(p.name, p.size, p.blake3) for p in here[step].parts()] and all(p.path is None for p in gen.parts())
        assert gen.check() is None and gen.check(deep=True) is None, step
    shard = "same/step_000030.shards/00001-of-00002.bin"
    flipped = bytearray(s3.client().get_object(Bucket=bucket, Key=shard)["Body"].read())
    flipped[-1] ^= 1
    s3.client().put_object(Bucket=bucket, Key=shard, Body=bytes(flipped))
    assert there[30].check() is None                              # sizes and headers only
    assert there[30].check(deep=True).startswith("step_000030.shards/00001-of-00002.bin: ")
    with pytest.raises(ckptfmt.errors.FingerprintMismatchError, match="00001-of-00002.bin"):
        there[30].open()                                          # read in whole, every shard hashed
    with there[10].open() as ck, here[10].open() as mine:         # a .bin: read in whole, verified
        assert ck.verified and ck.weights.tobytes() == mine.weights.tobytes() and ck.manifest == mine.manifest
    assert [(str(p), why) for p, why in list_store(store).foreign] == \
        [("step_000040.shards", "a .shards entry that is not a directory")]
    there[30].remove()
    there[20].remove()
    left = sorted(objects(s3, bucket, "same/"))
    assert not [k for k in left if k.startswith(("step_000030", "step_000020"))], left
    assert {"step_000010.bin", "step_000010.json"} <= set(left)
    assert sorted(by_step(ObjectStore(url))) == [10]


def test_an_object_shorter_than_the_header_is_named_so(s3, bucket, tmp_path):
    """An empty or cut ``.bin`` at the URL: one line saying it is shorter than the header
    (no ranged read past its end, which S3 answers with 416)."""
    s3.client().put_object(Bucket=bucket, Key="cut/step_000010.bin", Body=b"")
    proc = cli("inspect", f"s3://{bucket}/cut/step_000010.bin")
    assert proc.returncode == 2 and "shorter than the 8-byte header" in proc.stderr, proc.stderr


def test_ls_reports_the_lag_from_local_records_only(s3, bucket, tmp_path):
    run = make_run(tmp_path / "run")
    url = f"s3://{bucket}/lag"
    assert cli("mirror", str(run), url).returncode == 0
    ckptfmt.save_generation(run, 30, *arrays(1000, 30))
    # the endpoint is now a closed port: ls must not need the network
    dead = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    proc = cli("ls", str(run), "--json", env=dead)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["mirrors"] == [
        {"url": url, "behind": [30], "newest_confirmed": 20, "updated": json.loads(proc.stdout)["mirrors"][0]["updated"]}]
    assert "1 generation behind [30]" in cli("ls", str(run), env=dead).stdout
    assert cli("mirror", str(run), url).returncode == 0
    assert ls_run(run)["mirrors"][0]["behind"] == []


def test_what_the_destination_retention_keeps_out_is_not_lag(s3, bucket, tmp_path):
    """Generations the destination's retention would delete at once are never uploaded (RUN.md
    §10.5); ls used to count them as behind for ever, so the how-to's mirror with --keep-last
    never said "up to date"."""
    run = make_run(tmp_path / "run", steps=(10, 20, 30))
    url = f"s3://{bucket}/keptout"
    assert cli("mirror", str(run), url, "--keep-last", "1").returncode == 0
    assert ls_run(run)["mirrors"][0]["behind"] == []
    assert f"mirror {url}: up to date" in cli("ls", str(run)).stdout
    ckptfmt.save_generation(run, 40, *arrays(1000, 40))
    assert ls_run(run)["mirrors"][0]["behind"] == [40]          # a new one is lag until mirrored
    assert cli("mirror", str(run), url).returncode == 0          # no retention there now: all go up
    assert ls_run(run)["mirrors"][0]["behind"] == []


def test_retention_at_the_destination_keeps_last_milestones_and_pins(s3, bucket, tmp_path):
    run = make_run(tmp_path / "run", steps=(100, 200, 300, 400, 500))
    (run / ".pins.json").write_text("[100]\n")
    url = f"s3://{bucket}/ret"
    doc = json.loads(cli("mirror", str(run), url, "--keep-last", "2", "--keep-every", "200", "--json").stdout)
    assert doc["at_destination"] == [100, 200, 400, 500]
    assert [u["step"] for u in doc["uploaded"]] == [100, 200, 400, 500]     # 300 is never sent
    ckptfmt.save_generation(run, 600, *arrays(1000, 600))
    ckptfmt.save_generation(run, 700, *arrays(1000, 700))
    doc = json.loads(cli("mirror", str(run), url, "--keep-last", "2", "--keep-every", "200", "--json").stdout)
    assert doc["deleted"] == [500] and doc["at_destination"] == [100, 200, 400, 600, 700]
    assert not any(k.startswith("step_000500") for k in objects(s3, bucket, "ret/"))


def test_retention_at_the_destination_never_deletes_its_newest_valid_generation_when_a_newer_one_is_damaged(
        s3, bucket, tmp_path):
    run = make_run(tmp_path / "run")
    url = f"s3://{bucket}/newer"
    assert cli("mirror", str(run), url).returncode == 0
    other = make_run(tmp_path / "other", steps=(30,))          # a newer generation there, its payload torn
    client = s3.client()
    client.put_object(Bucket=bucket, Key="newer/step_000030.bin", Body=(other / "step_000030.bin").read_bytes()[:-64])
    client.put_object(Bucket=bucket, Key="newer/step_000030.json", Body=(other / "step_000030.json").read_bytes())
    doc = json.loads(cli("mirror", str(run), url, "--keep-last", "1", "--json").stdout)
    assert doc["deleted"] == [10] and doc["at_destination"] == [20, 30]
    assert objects(s3, bucket, "newer/")["step_000020.bin"] == (run / "step_000020.bin").read_bytes()


def test_a_damaged_object_at_the_destination_is_replaced(s3, bucket, tmp_path):
    run = make_run(tmp_path / "run")
    url = f"s3://{bucket}/dmg"
    assert cli("mirror", str(run), url).returncode == 0
    data = bytearray(objects(s3, bucket, "dmg/")["step_000020.bin"])
    data[100] ^= 0x01
    s3.client().put_object(Bucket=bucket, Key="dmg/step_000020.bin", Body=bytes(data))
    doc = json.loads(cli("mirror", str(run), url, "--json").stdout)
    assert doc["replaced"] == [20] and doc["present"] == [10]
    assert objects(s3, bucket, "dmg/")["step_000020.bin"] == (run / "step_000020.bin").read_bytes()


def test_a_damaged_local_generation_is_not_sent(s3, bucket, tmp_path):
    run = make_run(tmp_path / "run")
    path = run / "step_000010.bin"
    data = bytearray(path.read_bytes())
    data[200] ^= 0x01
    path.write_bytes(bytes(data))
    proc = cli("mirror", str(run), f"s3://{bucket}/bad", "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout)["refused"] == [10]
    assert "not uploaded" in proc.stderr
    assert not any(k.startswith("step_000010") for k in objects(s3, bucket, "bad/"))


def test_restore_then_resume_is_bit_identical_to_the_straight_run(s3, bucket, tmp_path):
    def train(run, steps):
        proc = warm.run([PY, "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", str(steps),
                               "--config", "tiny", "--checkpoint-every", "20", "--sample-every", "20",
                               "--log-every", "100000"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
    pytest.importorskip("torch")
    train(tmp_path / "straight", 60)
    train(tmp_path / "run", 40)
    url = f"s3://{bucket}/train"
    assert cli("mirror", str(tmp_path / "run"), url).returncode == 0
    proc = cli("import", url, str(tmp_path / "restored"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["step"] == 40
    restored = tmp_path / "restored"
    for name in (".state.json", ".samples.json", "step_000040.bin", "step_000040.json"):
        assert (restored / name).read_bytes() == (tmp_path / "run" / name).read_bytes(), name
    history = (restored / ".loss.json").read_bytes()       # the run's, and the import that brought step 40 in
    before = (tmp_path / "run" / ".loss.json").read_bytes()
    event = json.loads(history[len(before):])
    assert history.startswith(before) and (event["event"], event["step"], event["source"]) == ("import", 40, url)
    assert event["root"] == roots.of_step(restored, 40)
    train(restored, 60)
    assert (ckptfmt.open(restored / "step_000060.bin").fingerprint()
            == ckptfmt.open(tmp_path / "straight" / "step_000060.bin").fingerprint())
    assert (restored / "step_000060.bin").read_bytes() == (tmp_path / "straight" / "step_000060.bin").read_bytes()


def test_restore_takes_the_newest_valid_generation_or_the_one_asked_for(s3, bucket, tmp_path):
    run = make_run(tmp_path / "run", steps=(10, 20, 30))
    url = f"s3://{bucket}/pick"
    assert cli("mirror", str(run), url).returncode == 0
    proc = cli("mirror", url, str(tmp_path / "at20"), "--step", "20")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "at20").iterdir() if p.name.startswith("step_")) == [
        "step_000020.bin", "step_000020.extra.safetensors", "step_000020.json"]
    data = bytearray(objects(s3, bucket, "pick/")["step_000030.bin"])
    data[50] ^= 0x04
    s3.client().put_object(Bucket=bucket, Key="pick/step_000030.bin", Body=bytes(data))
    proc = cli("import", url, str(tmp_path / "newest"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["step"] == 20 and "skipping generation 30" in proc.stderr
    assert (tmp_path / "newest" / "step_000020.bin").read_bytes() == (run / "step_000020.bin").read_bytes()
    assert cli("validate", str(tmp_path / "newest")).returncode == 0


def test_an_edited_manifest_at_the_destination_is_damage_that_validate_names_and_import_passes_over(s3, bucket, tmp_path):
    """One field of the newest mirrored manifest edited (its config, valid JSON still): validate
    URL exits 1 naming the manifest, import takes the previous generation saying why, and a
    mirror that runs again replaces the damaged manifest."""
    run = make_run(tmp_path / "run", steps=(10, 20))
    url = f"s3://{bucket}/seal"
    assert cli("mirror", str(run), url).returncode == 0
    doc = json.loads(objects(s3, bucket, "seal/")["step_000020.json"])
    doc["edited"] = True
    s3.client().put_object(Bucket=bucket, Key="seal/step_000020.json", Body=json.dumps(doc).encode())
    proc = cli("validate", url)
    assert proc.returncode == 1 and "field 'edited' is not covered by the manifest's seal" in proc.stdout, proc.stdout
    proc = cli("import", url, str(tmp_path / "back"), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["step"] == 10, proc.stderr
    assert "skipping generation 20" in proc.stderr and "seal" in proc.stderr
    assert cli("mirror", str(run), url).returncode == 0
    assert objects(s3, bucket, "seal/")["step_000020.json"] == (run / "step_000020.json").read_bytes()
    assert cli("validate", url).returncode == 0


def test_a_generation_swapped_in_at_the_mirror_is_damage_that_validate_names_and_import_passes_over(s3, bucket, tmp_path):
    """The newest mirrored generation replaced by another run's of the same step (payload and
    manifest, each matching its own digests): its root digest is not the one the mirrored
    history records, so validate URL exits 1 naming it, import takes the previous generation
    saying why and records in the restored history what it brought in."""
    run = make_run(tmp_path / "run", steps=(10, 20))
    for step in (10, 20):
        roots.record(run, "checkpoint", step)
    other = tmp_path / "other"
    other.mkdir()
    ckptfmt.save_generation(other, 20, *arrays(1000, 99), manifest={"config": {"k": 20}})
    url = f"s3://{bucket}/swapped"
    assert cli("mirror", str(run), url).returncode == 0
    for name in ("step_000020.bin", "step_000020.json"):
        s3.client().put_object(Bucket=bucket, Key=f"swapped/{name}", Body=(other / name).read_bytes())
    proc = cli("validate", url)
    assert proc.returncode == 1 and "not the generation this run committed at step 20" in proc.stdout, proc.stdout
    proc = cli("import", url, str(tmp_path / "back"), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["step"] == 10, proc.stderr
    assert "skipping generation 20: step_000020.json: not the generation this run committed" in proc.stderr, proc.stderr
    back = tmp_path / "back"
    assert roots.recorded(back / ".loss.json") == {10: roots.of_step(run, 10), 20: roots.of_step(run, 20)}
    assert json.loads((back / ".loss.json").read_text().splitlines()[-1])["event"] == "import"
    assert cli("validate", str(back)).returncode == 0


def test_a_mirrored_manifest_whose_payload_was_deleted_is_damage_named_everywhere(s3, bucket, tmp_path):
    """The newest payload object deleted at the destination (its manifest left): validate URL
    exits 1 naming it, import takes the previous generation saying which file it skipped and why,
    a mirror that runs again uploads it; the same lone manifest in the run directory is a defect
    too (a writer puts the manifest last and removes it first: only a loss leaves one)."""
    run = make_run(tmp_path / "run", steps=(10, 20))
    url = f"s3://{bucket}/lost"
    assert cli("mirror", str(run), url).returncode == 0
    s3.client().delete_object(Bucket=bucket, Key="lost/step_000020.bin")
    proc = cli("validate", url)
    assert proc.returncode == 1 and "20  manifest without its payload: the payload was lost after the commit" \
        in proc.stdout, proc.stdout
    proc = cli("import", url, str(tmp_path / "back"), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["step"] == 10, proc.stderr
    assert "skipping generation 20: step_000020.bin: " in proc.stderr and "not found" in proc.stderr, proc.stderr
    assert cli("mirror", str(run), url).returncode == 0 and cli("validate", url).returncode == 0
    (run / "step_000020.bin").unlink()
    proc = cli("validate", str(run))
    assert proc.returncode == 1 and f"{run / 'step_000020.json'}: manifest without its payload" in proc.stdout


def test_restore_refuses_a_non_empty_destination(s3, bucket, tmp_path):
    run = make_run(tmp_path / "run", steps=(10,))
    url = f"s3://{bucket}/ne"
    assert cli("mirror", str(run), url).returncode == 0
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep").write_text("mine")
    proc = cli("import", url, str(tmp_path / "d"))
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert (tmp_path / "d" / "keep").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckptfmt-tmp")]


def test_a_killed_mirror_leaves_no_committed_generation_and_the_next_completes_it(s3, bucket, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ckptfmt.save_generation(run, 10, *arrays(4_000_000, 1))            # 48 MB: three multipart parts
    url = f"s3://{bucket}/kill"
    proc = subprocess.Popen([PY, "-m", "ckptfmt.cli", "mirror", str(run), url], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ})
    client, deadline = s3.client(), time.monotonic() + 60
    while time.monotonic() < deadline and not client.list_multipart_uploads(Bucket=bucket).get("Uploads"):
        time.sleep(0.01)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads"), "no upload in flight was seen"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert "step_000010.json" not in objects(s3, bucket, "kill/")
    listed = json.loads(cli("mirror", str(run), url, "--json").stdout)
    assert [u["step"] for u in listed["uploaded"]] == [10]
    assert objects(s3, bucket, "kill/")["step_000010.bin"] == (run / "step_000010.bin").read_bytes()


def test_missing_bucket_and_unreachable_endpoint_are_one_line_exit_2(s3, tmp_path):
    run = make_run(tmp_path / "run", steps=(10,))
    proc = cli("mirror", str(run), "s3://no-such-bucket-here/x")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no such bucket" in proc.stderr
    proc = cli("mirror", str(run), "s3://bkt/x", env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unreachable" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_usage_errors(tmp_path):
    assert cli("mirror", str(tmp_path), str(tmp_path / "x")).returncode == 2
    assert cli("mirror", "s3://a/b", "s3://c/d").returncode == 2


def test_without_the_remote_extra_a_url_exits_2_naming_it(tmp_path):
    """The core imports and runs with fsspec and s3fs blocked; a URL then names the extra."""
    make_run(tmp_path / "run", steps=(10,))
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('fsspec', 's3fs'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import ckptfmt, ckptfmt.run, ckptfmt.tools.validate, ckptfmt.run.mirror, ckptfmt.tools.restore\n"
        "from ckptfmt.cli import main\n"
        "main(sys.argv[1:])\n")
    proc = subprocess.run([PY, "-c", code, "mirror", str(tmp_path / "run"), "s3://bkt/x"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'ckptfmt[remote]'" in proc.stderr and proc.stderr.count("\n") == 1
    ok = subprocess.run([PY, "-c", code, "validate", str(tmp_path / "run")], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr


def test_validate_ls_and_inspect_work_on_a_url(s3, bucket, tmp_path):
    run = make_run(tmp_path / "run")
    url = f"s3://{bucket}/v"
    assert cli("mirror", str(run), url).returncode == 0
    proc = cli("validate", url, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [g["status"] for g in doc["generations"]] == ["verified", "verified"]
    assert {s["file"] for s in doc["sidecars"]} == {".loss.json", ".pins.json"}
    listed = json.loads(cli("ls", url, "--json").stdout)["generations"]
    assert [(g["step"], g["committed"], g["size"]) for g in listed] == [
        (10, True, (run / "step_000010.bin").stat().st_size), (20, True, (run / "step_000020.bin").stat().st_size)]
    seen = json.loads(cli("inspect", f"{url}/step_000020.bin", "--json").stdout)
    manifest = json.loads((run / "step_000020.json").read_text())
    assert (seen["step"], seen["n_params"], seen["blake3"]) == (20, 1000, manifest["blake3"])
    data = bytearray(objects(s3, bucket, "v/")["step_000020.bin"])
    data[4000] ^= 0x10
    s3.client().put_object(Bucket=bucket, Key="v/step_000020.bin", Body=bytes(data))
    proc = cli("validate", url)
    assert proc.returncode == 1 and "blake3 mismatch" in proc.stdout
    assert cli("validate", url, "--fast").returncode == 0          # same size: only the bytes differ
    s3.client().put_object(Bucket=bucket, Key="v/step_000010.bin", Body=bytes(data[:-4]))
    proc = cli("validate", url, "--fast")
    assert proc.returncode == 1 and "expected" in proc.stdout
    s3.client().put_object(Bucket=bucket, Key="v/step_000030.bin", Body=b"partial")
    listing = cli("ls", url).stdout.splitlines()
    assert listing[1].split() == ["step", "size", "status"] and "not committed" in listing[-1]


def test_a_connection_cut_mid_upload_commits_nothing_and_the_next_mirror_completes(s3, bucket, tmp_path):
    from s3server import CuttingProxy
    run = tmp_path / "run"
    run.mkdir()
    ckptfmt.save_generation(run, 10, *arrays(4_000_000, 2))            # 48 MB
    url = f"s3://{bucket}/cut"
    proxy = CuttingProxy(s3.port, cut_after=20 << 20)
    try:
        proc = cli("mirror", str(run), url, env={"AWS_ENDPOINT_URL": proxy.endpoint}, timeout=240)
        assert proxy.cut and proc.returncode == 2, (proc.returncode, proc.stderr)
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert not [k for k in objects(s3, bucket, "cut/") if k.startswith("step_000010")]
        check = cli("validate", url)                                   # nothing committed, nothing damaged:
        assert check.returncode == 1 and "NO CHECKPOINT" in check.stdout and "(defect)" not in check.stdout
        proxy.heal()
        proc = cli("mirror", str(run), url, "--json", env={"AWS_ENDPOINT_URL": proxy.endpoint}, timeout=240)
        assert proc.returncode == 0, proc.stderr
        assert [u["step"] for u in json.loads(proc.stdout)["uploaded"]] == [10]
    finally:
        proxy.close()
    assert objects(s3, bucket, "cut/")["step_000010.bin"] == (run / "step_000010.bin").read_bytes()


def test_the_mirror_leases_what_it_has_still_to_upload_so_gc_keeps_it(s3, bucket, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ckptfmt.save_generation(run, 10, *arrays(4_000_000, 3))            # 48 MB: long enough to gc during
    ckptfmt.save_generation(run, 20, *arrays(1000, 4))
    url = f"s3://{bucket}/lease"
    proc = subprocess.Popen([PY, "-m", "ckptfmt.cli", "mirror", str(run), url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    client, deadline = s3.client(), time.monotonic() + 60
    while time.monotonic() < deadline and not client.list_multipart_uploads(Bucket=bucket).get("Uploads"):
        time.sleep(0.01)
    gc = json.loads(cli("gc", str(run), "--keep-last", "1", "--json").stdout)
    assert gc["deleted"] == [] and (run / "step_000010.bin").exists()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert objects(s3, bucket, "lease/")["step_000010.bin"] == (run / "step_000010.bin").read_bytes()
    assert json.loads(cli("gc", str(run), "--keep-last", "1", "--json").stdout)["deleted"] == [10]


def test_watch_mirrors_new_generations_and_exits_0_on_sigterm(s3, bucket, tmp_path):
    run = make_run(tmp_path / "run", steps=(10,))
    url = f"s3://{bucket}/watch"
    proc = subprocess.Popen([PY, "-m", "ckptfmt.cli", "mirror", str(run), url, "--watch", "--interval", "0.3",
                             "--keep-last", "2", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def at_destination():       # keys only: the watch's retention may delete between list and get
        listed = s3.client().list_objects_v2(Bucket=bucket, Prefix="watch/").get("Contents", [])
        return sorted(o["Key"][6:] for o in listed if o["Key"].startswith("watch/step_") and o["Key"].endswith(".json"))
    try:
        for step in (20, 30, 40):
            ckptfmt.save_generation(run, step, *arrays(1000, step))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and f"step_{step:06d}.json" not in at_destination():
                time.sleep(0.1)
            assert f"step_{step:06d}.json" in at_destination()
        deadline = time.monotonic() + 60                 # the pass's retention runs after its upload
        while time.monotonic() < deadline and at_destination() != ["step_000030.json", "step_000040.json"]:
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[-1] == {"stopped": "signal"} and all("error" not in d for d in lines)
    assert at_destination() == ["step_000030.json", "step_000040.json"]        # --keep-last 2 there
    assert cli("validate", url).returncode == 0
    assert ls_run(run)["mirrors"][0]["behind"] == []


def test_a_denied_bucket_is_one_line_exit_2_and_an_allowed_one_works(tmp_path):
    """A second server that enforces IAM: a user allowed on one bucket only."""
    run = make_run(tmp_path / "run", steps=(10,))
    with S3Server(auth=True) as server:
        server.client().create_bucket(Bucket="open")
        server.client().create_bucket(Bucket="closed")
        env = server.user("u", ["s3:*"], resources=["arn:aws:s3:::open", "arn:aws:s3:::open/*"])
        assert cli("mirror", str(run), "s3://open/x", env=env).returncode == 0
        proc = cli("mirror", str(run), "s3://closed/x", "--json", env=env)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "access denied" in proc.stderr
        assert json.loads(proc.stdout)["error"]["exit_code"] == 2
        assert env["AWS_SECRET_ACCESS_KEY"] not in proc.stderr + proc.stdout


def test_an_index_naming_a_path_outside_the_run_is_refused(s3, bucket, tmp_path):
    run = make_run(tmp_path / "run", steps=(10,))
    url = f"s3://{bucket}/evil"
    assert cli("mirror", str(run), url).returncode == 0
    s3.client().put_object(Bucket=bucket, Key="evil/.mirror-index.json", Body=json.dumps(
        {"sidecars": {"../escaped": {"size": 1, "blake3": "0" * 64}}}).encode())
    proc = cli("import", url, str(tmp_path / "dest"))
    assert proc.returncode == 2 and "unexpected file" in proc.stderr
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "dest").exists()


@pytest.mark.timeout(300)      # four trainings and a mirror catching up (120 s at most) on 2 loaded cores
def test_watch_beside_a_trainer_with_sigterm_and_resume_cycles_then_import_resumes_bit_exactly(s3, bucket, tmp_path):
    """The issue's end-to-end check: the destination ends with exactly what its retention keeps,
    each generation validating there, and import + resume reproduces the straight run."""
    pytest.importorskip("torch")
    from conftest import last_step

    def train(run, steps, stop_at=None):
        args = [PY, "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", str(steps), "--config", "tiny",
                "--checkpoint-every", "10", "--keep-last", "3", "--sample-every", "20", "--log-every", "100000"]
        proc = warm.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if stop_at is not None:
            deadline = time.monotonic() + 120
            while last_step(run) < stop_at and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err

    train(tmp_path / "straight", 100)
    run, url = tmp_path / "run", f"s3://{bucket}/e2e"
    run.mkdir()
    watch = subprocess.Popen([PY, "-m", "ckptfmt.cli", "mirror", str(run), url, "--watch", "--interval", "0.2",
                              "--keep-last", "2", "--keep-every", "40", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        train(run, 80, stop_at=25)
        train(run, 80, stop_at=55)
        client, deadline = s3.client(), time.monotonic() + 120
        while not [o for o in client.list_objects_v2(Bucket=bucket, Prefix="e2e/step_000040.json").get("Contents", [])]:
            assert time.monotonic() < deadline, "the watch never mirrored step 40"     # before the next start's
            time.sleep(0.1)                                # retention deletes it here (keep-last 3)
        train(run, 80)
        deadline = time.monotonic() + 120
        local_history = (run / ".loss.json").read_bytes()
        while time.monotonic() < deadline:            # until a pass has seen the end of training
            listed = client.list_objects_v2(Bucket=bucket, Prefix="e2e/step_").get("Contents", [])
            manifests = sorted(o["Key"] for o in listed if o["Key"].endswith(".json"))
            try:
                history = client.get_object(Bucket=bucket, Key="e2e/.loss.json")["Body"].read()
            except client.exceptions.NoSuchKey:
                history = None
            if history == local_history and manifests == [f"e2e/step_{s:06d}.json" for s in (40, 70, 80)]:
                break
            time.sleep(0.1)
    finally:
        watch.send_signal(signal.SIGTERM)
        out, err = watch.communicate(timeout=60)
    assert watch.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == {"stopped": "signal"}
    listed = json.loads(cli("ls", url, "--json").stdout)["generations"]
    assert [g["step"] for g in listed if g["committed"]] == [40, 70, 80]
    assert cli("validate", url).returncode == 0
    proc = cli("import", url, str(tmp_path / "restored"), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["step"] == 80, proc.stderr
    train(tmp_path / "restored", 100)
    assert ((tmp_path / "restored" / "step_000100.bin").read_bytes()
            == (tmp_path / "straight" / "step_000100.bin").read_bytes())


def test_ls_remote_checks_the_destination(s3, bucket, tmp_path):
    run = make_run(tmp_path / "run")
    url = f"s3://{bucket}/lsr"
    assert cli("mirror", str(run), url).returncode == 0
    s3.client().delete_object(Bucket=bucket, Key="lsr/step_000010.json")      # uncommitted there now
    assert json.loads(cli("ls", str(run), "--json").stdout)["mirrors"][0]["behind"] == []   # the record
    row = json.loads(cli("ls", str(run), "--remote", "--json").stdout)["mirrors"][0]
    assert row["at_destination"] == [20] and row["behind"] == [10]


def test_a_checkpoint_manager_mirrors_on_a_background_thread_through_its_on_commit_hook(s3, bucket, tmp_path):
    pytest.importorskip("torch")
    from ckptfmt.run.mirror_thread import BackgroundMirror
    from ckptfmt.torch import CheckpointManager
    from models import tiny_adamw, train_steps
    run, url = tmp_path / "run", f"s3://{bucket}/mgr"
    model, opt = tiny_adamw()
    bg = BackgroundMirror(run, url)
    hook_seconds = []

    def on_commit(step, manifest):
        t = time.perf_counter()
        bg.on_commit(step, manifest)
        hook_seconds.append(time.perf_counter() - t)
    with CheckpointManager(run, model, opt, every=5, keep_last=2, handle_signals=False, on_commit=on_commit) as mgr:
        mgr.restore()
        for step in range(1, 21):
            loss = train_steps(model, opt, 1)
            mgr.step(step, loss=loss.item())
        mgr.close(20)
    done = bg.close(timeout=120)
    assert done["errors"] == [] and bg.lag() == [] and max(hook_seconds) < 0.05
    assert json.loads(cli("ls", url, "--json").stdout)["generations"][-1]["step"] == 20
    assert cli("validate", url).returncode == 0
    assert objects(s3, bucket, "mgr/")["step_000020.bin"] == (run / "step_000020.bin").read_bytes()


def test_fsspec_options_from_the_environment_reach_the_client(s3, bucket, tmp_path):
    """fsspec's own configuration (FSSPEC_S3_ENDPOINT_URL) works as well as AWS_ENDPOINT_URL."""
    run = make_run(tmp_path / "run", steps=(10,))
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    env["FSSPEC_S3_ENDPOINT_URL"] = s3.endpoint
    proc = subprocess.run([PY, "-m", "ckptfmt.cli", "mirror", str(run), f"s3://{bucket}/fsenv"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert objects(s3, bucket, "fsenv/")["step_000010.bin"] == (run / "step_000010.bin").read_bytes()


def test_train_mirrors_each_generation_in_the_background_with_the_same_retention(s3, bucket, tmp_path):
    """``ckptfmt train --mirror URL`` (the manager's ``mirror=``): the destination ends holding
    exactly what local retention keeps, each generation validating there, and ls reports no lag."""
    pytest.importorskip("torch")
    run, url = tmp_path / "run", f"s3://{bucket}/live"
    proc = warm.run([PY, "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", "50", "--config", "tiny",
                           "--checkpoint-every", "10", "--keep-last", "2", "--sample-every", "0",
                           "--log-every", "100000", "--async-save", "--mirror", url],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    local = sorted(int(p.name[5:11]) for p in run.glob("step_*.json"))
    there = sorted(int(k[5:11]) for k in objects(s3, bucket, "live/") if k.startswith("step_") and k.endswith(".json"))
    assert there == [40, 50] and set(there) <= set(local)     # local retention may lag: a mirror's lease
    assert local[-2:] == [40, 50]                               # defers deletion to the next pass
    assert cli("validate", url).returncode == 0
    doc = ls_run(run)
    assert len(doc["mirrors"]) == 1 and not set(doc["mirrors"][0]["behind"]) & {40, 50}, doc["mirrors"]


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
    """`mirror RUN URL --watch &` started just before the trainer (as the object-storage how-to puts it beside
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
