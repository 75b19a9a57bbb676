"""The companion file of a generation (spec/FORMAT.md §4.6): committed with it,
listed by the manifest with its blake3, checked wherever the generation is."""
from __future__ import annotations

import numpy as np
import pytest

import ckptfmt
from ckptfmt import companion, tensorfile
from ckptfmt.errors import FingerprintMismatchError, ManifestMismatchError, TensorFileError
from ckptfmt.run import Run
from conftest import arrays, cli

EXTRA = {"bn.running_mean": np.arange(3, dtype="<f4"), "bn.num_batches_tracked": np.array(7, dtype="<i8"),
         "sampler.perm": np.array([2, 0, 1], dtype="<i8")}


def commit(run: Run, step: int, **kw):
    return run.commit(step, *arrays(12, step), manifest={"config": {"x": 1}}, extra_tensors=EXTRA, **kw)


def test_companion_is_committed_listed_and_readable(tmp_path):
    run = Run(tmp_path / "r", create=True)
    commit(run, 100)
    ck = ckptfmt.open(tmp_path / "r" / "step_000100.bin", verify=True)
    entry = ck.manifest["companion"]
    assert entry["file"] == "step_000100.extra.safetensors"
    assert entry["blake3"] == ckptfmt.fingerprint.of_file(tmp_path / "r" / entry["file"])
    extra = ck.companion()
    assert extra.tensor("bn.num_batches_tracked").tolist() == 7
    np.testing.assert_array_equal(extra.tensor("sampler.perm"), [2, 0, 1])
    from safetensors.numpy import load_file   # the real library opens it
    assert load_file(str(tmp_path / "r" / entry["file"]))["bn.running_mean"].tolist() == [0.0, 1.0, 2.0]
    assert [g.step for g in run.generations()] == [100] and not run.listing().foreign
    assert cli("validate", str(tmp_path / "r")).returncode == 0


def test_a_damaged_companion_makes_the_generation_invalid(tmp_path):
    run = Run(tmp_path / "r", create=True)
    commit(run, 100)
    commit(run, 200)
    path = tmp_path / "r" / "step_000200.extra.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(FingerprintMismatchError, match="companion"):
        ckptfmt.open(tmp_path / "r" / "step_000200.bin", verify=True)
    proc = cli("validate", str(tmp_path / "r" / "step_000200.bin"))
    assert proc.returncode == 1 and "companion" in proc.stdout + proc.stderr
    with pytest.warns(UserWarning, match="companion"):
        assert run.latest(deep=True).step == 100
    path.unlink()
    gen = run.generations()[-1]
    assert "missing" in gen.check()
    with pytest.raises(ManifestMismatchError, match="missing"):
        ckptfmt.open(tmp_path / "r" / "step_000200.bin")


def test_gc_removes_the_companion_and_overwrite_drops_a_stale_one(tmp_path):
    run = Run(tmp_path / "r", create=True)
    for step in (100, 200, 300):
        commit(run, step)
    assert run.gc(keep_last=1) == [100, 200]
    assert sorted(p.name for p in (tmp_path / "r").glob("step_*")) == [
        "step_000300.bin", "step_000300.extra.safetensors", "step_000300.json"]
    ckptfmt.save(tmp_path / "step_000001.bin", 1, *arrays(4), extra_tensors={"a": np.zeros(2, "<f4")})
    ckptfmt.save(tmp_path / "step_000001.bin", 1, *arrays(4), overwrite=True)
    assert not companion.path_for(tmp_path / "step_000001.bin").exists()
    assert ckptfmt.validate(tmp_path / "step_000001.bin").ok


def test_diff_and_inspect_see_the_companion(tmp_path):
    run = Run(tmp_path / "r", create=True)
    commit(run, 100)
    other = Run(tmp_path / "o", create=True)
    other.commit(100, *arrays(12, 100), manifest={"config": {"x": 1}},
                 extra_tensors={**EXTRA, "bn.running_mean": np.array([0, 1, 2.5], dtype="<f4")})
    a, b = tmp_path / "r" / "step_000100.bin", tmp_path / "o" / "step_000100.bin"
    proc = cli("diff", str(a), str(b))
    assert proc.returncode == 1 and "companion differs: bn.running_mean" in proc.stdout
    assert cli("diff", str(a), str(a)).returncode == 0
    path = tmp_path / "r" / "step_000100.extra.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    out = cli("inspect", str(a), "--json")
    import json
    assert json.loads(out.stdout)["fingerprint"] == "mismatch"


def test_big_endian_arrays_are_stored_as_their_values(tmp_path):
    entry = companion.write(tmp_path / "step_000001.bin", 1, {"be": np.arange(3, dtype=">f4")})
    assert companion.read(tmp_path / "step_000001.bin", entry).tensor("be").tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("header", [b"[" * 100_000 + b"]" * 100_000, b"{not json"])
def test_a_safetensors_header_that_is_not_json_is_one_line_naming_the_file(tmp_path, header):
    """A header nested too deeply for the parser was a RecursionError traceback out of the CLI;
    it is refused like any header that is not JSON."""
    path = tmp_path / "deep.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(TensorFileError, match="safetensors header is not JSON"):
        tensorfile.TensorFile(str(path))
    proc = cli("convert", str(path), str(tmp_path / "step_000001.bin"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"ckptfmt: {path}: safetensors header is not JSON")
    assert not (tmp_path / "step_000001.bin").exists()
