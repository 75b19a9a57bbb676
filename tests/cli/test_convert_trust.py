"""Conversions trust nothing: the source is checked against its own digest
before anything is written, "verified" is printed only when source and round trip both hold,
and a target extension that disagrees with --to, or an option that does nothing for the
target, is refused (exit 2) before anything is read or written."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import ckptfmt
from ckptfmt.cli import main
from conftest import arrays, make, seed_write

LAYOUT = [{"name": "a.weight", "shape": [10, 5], "offset": 0}, {"name": "b.bias", "shape": [50], "offset": 50}]


def run(runner, *args):
    return runner.invoke(main, list(map(str, args)), catch_exceptions=False)


@pytest.fixture
def src(tmp_path):
    return make(tmp_path, 42, manifest={"layout": LAYOUT})


def _flip_one_byte(path, offset=20):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("ext", ["safetensors", "pt", "npz", "zst", "ckz", "bin"])
def test_a_bin_whose_manifest_digest_mismatches_exits_1_and_writes_nothing(runner, tmp_path, src, ext):
    _flip_one_byte(src)                          # same size: only the blake3 can tell
    out = tmp_path / "out" / f"step_000042.{ext}"
    out.parent.mkdir()
    result = run(runner, "convert", src, out)
    assert result.exit_code == 1, result.output
    assert "blake3 mismatch" in result.stderr and str(src) in result.stderr
    assert "verified" not in result.stdout
    assert list(out.parent.iterdir()) == []


def test_a_converted_file_whose_digest_mismatches_its_contents_exits_1(runner, tmp_path, src):
    st = tmp_path / "x.npz"
    assert run(runner, "convert", src, st).exit_code == 0
    with np.load(st) as z:
        arrays_ = {k: z[k] for k in z.files}
    arrays_["weights"] = arrays_["weights"].copy()
    arrays_["weights"][0] += 1                   # the embedded blake3 no longer matches
    np.savez(tmp_path / "bad.npz", **arrays_)
    (tmp_path / "back").mkdir()
    result = run(runner, "convert", tmp_path / "bad.npz", tmp_path / "back" / "step_000042.bin")
    assert result.exit_code == 1 and "blake3 mismatch: its metadata says" in result.stderr
    assert list((tmp_path / "back").iterdir()) == []


def test_verified_only_when_the_source_matched_its_manifest(runner, tmp_path, src):
    result = run(runner, "convert", src, tmp_path / "x.safetensors", "--json")
    doc = json.loads(result.stdout)
    assert (doc["verified"], doc["source_check"], doc["round_trip"]) == ("round-trip", "manifest", "bytes")
    assert "verified: round-trip" in run(runner, "convert", src, tmp_path / "y.zst").stdout


def test_a_bare_bin_converts_but_is_never_called_verified(runner, tmp_path):
    bare = tmp_path / "step_000007.bin"
    seed_write(bare, 7, *arrays(30))
    result = run(runner, "convert", bare, tmp_path / "x.safetensors")
    assert result.exit_code == 0, result.output
    assert "verified" not in result.stdout.replace("unverified", "")
    assert "round trip: bytes identical; source unverified: a bare .bin without a manifest" in result.stdout
    doc = json.loads(run(runner, "convert", bare, tmp_path / "y.zst", "--json").stdout)
    assert doc["verified"] == "unverified-source" and doc["round_trip"] == "bytes"


def test_no_verify_says_so(runner, tmp_path, src):
    result = run(runner, "convert", src, tmp_path / "x.npz", "--no-verify")
    assert result.exit_code == 0 and "not verified (--no-verify)" in result.stdout


@pytest.mark.parametrize("dst,to", [
    ("x.safetensors", "zst"), ("x.zst", "planes"), ("x.ckz", "zst"), ("x.bin", "safetensors"),
    ("x.npz", "pt"), ("x.pt", "npz"), ("x.zst", "bin"), ("x.txt", "bin"), ("x.bin", "dcp"),
    ("x.safetensors", "torch"), ("x.pt", "weights"),
])
def test_an_extension_that_disagrees_with_to_is_refused(runner, tmp_path, src, dst, to):
    result = run(runner, "convert", src, tmp_path / dst, "--to", to)
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and str(tmp_path / dst) in result.stderr
    assert "disagrees with --to" in result.stderr or "is a directory" in result.stderr
    assert not (tmp_path / dst).exists()


@pytest.mark.parametrize("dst,options,text", [
    ("x.bin", ["--weights-only"], "--weights-only does nothing for a bin target"),
    ("x.zst", ["--weights-only"], "--weights-only does nothing for a zst target"),
    ("x.ckz", ["--weights-only"], "--weights-only does nothing for a planes target"),
    ("x.pt", ["--to", "torch", "--weights-only"], "--weights-only does nothing for a torch target"),
    ("x.safetensors", ["--shards", "3"], "--shards does nothing for a safetensors target"),
    ("x.npz", ["--weights-only", "--dtype", "bfloat16"], "numpy has no bfloat16"),
    ("x.safetensors", ["--dtype", "float16"], "--dtype needs --weights-only"),
])
def test_options_that_do_nothing_for_the_target_are_refused(runner, tmp_path, src, dst, options, text):
    result = run(runner, "convert", src, tmp_path / dst, *options)
    assert result.exit_code == 2, result.output
    assert text in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / dst).exists()


def test_options_that_apply_still_work(runner, tmp_path, src):
    assert run(runner, "convert", src, tmp_path / "w.safetensors", "--weights-only", "--dtype", "bfloat16").exit_code == 0
    assert run(runner, "convert", src, tmp_path / "w.pth", "--to", "pt").exit_code == 0
    assert run(runner, "convert", src, tmp_path / "run", "--to", "shards", "--shards", "3").exit_code == 0
    assert ckptfmt.validate(tmp_path / "run").ok


def test_more_shards_than_parameters_is_refused_and_a_failed_split_leaves_no_shards(runner, tmp_path, src, monkeypatch):
    """--shards 200000 of a small checkpoint wrote 200,000 shard files for minutes; and a split
    stopped half-way left its shards behind, uncommitted."""
    from ckptfmt import shards
    n = ckptfmt.open(src).n_params
    result = run(runner, "convert", src, tmp_path / "run", "--to", "shards", "--shards", str(n + 1))
    assert result.exit_code == 2 and f"{n + 1} shards for {n} parameters" in result.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    written = []
    real = shards.save_shard

    def second_fails(*args, **kw):
        if written:
            raise KeyboardInterrupt
        written.append(real(*args, **kw))
        return written[-1]
    monkeypatch.setattr(shards, "save_shard", second_fails)
    with pytest.raises(KeyboardInterrupt):
        shards.split(src, tmp_path / "run2", 3)
    assert written and not (tmp_path / "run2").exists()


def test_a_sharded_generation_is_measured_by_its_shards_either_way(runner, tmp_path, src):
    """The ratio compares data with data: a sharded source named by its manifest counts its
    shards, as a sharded destination does (it compared a 1.6 MB .bin with a 35 kB manifest)."""
    there = json.loads(run(runner, "convert", src, tmp_path / "run", "--to", "shards", "--shards", "3",
                           "--json").stdout)
    shards = sum(f.stat().st_size for f in (tmp_path / "run").glob("*.shards/*.bin"))
    manifest = next((tmp_path / "run").glob("step_*.json"))
    back = json.loads(run(runner, "convert", manifest, tmp_path / "back.bin", "--json").stdout)
    assert there["dst_bytes"] == back["src_bytes"] == shards
    assert back["dst_bytes"] == os.path.getsize(src) == there["src_bytes"]
