"""One malformed input per error class, a truncation sweep, trailing bytes, a header sweep."""
import json
import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt import errors as E
from ckptfmt import seal
from ckptfmt.reader import from_bytes
from conftest import arrays, make, seed_write


def raw(step, n, body_floats=None):
    body = np.zeros(3 * n if body_floats is None else body_floats, dtype="<f4").tobytes()
    return struct.pack("<ii", step, n) + body


@pytest.mark.parametrize("data,cls,offset,text", [
    (b"", E.NotACheckpointError, 0, "not a ckptfmt checkpoint: too short for the 8-byte header: expected at "
                                    "least 8 bytes, got 0"),
    (b"\x01\x00\x00", E.NotACheckpointError, 3, "expected at least 8 bytes, got 3"),
    (raw(-1, 0), E.BadHeaderError, 0, "negative step -1 at offset 0"),
    (raw(1, -5, 0), E.BadHeaderError, 4, "negative n_params -5 at offset 4"),
    (raw(1, 10, 29), E.TruncatedError, 124, "truncated: expected 128 bytes, got 124"),
    (raw(1, 2, 7), E.TrailingDataError, 32, "trailing data at offset 32: expected 32 bytes, got 36"),
    (raw(1, 2**31 - 1, 0), E.TruncatedError, 8,
     "truncated, or not a ckptfmt checkpoint: header promises 25,769,803,772 bytes, file has 8"),
    (b"Hello, this is a README renamed to .bin", E.TruncatedError, 39,
     "truncated, or not a ckptfmt checkpoint: header promises 23,379,187,004 bytes, file has 39"),
])
def test_malformed_inputs_raise_their_class_with_message_and_offset(tmp_path, data, cls, offset, text):
    path = tmp_path / "x.bin"
    path.write_bytes(data)
    with pytest.raises(cls) as info:
        ckptfmt.open(path)
    assert info.value.offset == offset and text in str(info.value) and str(path) in str(info.value)
    assert isinstance(info.value, E.CheckpointError) and isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)


def test_name_disagreeing_with_header(tmp_path):
    seed_write(tmp_path / "step_000007.bin", 8, *arrays(2))   # ckptfmt.save refuses this name
    with pytest.raises(E.BadNameError, match="name says step 7, header says step 8"):
        ckptfmt.open(tmp_path / "step_000007.bin")
    with pytest.raises(E.BadNameError, match="name says step 7, the header would say 8"):
        ckptfmt.save(tmp_path / "x" / "step_000007.bin", 8, *arrays(2))


def test_directory_and_fifo_are_not_checkpoints(tmp_path):
    with pytest.raises(E.NotACheckpointError, match="a directory"):
        ckptfmt.open(tmp_path)
    fifo = tmp_path / "step_000001.bin"
    os.mkfifo(fifo)
    with pytest.raises(E.NotACheckpointError, match="not a regular file"):
        ckptfmt.open(fifo)                                 # never hangs


def test_a_socket_named_like_a_checkpoint_is_not_a_regular_file(tmp_path):
    import socket
    path = tmp_path / "step_000001.bin"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))                               # open(2) of it is ENXIO, "No such device"
        with pytest.raises(E.NotACheckpointError, match=r"step_000001.bin: not a regular file \(a socket\), "
                                                        r"expected a step_NNNNNN.bin file$"):
            ckptfmt.open(path)


def test_missing_file_stays_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        ckptfmt.open(tmp_path / "nope.bin")


def sealed(doc: dict) -> str:
    """A manifest as a writer that seals what it writes would leave it: what fails is the schema."""
    return json.dumps(seal.apply(doc))


@pytest.mark.parametrize("mutate,cls,text", [
    (lambda d: "{not json", E.ManifestError, "not valid JSON"),
    (lambda d: json.dumps([1]), E.ManifestError, "expected a JSON object"),
    (lambda d: sealed({k: v for k, v in d.items() if k != "blake3"}), E.ManifestError, "missing field 'blake3'"),
    (lambda d: sealed({**d, "format": "other"}), E.ManifestError, "format: expected 'ckptfmt'"),
    (lambda d: sealed({**d, "format_version": 99}), E.UnsupportedVersionError, "newer than this ckptfmt"),
    (lambda d: sealed({**d, "file": "../x.bin"}), E.ManifestError, "must be a bare name"),
    (lambda d: sealed({**d, "blake3": "zz"}), E.ManifestError, "not a 64-digit hex digest"),
    (lambda d: sealed({**d, "step": 4}), E.ManifestMismatchError, "step: manifest says 4"),
    (lambda d: sealed({**d, "size": 1}), E.ManifestMismatchError, "size: manifest says 1"),
    (lambda d: sealed({**d, "layout": [{"name": "a", "shape": [3], "offset": 1}]}), E.ManifestError,
     "expected offset 0"),
    (lambda d: sealed({**d, "layout": [{"name": "a", "shape": [3], "offset": 0}]}), E.ManifestError,
     "layout covers 3 parameters, n_params is 100"),
    (lambda d: json.dumps(d).replace('"step": 3', '"step": NaN'), E.ManifestError, "not valid JSON"),
    (lambda d: json.dumps({**d, "step": 4}), E.ManifestSealError, "field 'step' does not match the manifest's seal"),
])
def test_manifest_defects(tmp_path, mutate, cls, text):
    path = make(tmp_path, 3)
    mpath = tmp_path / "step_000003.json"
    mpath.write_text(mutate(json.loads(mpath.read_text())))
    with pytest.raises(cls, match=text):
        ckptfmt.open(path)


def test_fingerprint_mismatch_on_verified_open(tmp_path):
    path = make(tmp_path, 3)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(E.FingerprintMismatchError, match="blake3 mismatch"):
        ckptfmt.open(path, verify=True)


def test_every_truncation_of_a_small_file_is_rejected(tmp_path):
    data = make(tmp_path, 3, n=20).read_bytes()
    for cut in range(len(data)):
        with pytest.raises(E.CheckpointError):
            from_bytes(data[:cut])


def test_trailing_bytes_are_rejected():
    data = raw(1, 5)
    for extra in list(range(1, 65)) + [511, 512, 4095, 4096]:
        with pytest.raises(E.TrailingDataError):
            from_bytes(data + b"\0" * extra)


@pytest.mark.parametrize("step", [-2**31, -1, 0, 1, 2**31 - 1])
@pytest.mark.parametrize("n", [-2**31, -1, 0, 1, 2**31 - 1])
def test_header_sweep_only_typed_errors(step, n):
    data = struct.pack("<ii", step, n) + b"\0" * 12
    if step >= 0 and n == 1:
        assert from_bytes(data).n_params == 1
    else:
        with pytest.raises(E.CheckpointError):
            from_bytes(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_checkpoint_errors(data):
    try:
        ck = from_bytes(data)
    except E.CheckpointError:
        return
    assert len(data) == 8 + 12 * ck.n_params


def test_verifying_a_bare_file_names_the_missing_manifest(tmp_path):
    from conftest import seed_write
    seed_write(tmp_path / "step_000001.bin", 1, *arrays(3))
    with pytest.raises(E.ManifestError, match="no manifest beside the file"):
        ckptfmt.open(tmp_path / "step_000001.bin", verify=True)
