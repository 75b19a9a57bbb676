"""The registry of kinds (ckptfmt.kinds, spec/FORMAT.md §8.6): content decides what a file is;
another format's magic bytes win; a .bin or step_N name (or a plausible seed header) claims a
seed .bin, so a torn generation stays a defect; nothing else is "unknown kind"."""
from __future__ import annotations

import io
import json
import os
import socket
import struct
import zipfile

import numpy as np
import pytest

import ckptfmt
from ckptfmt import format as fmt
from ckptfmt import kinds, probe
from ckptfmt.errors import UnsupportedKindError
from ckptfmt.tools.convert import detect
from conftest import cli, make, without_torch


def write(path, data: bytes):
    path.write_bytes(data)
    return path


def zip_of(*names: str) -> bytes:
    """A zip holding ``names``, the same bytes at every call (a fixed date: each xdist worker
    collects the parameters, and their ids must agree)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for n in names:
            z.writestr(zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0)), b"x")
    return buf.getvalue()


def safetensors_bytes() -> bytes:
    head = json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    return struct.pack("<Q", len(head)) + head + bytes(4)


@pytest.mark.parametrize("name, data, kind", [
    ("x.bin", kinds.PLANES_MAGIC + bytes(20), "planes"),
    ("x.bin", struct.pack("<I", kinds.ZSTD_SKIPPABLE) + bytes(20), "zst"),
    ("anything", struct.pack("<I", kinds.ZSTD_FRAME) + bytes(20), "zst"),
    ("pytorch_model.bin", safetensors_bytes(), "safetensors"),
    ("pytorch_model.bin", zip_of("archive/data.pkl", "archive/data/0"), "torch"),
    ("model.ckpt", kinds.TORCH_LEGACY_MAGIC + bytes(20), "torch-legacy"),
    ("weights.bin", zip_of("a.npy", "b.npy"), "npz"),
    ("step_000001.bin", b"not a checkpoint at all", "bin"),       # the name claims: a defect, not unknown
    ("step_000001", b"torn", "bin"),
    ("x.pt", b"torn", "torch"),
    ("noname", fmt.pack_header(5, 1) + bytes(12), "bin"),         # the size law holds
])
def test_content_decides_and_names_claim(tmp_path, name, data, kind):
    assert kinds.sniff(write(tmp_path / name, data)).name == kind


def test_json_documents_and_directories(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    make(run, 1, n=4)
    assert kinds.sniff(run).name == "run"
    assert kinds.sniff(run / "step_000001.json").name == "manifest"
    write(tmp_path / "model.safetensors.index.json", json.dumps({"weight_map": {"a": "x.safetensors"}}).encode())
    assert kinds.sniff(tmp_path / "model.safetensors.index.json").name == "safetensors-index"
    (tmp_path / "dcp").mkdir()
    write(tmp_path / "dcp" / ".metadata", b"x")
    assert kinds.sniff(tmp_path / "dcp").name == "dcp"
    (tmp_path / "step_000002.shards").mkdir()
    assert kinds.sniff(tmp_path / "step_000002.shards").name == "shards"


def test_unknown_kind_is_one_line_and_could_not_run(tmp_path):
    path = write(tmp_path / "notes.txt", b"some text the user had\n")
    with pytest.raises(UnsupportedKindError, match="unknown kind") as info:
        kinds.sniff(path)
    assert info.value.could_not_run and str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(FileNotFoundError):
        kinds.sniff(tmp_path / "missing.bin")


@pytest.mark.parametrize("name", ["x.pt", "step_000001.bin", "model.safetensors"])
@pytest.mark.parametrize("special", ["fifo", "socket"])
def test_a_pipe_or_socket_of_any_name_could_not_run_and_never_blocks(tmp_path, name, special):
    path = tmp_path / name
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path)) if special == "socket" else os.mkfifo(path)   # nothing ever writes to it
        what = "a FIFO" if special == "fifo" else "a socket"
        for args in (["inspect", path], ["validate", path], ["diff", path, path], ["convert", path, tmp_path / "o.bin"]):
            out = cli(*args)
            assert (out.returncode, out.stderr) == (2, f"ckptfmt: {path}: not a regular file ({what}): ckptfmt "
                                                       "reads only files and directories, never a pipe, socket or "
                                                       "device (which could block for ever)\n"), args
        assert not (tmp_path / "o.bin").exists()


def test_a_device_could_not_run():
    out = cli("validate", "/dev/zero")
    assert out.returncode == 2 and "/dev/zero: not a regular file (a device)" in out.stderr


def test_reads_a_few_bytes(tmp_path):
    path = make(tmp_path, 1, n=100_000)
    assert len(kinds.Probe(path).head) == probe.HEAD < 100


def test_every_entry_says_what_each_command_does():
    names = [k.name for k in kinds.KINDS]
    assert len(names) == len(set(names)) and kinds.KINDS[-1].name == "bin"     # the seed's claim comes last
    for k in kinds.KINDS:
        assert k.label and set(k.does) <= set(kinds.COMMANDS)
        assert kinds.get(k.name) is k
    with pytest.raises(UnsupportedKindError, match="diff cannot read a run directory"):
        kinds.require(kinds.get("run"), "diff", "runs/a")


def test_convert_detects_sources_by_content_and_destinations_by_name(tmp_path):
    assert detect(write(tmp_path / "pytorch_model.bin", zip_of("archive/data.pkl"))) == "pt"
    assert detect(write(tmp_path / "a.ckpt", kinds.TORCH_LEGACY_MAGIC)) == "pt"
    assert detect(tmp_path / "new.safetensors") == "safetensors"             # not there yet: its name
    assert detect(write(tmp_path / "m.safetensors.index.json", b'{"weight_map": {}}')) == "safetensors-index"
    with pytest.raises(UnsupportedKindError, match="convert cannot read a generation manifest"):
        detect(write(tmp_path / "step_000001.json", b'{"format": "ckptfmt"}'))


def test_ckptfmt_open_still_reads_a_seed_bin(tmp_path):
    path = make(tmp_path, 2, n=8)
    assert kinds.sniff(path).name == "bin" and ckptfmt.open(path).step == 2


def test_a_torch_file_without_torch_names_the_extra(tmp_path):
    path = write(tmp_path / "ck.pt", zip_of("archive/data.pkl"))
    for command in ("validate", "inspect"):
        result = without_torch(command, path)
        assert result.returncode == 2, result.stderr
        assert "ckptfmt[torch]" in result.stderr and result.stderr.count("\n") == 1
    result = without_torch("validate", make(tmp_path, 1, n=4))
    assert result.returncode == 0, result.stderr


def test_foreign_npz_arrays_inspect_without_torch(tmp_path):
    np.savez(tmp_path / "a.npz", w=np.ones(3, "<f4"), b=np.zeros(2, "<f4"))
    result = without_torch("inspect", tmp_path / "a.npz")
    assert result.returncode == 0 and "kind npz" in result.stdout and "n_params 5" in result.stdout, result.stderr


def test_ls_names_a_skipped_file_by_its_content(tmp_path, runner):
    from ckptfmt.cli import main
    from ckptfmt.tools.convert import convert
    src = make(tmp_path, 1)
    convert(str(src), str(tmp_path / "step_000001.safetensors"))
    write(tmp_path / "step_1.bin", src.read_bytes())
    result = runner.invoke(main, ["ls", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["foreign"] == [
        f"{tmp_path / 'step_000001.safetensors'}: a safetensors file, not a generation "
        "(convert it into a step_N.bin to make it one)",
        f"{tmp_path / 'step_1.bin'}: look-alike name, not a canonical step_NNNNNN"]


def test_a_checkpoint_directory_removed_while_it_is_looked_at_is_none_never_an_error(tmp_path, monkeypatch):
    """ModelCheckpoint's top-k removes a checkpoint directory while a mirror pass or a listing
    looks at it: the manifest listed a moment ago is gone when it is read. Not a Lightning
    checkpoint now, never a FileNotFoundError out of the pass (a mirror pass failed on it)."""
    (tmp_path / "step_000010.json").write_text("{}")
    real = kinds.Probe

    def removed_first(path):
        (tmp_path / "step_000010.json").unlink(missing_ok=True)
        return real(path)
    monkeypatch.setattr(kinds, "Probe", removed_first)
    assert kinds.generation_in(tmp_path) is None
