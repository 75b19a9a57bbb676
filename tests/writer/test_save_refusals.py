"""The library refuses before it writes.

``ckptfmt.save`` checks every argument before the first byte reaches the disk; each refusal
below is tried in an empty directory, which is listed afterwards: nothing may be there, and
the retry with good arguments must then succeed (a refused save never leaves an orphan that
would make the retry fail with "exists already"). A save that fails after its ``.bin`` was
written (the companion or the manifest cannot be written) removes that ``.bin`` again.
"""
from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

import ckptfmt
from ckptfmt import errors as E
from ckptfmt import fsio
from conftest import arrays

N = 5
LAYOUT_3_OF_5 = [{"name": "a", "shape": [3], "offset": 0}]
LAYOUT_5 = [{"name": "a", "shape": [3], "offset": 0}, {"name": "b", "shape": [2], "offset": 3}]


def _gen(n):
    """A streamed region: only its caller knows the length."""
    def pieces():
        yield np.zeros(n, dtype="<f4")
    return pieces()


REFUSALS = [  # id, file name, keyword arguments of save, error class, words of the message
    ("step_bool", "x.bin", {"step": True}, E.SaveError, "step must be an integer, got True"),
    ("step_float", "x.bin", {"step": 7.0}, E.SaveError, "step must be an integer, got 7.0"),
    ("step_string", "x.bin", {"step": "7"}, E.SaveError, "step must be an integer"),
    ("step_negative", "x.bin", {"step": -1}, E.SaveError, "step must be in 0..2147483647, got -1"),
    ("step_too_large", "x.bin", {"step": 2**31}, E.SaveError, "got 2147483648"),
    ("step_numpy_negative", "x.bin", {"step": np.int64(-3)}, E.SaveError, "got -3"),
    ("name_other_step", "step_000008.bin", {"step": 7}, E.BadNameError,
     "name says step 8, the header would say 7: expected step_000007.bin"),
    ("name_not_canonical", "step_0000007.bin", {"step": 7}, E.BadNameError,
     "step_0000007.bin is not the canonical name of step 7 (six digits at least, spec §3.4): expected step_000007.bin"),
    ("layout_3_of_5", "x.bin", {"manifest": {"layout": LAYOUT_3_OF_5}}, E.ManifestError,
     "layout covers 3 parameters, n_params is 5"),
    ("layout_not_a_list", "x.bin", {"manifest": {"layout": {"a": 1}}}, E.ManifestError, "layout must be a list"),
    ("manifest_nan", "x.bin", {"manifest": {"loss": float("nan")}}, E.ManifestError, "not strict JSON"),
    ("manifest_infinity", "x.bin", {"manifest": {"config": {"lr": float("inf")}}}, E.ManifestError,
     "not strict JSON"),
    ("manifest_numpy_float", "x.bin", {"manifest": {"loss": np.float32(1.5)}}, E.ManifestError,
     "not strict JSON"),
    ("manifest_object", "x.bin", {"manifest": {"fn": print}}, E.ManifestError, "not strict JSON"),
    ("manifest_not_a_dict", "x.bin", {"manifest": [1, 2]}, E.ManifestError, "must be a dict"),
    ("path_is_a_manifest", "step_000001.json", {}, E.SaveError, "must not end in .json"),
    ("regions_disagree", "x.bin", {"m": np.zeros(4, "<f4")}, E.SaveError, "must have the same length"),
    ("n_params_bool", "x.bin", {"weights": _gen, "m": _gen, "v": _gen, "n_params": True}, E.SaveError,
     "n_params must be an integer"),
    ("n_params_disagrees", "x.bin", {"n_params": 4}, E.SaveError, f"n_params=4 but the regions hold {N} values each"),
    ("n_params_missing", "x.bin", {"weights": _gen, "m": _gen, "v": _gen}, E.SaveError,
     "the length of weights, m and v is unknown"),
]


def _save(directory, name, **kwargs):
    w, m, v = arrays(N)
    args = {"step": 1, "weights": w, "m": m, "v": v, **kwargs}
    for region in ("weights", "m", "v"):
        if callable(args[region]):
            args[region] = args[region](N)
    return ckptfmt.save(directory / name, args.pop("step"), args.pop("weights"), args.pop("m"),
                        args.pop("v"), **args)


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_each_refusal_writes_nothing_and_the_retry_succeeds(tmp_path, case):
    _, name, kwargs, cls, words = case
    with pytest.raises(cls) as info:
        _save(tmp_path, name, **kwargs)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert sorted(os.listdir(tmp_path)) == []            # no .bin, no temp file, no manifest
    good = "step_000007.bin" if name.startswith("step_") else "x.bin"
    result = _save(tmp_path, good, step=7)
    assert ckptfmt.validate(result.path).ok


def test_numpy_integers_are_taken_and_written_as_plain_ints(tmp_path):
    result = ckptfmt.save(tmp_path / "step_000007.bin", np.int64(7), *arrays(N),
                          manifest={"layout": LAYOUT_5}, n_params=np.int32(N))
    doc = json.loads((tmp_path / "step_000007.json").read_text())
    assert result.step == 7 and type(result.step) is int and doc["step"] == 7
    report = ckptfmt.validate(tmp_path)
    assert report.ok and report.status == "verified"
    with ckptfmt.open(result.path, verify=True) as ck:
        assert ck.step == 7 and ck.names() == ["a", "b"]


def test_a_companion_that_cannot_be_written_removes_the_bin(tmp_path):
    """The .bin is written first; a companion tensor safetensors cannot hold fails after it."""
    with pytest.raises(TypeError, match="no safetensors dtype"):
        ckptfmt.save(tmp_path / "step_000001.bin", 1, *arrays(N),
                     extra_tensors={"bad": np.array(["text"], dtype=object)})
    assert sorted(os.listdir(tmp_path)) == []
    ckptfmt.save(tmp_path / "step_000001.bin", 1, *arrays(N), extra_tensors={"ok": np.ones(2, "<f4")})
    assert ckptfmt.validate(tmp_path).ok


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_a_manifest_the_disk_refuses_removes_the_bin(tmp_path, monkeypatch, code):
    """The disk fails while the manifest (the commit point) is written: the save fails with
    SaveError, and the .bin it had written is gone, so the retry is not blocked."""
    def hook(op, path):
        if op == "fsync" and ".json." in os.path.basename(path):     # the manifest's temp file
            raise OSError(code, os.strerror(code))
    monkeypatch.setattr(fsio, "hook", hook)
    with pytest.raises(E.SaveError) as info:
        ckptfmt.save(tmp_path / "step_000001.bin", 1, *arrays(N))
    assert isinstance(info.value.__cause__, OSError) and info.value.could_not_run
    assert sorted(os.listdir(tmp_path)) == []
    monkeypatch.setattr(fsio, "hook", None)
    ckptfmt.save(tmp_path / "step_000001.bin", 1, *arrays(N))
    assert ckptfmt.validate(tmp_path).ok


def test_an_overwrite_refused_for_its_arguments_keeps_the_committed_generation(tmp_path):
    first = ckptfmt.save(tmp_path / "step_000001.bin", 1, *arrays(N))
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    with pytest.raises(E.ManifestError, match="not strict JSON"):
        ckptfmt.save(tmp_path / "step_000001.bin", 1, *arrays(N, seed=2), overwrite=True,
                     manifest={"loss": float("nan")})
    assert {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)} == before
    assert ckptfmt.open(first.path, verify=True).step == 1


def test_a_file_that_appears_while_the_save_writes_is_never_replaced(tmp_path, monkeypatch):
    """``save`` looks for the destination before it writes; a file created there while it
    wrote (another process, another save) was then replaced by the rename. The .bin is now
    published by a hard link, which fails where a file is."""
    path = tmp_path / "step_000001.bin"

    def someone_else(op, where):
        if op == "link" and where == str(path):
            path.write_bytes(b"theirs")
    monkeypatch.setattr(fsio, "hook", someone_else)
    with pytest.raises(E.SaveError, match=r"step_000001.bin: exists already; refusing to overwrite a checkpoint$"):
        ckptfmt.save(path, 1, *arrays(10))
    monkeypatch.setattr(fsio, "hook", None)
    assert path.read_bytes() == b"theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["step_000001.bin"]
    ckptfmt.save(tmp_path / "step_000002.bin", 2, *arrays(10))            # the usual save is one file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001.bin", "step_000002.bin", "step_000002.json"]


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EACCES, errno.EPERM, errno.EOPNOTSUPP])
def test_a_filesystem_without_hard_links_still_saves(tmp_path, monkeypatch, code):
    """FUSE mounts answer link() with ENOSYS or EACCES, others EPERM or EOPNOTSUPP: the save
    falls back to the rename (after one more look at the name)."""
    def no_links(op, where):
        if op == "link":
            raise OSError(code, os.strerror(code))
    monkeypatch.setattr(fsio, "hook", no_links)
    ckptfmt.save(tmp_path / "step_000001.bin", 1, *arrays(10))
    monkeypatch.setattr(fsio, "hook", None)
    assert ckptfmt.validate(tmp_path / "step_000001.bin").ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001.bin", "step_000001.json"]


def test_a_temp_name_that_cannot_be_removed_after_the_link_does_not_fail_the_save(tmp_path, monkeypatch):
    """Once linked, the .bin is published: a failed unlink of the temp name (EIO) failed the save
    and left the .bin, which then refused the retry ('exists already'). It is a leftover now."""
    def eio(op, where):
        if op == "unlink" and ".ckptfmt-tmp." in where:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(fsio, "hook", eio)
    ckptfmt.save(tmp_path / "step_000001.bin", 1, *arrays(10))
    monkeypatch.setattr(fsio, "hook", None)
    assert ckptfmt.validate(tmp_path / "step_000001.bin").ok
    assert len(list(tmp_path.glob(".ckptfmt-tmp.step_000001.bin.*"))) == 1       # swept by gc / the next writer
