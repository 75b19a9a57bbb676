"""A generation of either shape (one .bin, or shards) is one thing: its parts with what the
manifest records of them, open, check, copy and remove; and every command that copies a
generation (export, an archive and its import, fork, b3sums, split and join) carries every part,
the companion included, byte for byte."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from ckptfmt import fingerprint, generation, shards
from ckptfmt import manifest as mf
from ckptfmt.errors import CheckpointError, FingerprintMismatchError, ManifestError
from conftest import cli, make

BUFFERS = {"bn.running_mean": np.arange(3, dtype="<f4")}


def _bin_run(root: Path, bare: bool = False) -> Path:
    run = root / "single"
    run.mkdir()
    if bare:
        make(run, 4, n=30, write_manifest=False)
    else:
        make(run, 4, n=30, extra_tensors=BUFFERS)
    return run


def _sharded_run(root: Path, world: int = 3) -> Path:
    (root / "src").mkdir()
    shards.split(make(root / "src", 4, n=30, extra_tensors=BUFFERS), root / "sharded", world)
    return root / "sharded"


def _only(run: Path) -> generation.Generation:
    gens = generation.list_dir(run).generations
    assert len(gens) == 1
    return gens[0]


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): fingerprint.of_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name.startswith("step_") or p.parent.name.endswith(".shards")}


@pytest.mark.parametrize("shape", ["single", "sharded", "bare"])
def test_every_part_is_listed_with_the_size_and_blake3_its_manifest_records(tmp_path, shape):
    run = _sharded_run(tmp_path) if shape == "sharded" else _bin_run(tmp_path, bare=shape == "bare")
    gen = _only(run)
    parts = gen.parts()
    names = [p.name for p in parts]
    if shape == "sharded":
        assert names == [f"step_000004.shards/0000{r}-of-00003.bin" for r in range(3)] + [
            "step_000004.extra.safetensors", "step_000004.json"]
    elif shape == "single":
        assert names == ["step_000004.bin", "step_000004.extra.safetensors", "step_000004.json"]
    else:
        assert names == ["step_000004.bin"] and parts[0].blake3 is None
    on_disk = {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file() and not p.name.startswith(".")}
    assert set(names) == on_disk                # nothing of the generation is left out
    for part in parts:
        assert part.path == run / part.name
        if part.blake3 is not None:
            assert (part.size, part.blake3) == (part.path.stat().st_size, fingerprint.of_file(part.path))
    assert gen.check(deep=True) == ("not committed: no manifest" if shape == "bare" else None)
    assert gen.size == sum(p.path.stat().st_size for p in parts if p.role != "manifest")


def test_both_shapes_open_to_the_same_arrays(tmp_path):
    single, sharded = _only(_bin_run(tmp_path)), _only(_sharded_run(tmp_path))
    assert single.path.name == "step_000004.bin" and sharded.path.name == "step_000004.json"
    with single.open(verify=True) as a, sharded.open(verify=True) as b:
        assert (a.step, a.n_params) == (b.step, b.n_params) == (4, 30)
        for region in ("weights", "m", "v"):
            assert np.array_equal(getattr(a, region), getattr(b, region))


def test_a_copy_refuses_a_damaged_shard_naming_the_source_and_leaves_no_copy_of_it(tmp_path):
    gen = _only(_sharded_run(tmp_path))
    shard = gen.shards / "00001-of-00003.bin"
    data = bytearray(shard.read_bytes())
    data[20] ^= 0x10
    shard.write_bytes(bytes(data))
    dest = tmp_path / "copy"
    dest.mkdir()
    with pytest.raises(FingerprintMismatchError) as exc:
        gen.copy_to(dest)
    assert str(shard) in str(exc.value) and "not copied" in str(exc.value)
    assert not (dest / "step_000004.shards" / "00001-of-00003.bin").exists()
    assert not (dest / "step_000004.json").exists()         # nothing committed at the copy
    assert "shard 00001-of-00003.bin" in gen.check(deep=True)


def test_a_manifest_cannot_name_a_part_outside_its_generation(tmp_path):
    gen = _only(_sharded_run(tmp_path))
    doc = mf.read(gen.manifest)
    doc["shards"][0]["file"] = "../../etc/passwd"
    with pytest.raises(ManifestError, match="expected '00000-of-00003.bin'"):
        generation.recorded_parts(doc, 4)
    doc = mf.read(_only(_bin_run(tmp_path)).manifest)
    doc["companion"]["file"] = "../elsewhere.safetensors"
    with pytest.raises(ManifestError, match="companion entry does not name step_000004.extra.safetensors"):
        generation.recorded_parts(doc, 4)


@pytest.mark.parametrize("shape", ["single", "sharded"])
def test_remove_uncommits_first_and_leaves_nothing_of_the_generation(tmp_path, shape):
    run = _sharded_run(tmp_path) if shape == "sharded" else _bin_run(tmp_path)
    (run / "notes.txt").write_text("the user's\n")
    _only(run).remove()
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    with pytest.raises(CheckpointError):
        generation.Generation(4).parts()


def test_a_shard_another_remover_took_first_does_not_stop_the_removal(tmp_path, monkeypatch):
    """Two removers of one generation (retention and gc): the shard the other took between the
    listing and the unlink is no error, and every other part and the shard directory still go."""
    from ckptfmt import fsio
    run = _sharded_run(tmp_path)
    gen = _only(run)
    taken = []

    def other_remover_first(op, path):
        if op == "unlink" and "00000-of-00003" in path and not taken:
            taken.append(path)
            Path(path).unlink()
    monkeypatch.setattr(fsio, "hook", other_remover_first)
    gen.remove()
    assert taken and sorted(p.name for p in run.iterdir()) == []


def test_a_sharded_run_exports_imports_forks_and_lists_every_part_byte_for_byte(tmp_path):
    run = _sharded_run(tmp_path)
    (run / ".loss.json").write_text('{"step": 4, "loss": 1.5}\n')
    source = _digests(run)
    assert len(source) == 5                     # three shards, the companion, the manifest
    r = cli("export", str(run), str(tmp_path / "exported"))
    assert r.returncode == 0, r.stderr
    assert {k: v for k, v in _digests(tmp_path / "exported").items() if k in source} == source
    check = subprocess.run(["b3sum", "--check", "B3SUMS"], cwd=tmp_path / "exported", capture_output=True, text=True)
    # the five parts, the history, export.json and EXPORT.md
    assert check.returncode == 0 and check.stdout.count(": OK") == 5 + 3, check.stdout + check.stderr
    r = cli("export", str(run), str(tmp_path / "e.tar.zst"), "--archive")
    assert r.returncode == 0, r.stderr
    r = cli("import", str(tmp_path / "e.tar.zst"), str(tmp_path / "imported"))
    assert r.returncode == 0, r.stderr
    assert {k: v for k, v in _digests(tmp_path / "imported").items() if k in source} == source
    r = cli("fork", str(run), str(tmp_path / "child"), "--step", "4")
    assert r.returncode == 0, r.stderr
    child = _digests(tmp_path / "child")
    assert {k: child[k] for k in source if k != "step_000004.json"} == \
        {k: v for k, v in source.items() if k != "step_000004.json"}
    assert mf.read(tmp_path / "child" / "step_000004.json")["provenance"]["parent_step"] == 4
    for where in ("imported", "child"):
        r = cli("validate", str(tmp_path / where))
        assert r.returncode == 0 and "OK (verified)" in r.stdout, r.stdout + r.stderr


def test_split_and_join_carry_the_companion_byte_for_byte(tmp_path):
    (tmp_path / "src").mkdir()
    src = make(tmp_path / "src", 4, n=30, extra_tensors=BUFFERS)
    extra = src.with_name("step_000004.extra.safetensors")
    r = cli("convert", str(src), str(tmp_path / "run"), "--to", "shards")
    assert r.returncode == 0, r.stderr
    assert fingerprint.of_file(tmp_path / "run" / extra.name) == fingerprint.of_file(extra)
    r = cli("convert", str(tmp_path / "run" / "step_000004.json"), str(tmp_path / "joined.bin"))
    assert r.returncode == 0, r.stderr
    assert fingerprint.of_file(tmp_path / "joined.extra.safetensors") == fingerprint.of_file(extra)
    assert fingerprint.of_file(tmp_path / "joined.bin") == fingerprint.of_file(src)
    r = cli("validate", str(tmp_path / "joined.bin"))
    assert r.returncode == 0 and "OK (verified)" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("fault", ["missing", "truncated"])
def test_a_missing_or_truncated_shard_is_named_by_its_own_path(tmp_path, fault):
    run = _sharded_run(tmp_path, world=2)
    shard = run / "step_000004.shards" / "00001-of-00002.bin"
    if fault == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    assert _only(run).check().startswith(f"{shard}: ")
    out = cli("validate", str(run))
    assert out.returncode == 1 and f"{run / 'step_000004.json'}: {shard}: " in out.stdout, out.stdout


def test_inspect_gives_a_sharded_generation_its_size_not_its_manifests(tmp_path):
    run = _sharded_run(tmp_path)
    gen = _only(run)
    doc = __import__("json").loads(cli("inspect", str(gen.path), "--json").stdout)
    assert doc["size"] == gen.size == sum(p.stat().st_size for p in gen.present()) != gen.path.stat().st_size
