import json
import sys

import pytest

pytest.importorskip("torch")

import ckptfmt  # noqa: E402
from ckptfmt.errors import DestinationExistsError, ExportError  # noqa: E402
from ckptfmt.tools.archive import archive, import_archive  # noqa: E402
from ckptfmt.tools.export import INCOMPLETE, export  # noqa: E402
from ckptfmt.trainer.export_check import export_check  # noqa: E402
from conftest import arrays, cli, seed_write  # noqa: E402
import warm  # noqa: E402

PY = sys.executable


def train(run, steps):
    proc = warm.run([PY, "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", str(steps), "--config", "tiny",
                           "--checkpoint-every", "20", "--sample-every", "20", "--log-every", "100000"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("exp")
    train(base / "straight", 60)
    train(base / "run", 40)
    return base


def test_export_then_resume_gives_the_same_bytes(trained, tmp_path):
    dest = tmp_path / "dest"
    doc = export(str(trained / "run"), str(dest), check=export_check)
    assert doc["steps"] == [40] and doc["verified"]["validated"]["status"] == "verified"
    assert "loaded into a fresh tiny model" in doc["verified"]["loaded"]
    assert not (dest / INCOMPLETE).exists() and (dest / "EXPORT.md").exists()
    said = next(line for line in (dest / "EXPORT.md").read_text().splitlines() if "verified at this" in line)
    assert f"{doc['verified']['files_rehashed']} files rehashed; step_000040.bin verified; loaded into" in said
    assert "{" not in said                         # words for a person, not the JSON of export.json
    assert json.loads((dest / "export.json").read_text())["final_loss"]["history_steps"] == 40
    assert (dest / ".loss.json").read_bytes() == (trained / "run" / ".loss.json").read_bytes()
    assert cli("validate", str(dest)).returncode == 0
    train(dest, 60)
    a = ckptfmt.open(dest / "step_000060.bin").fingerprint()
    assert a == ckptfmt.open(trained / "straight" / "step_000060.bin").fingerprint()


def test_a_byte_flipped_at_the_destination_is_caught(trained, tmp_path):
    def flip(dest):
        path = dest / "step_000040.bin"
        data = bytearray(path.read_bytes())
        data[1000] ^= 0x01
        path.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="blake3 at destination"):
        export(str(trained / "run"), str(tmp_path / "d" / "new"), tamper=flip)
    assert not (tmp_path / "d").exists()        # nothing left, the parent it made neither


def test_an_export_stopped_in_an_empty_directory_leaves_it_empty(trained, tmp_path):
    """A failure or an interrupt empties DEST again (it was empty: it may be a mount point, so it
    stays); only a crash can leave the marker, which validate refuses (the CLI contract's tests)."""
    (tmp_path / "d").mkdir()
    seen = []

    def crash(dest):
        seen.extend(sorted(p.name for p in dest.iterdir()))
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        export(str(trained / "run"), str(tmp_path / "d"), tamper=crash)
    assert INCOMPLETE in seen and "step_000040.bin" in seen and list((tmp_path / "d").iterdir()) == []


def test_non_empty_destination_is_refused(trained, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("keep me")
    with pytest.raises(DestinationExistsError):
        export(str(trained / "run"), str(tmp_path / "d"))
    proc = cli("export", str(trained / "run"), str(tmp_path / "d"))
    assert proc.returncode == 2 and (tmp_path / "d" / "x").read_text() == "keep me"


def test_archive_round_trip_is_byte_identical(trained, tmp_path):
    doc = archive(str(trained / "run"), str(tmp_path / "run.tar.zst"), steps=[20, 40])
    assert doc["archive"]["size"] > 0
    out = import_archive(str(tmp_path / "run.tar.zst"), str(tmp_path / "back"))
    assert out["verified"] and out["steps"] == [20, 40]
    for name in ("step_000020.bin", "step_000040.json", ".loss.json", ".state.json"):
        assert (tmp_path / "back" / name).read_bytes() == (trained / "run" / name).read_bytes()
    data = bytearray((tmp_path / "run.tar.zst").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "bad.tar.zst").write_bytes(bytes(data))
    with pytest.raises(ExportError):
        import_archive(str(tmp_path / "bad.tar.zst"), str(tmp_path / "back2"))


def test_bare_run_export_says_unverified(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    seed_write(run / "step_000100.bin", 100, *arrays(10))
    proc = cli("export", str(run), str(tmp_path / "d"), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["bare"] and doc["files"][0]["verified_against"] == "unverified (bare file)"
    assert "UNVERIFIED" in (tmp_path / "d" / "EXPORT.md").read_text()


def test_weights_only_export(trained, tmp_path):
    from safetensors.numpy import load_file
    doc = export(str(trained / "run"), str(tmp_path / "w"), weights_only=True, with_history=False)
    tensors = load_file(str(tmp_path / "w" / "step_000040.safetensors"))
    assert "weights/tok.weight" in tensors and not any(k.startswith("m/") for k in tensors)
    assert doc["verified"]["files_rehashed"] >= 1


def test_a_sharded_generation_of_the_trainer_exports_and_loads_into_a_fresh_model(trained, tmp_path):
    """The export check loads what the generation is, whatever its shape: a run whose newest
    generation was converted into shards exports it and proves it loads (it read the sharded
    manifest as a .bin and called the export damaged)."""
    assert cli("convert", str(trained / "run" / "step_000040.bin"), str(tmp_path / "sharded"), "--to",
               "shards").returncode == 0
    for dest, more in ((tmp_path / "dest", ()), (tmp_path / "dest.tar.zst", ("--archive",))):
        done = cli("export", str(tmp_path / "sharded"), str(dest), "--latest", *more)
        assert done.returncode == 0 and "loaded into a fresh tiny model + AdamW at step 40" in done.stdout, done.stderr


def test_an_export_archive_validates_against_its_own_record_and_a_flip_names_the_member(trained, tmp_path):
    """validate of an export archive (and of the first format's golden archive) checks every
    file its export.json records without unpacking, instead of taking it for a zstd stream of a
    .bin (exit 1, "not a checkpoint"); inspect says in one line what reads it (exit 2)."""
    arc = tmp_path / "run.tar.zst"
    assert cli("export", str(trained / "run"), str(arc), "--archive").returncode == 0
    golden = __import__("pathlib").Path(__file__).parents[1] / "golden" / "v1" / "export" / "run.tar.zst"
    for path in (arc, golden):
        done = cli("validate", str(path))
        assert done.returncode == 0 and "OK (verified)" in done.stdout, done.stdout
    refused = cli("inspect", str(arc))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "ckptfmt import ARCHIVE DEST" in refused.stderr
    data = bytearray(arc.read_bytes())
    data[len(data) // 2] ^= 0x04
    (tmp_path / "flipped.tar.zst").write_bytes(bytes(data))
    done = cli("validate", str(tmp_path / "flipped.tar.zst"))
    assert done.returncode == 1 and "DAMAGED" in done.stdout and str(tmp_path / "flipped.tar.zst") in done.stdout
