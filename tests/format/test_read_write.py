"""Reader and writer: interop with the independent seed reader/writer, zero-copy views,
durable-write behaviour, hypothesis round trips."""
import os
import struct
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt import fsio, manifest as mf
from ckptfmt.errors import SaveError
from conftest import arrays, make, seed_read, seed_write

f32_bits = st.lists(st.integers(0, 2**32 - 1), max_size=40)


def _bits(words):
    return np.array(words, dtype="<u4").view("<f4")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), f32_bits, f32_bits, f32_bits)
def test_toolkit_writes_what_the_seed_reader_reads_bit_for_bit(tmp_path_factory, step, a, b, c):
    n = min(len(a), len(b), len(c))
    w, m, v = _bits(a[:n]), _bits(b[:n]), _bits(c[:n])
    path = tmp_path_factory.mktemp("w") / "step.bin"
    ckptfmt.save(path, step, w, m, v)
    s, w2, m2, v2 = seed_read(path)
    assert s == step
    for x, y in ((w, w2), (m, m2), (v, v2)):
        assert x.tobytes() == y.tobytes()       # NaN payloads, -0.0, inf, subnormals included


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), f32_bits)
def test_seed_writer_files_are_read_by_the_toolkit_bit_for_bit(tmp_path_factory, step, a):
    w = _bits(a)
    m, v = _bits(a[::-1]), _bits([x ^ 0x80000000 for x in a])
    path = tmp_path_factory.mktemp("r") / "x.bin"
    seed_write(path, step, w, m, v)
    ck = ckptfmt.open(path)
    assert ck.step == step and ck.n_params == len(a) and ck.manifest is None
    assert ck.weights.tobytes() == w.tobytes() and ck.m.tobytes() == m.tobytes() and ck.v.tobytes() == v.tobytes()


def test_views_are_read_only_and_zero_copy(tmp_path):
    path = make(tmp_path, 5, n=64)
    ck = ckptfmt.open(path)
    buf = ck.buffer()
    for region in (ck.weights, ck.m, ck.v):
        assert region.dtype == np.dtype("<f4") and not region.flags.writeable
        assert np.shares_memory(region, np.frombuffer(buf, dtype=np.uint8))
    with pytest.raises(ValueError):
        ck.weights[0] = 1.0


def test_copy_on_write_views_never_touch_the_file(tmp_path):
    path = make(tmp_path, 5, n=64)
    before = path.read_bytes()
    ck = ckptfmt.open(path, copy_on_write=True)
    ck.weights[:] = 7.0
    assert path.read_bytes() == before


def test_manifest_and_access_by_name(tmp_path):
    layout = [{"name": "a", "shape": [2, 3], "offset": 0}, {"name": "b", "shape": [4], "offset": 6}]
    w, m, v = arrays(10)
    ckptfmt.save(tmp_path / "step_000001.bin", 1, w, m, v, manifest={"layout": layout})
    ck = ckptfmt.open(tmp_path / "step_000001.bin", verify=True)
    assert ck.manifest["blake3"] == ck.fingerprint() and ck.names() == ["a", "b"]
    assert ck.tensor("a").shape == (2, 3) and ck.tensor("b", "v").tolist() == v[6:].tolist()
    with pytest.raises(KeyError):
        ck.tensor("c")


def test_manifest_core_fields_describe_the_bytes_written(tmp_path):
    r = ckptfmt.save(tmp_path / "step_000009.bin", 9, *arrays(3), manifest={"step": 1, "blake3": "lie"})
    doc = mf.read(r.manifest_path)
    assert doc["step"] == 9 and doc["blake3"] == r.blake3 and doc["size"] == 44 and doc["file"] == "step_000009.bin"


def test_streamed_regions_and_any_buffer(tmp_path):
    w, m, v = arrays(1000)
    parts = lambda a: (a[i:i + 333] for i in range(0, 1000, 333))  # noqa: E731
    r = ckptfmt.save(tmp_path / "a.bin", 1, parts(w), parts(m), [bytearray(v.tobytes())], n_params=1000)
    ck = ckptfmt.open(tmp_path / "a.bin")
    assert ck.weights.tobytes() == w.tobytes() and ck.v.tobytes() == v.tobytes()
    assert r.blake3 == ck.fingerprint()


def test_bad_inputs_to_save(tmp_path):
    w, m, v = arrays(4)
    with pytest.raises(TypeError):
        ckptfmt.save(tmp_path / "a.bin", 1, w.astype(np.float64), m, v)
    with pytest.raises(ValueError):
        ckptfmt.save(tmp_path / "a.bin", 1, w, m[:3], v)
    with pytest.raises(ValueError):
        ckptfmt.save(tmp_path / "a.json", 1, w, m, v)
    with pytest.raises(ValueError):
        ckptfmt.save(tmp_path / "a.bin", -1, w, m, v)
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_is_never_overwritten_by_accident(tmp_path):
    path = make(tmp_path, 1)
    before = path.read_bytes()
    with pytest.raises(SaveError, match="exists already"):
        ckptfmt.save(path, 1, *arrays(100, seed=9))
    assert path.read_bytes() == before


def test_readers_views_survive_a_writer_replacing_the_path(tmp_path):
    path = make(tmp_path, 1, n=1000, seed=1)
    ck = ckptfmt.open(path)
    old = ck.weights.copy()
    ckptfmt.save(path, 1, *arrays(1000, seed=2), overwrite=True)
    assert ck.weights.tobytes() == old.tobytes()                 # old inode still mapped
    assert ckptfmt.open(path, verify=True).weights.tobytes() != old.tobytes()


@pytest.mark.parametrize("op", ["open", "write", "fsync", "close", "rename", "fsync_dir"])
def test_a_failed_operation_fails_the_save_and_leaves_no_temp(tmp_path, op, monkeypatch):
    good = make(tmp_path, 1)
    before = good.read_bytes()

    def hook(name, path):
        if name == op:
            raise OSError(5, "Input/output error")
    monkeypatch.setattr(fsio, "hook", hook)
    with pytest.raises(SaveError) as info:
        ckptfmt.save(tmp_path / "step_000002.bin", 2, *arrays(100))
    monkeypatch.setattr(fsio, "hook", None)
    assert isinstance(info.value.__cause__, OSError)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".ckptfmt-tmp")]
    assert good.read_bytes() == before
    assert not (tmp_path / "step_000002.json").exists()


def test_short_writes_are_completed(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(memoryview(data)[:7])))
    w, m, v = arrays(100)
    ckptfmt.save(tmp_path / "a.bin", 1, w, m, v)
    monkeypatch.undo()
    assert ckptfmt.open(tmp_path / "a.bin", verify=True).v.tobytes() == v.tobytes()


def test_open_is_constant_time_on_a_large_sparse_file(tmp_path):
    path = tmp_path / "step_000001.bin"
    with open(path, "wb") as f:
        f.write(struct.pack("<ii", 1, 12_300_288))
        f.truncate(8 + 12 * 12_300_288)
    ck = ckptfmt.open(path)
    assert ck.n_params == 12_300_288 and ck.weights.shape == (12_300_288,)


def test_no_warning_from_torch_on_copy_on_write_views(tmp_path):
    torch = pytest.importorskip("torch")
    ck = ckptfmt.open(make(tmp_path, 1), copy_on_write=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.from_numpy(ck.weights)


def test_core_imports_without_torch(tmp_path):
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None\n"
            "import ckptfmt, ckptfmt.cli, ckptfmt.tools.validate, ckptfmt.tools.diff, ckptfmt.tools.convert, "
            "ckptfmt.run, ckptfmt.tools.export, ckptfmt.tools.inspect, ckptfmt.tools.plot\n"
            "import numpy as np\n"
            f"r = ckptfmt.save({str(tmp_path / 'a.bin')!r}, 1, np.ones(3, '<f4'), np.ones(3, '<f4'), np.ones(3, '<f4'))\n"
            "assert ckptfmt.validate(r.path).ok\n"
            "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m])\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pages_are_released_only_behind_every_reader_of_a_pass(monkeypatch):
    from ckptfmt.reader import ReleaseBehind
    monkeypatch.setattr(ReleaseBehind, "BATCH", 1000)

    class Mapping:
        size = 12000
        released: list = []

        def release(self, offset, length):
            self.released.append((offset, length))

    ck = Mapping()
    behind = ReleaseBehind(ck)
    hashing, copy = behind.lane(), behind.lane()
    behind.advance(hashing, 4096)
    assert ck.released == []                         # the copy has not been there yet
    behind.advance(copy, 999)
    assert ck.released == []                         # less than a batch
    behind.advance(copy, 1000)
    behind.advance(copy, 8192)
    behind.advance(hashing, 10000)
    assert ck.released == [(0, 1000), (1000, 3096), (4096, 4096)]
    behind.advance(hashing, 12000)
    behind.advance(copy, 11500)
    assert ck.released[-1] == (8192, 3308)
    behind.advance(copy, 12000)                      # the end: the last partial batch goes
    assert ck.released[-1] == (11500, 500) and sum(n for _, n in ck.released) == 12000


def test_deep_validate_releasing_pages_still_scans_and_hashes_every_byte(tmp_path):
    w, m, v = arrays(100_000, seed=3)
    v[-1] = -1.0
    r = ckptfmt.save(tmp_path / "step_000001.bin", 1, w, m, v)
    report = ckptfmt.validate(r.path)
    assert [f.code for f in report.findings] == ["negative_v"] and report.details["blake3"] == r.blake3


def test_a_reader_far_ahead_waits_for_the_slowest_and_a_finished_one_frees_it(monkeypatch):
    import threading
    from ckptfmt.reader import ReleaseBehind
    monkeypatch.setattr(ReleaseBehind, "BATCH", 10)
    monkeypatch.setattr(ReleaseBehind, "WINDOW", 100)

    class Mapping:
        size = 1000

        def release(self, offset, length):
            pass

    behind = ReleaseBehind(Mapping())
    fast, slow = behind.lane(), behind.lane()
    behind.advance(fast, 100)                        # at the window's edge: goes on
    ahead = threading.Thread(target=behind.advance, args=(fast, 300))
    ahead.start()
    ahead.join(0.2)
    assert ahead.is_alive()                          # 300 bytes ahead of the slow reader: waits
    behind.advance(slow, 250)
    ahead.join(5)
    assert not ahead.is_alive()
    waiting = threading.Thread(target=behind.advance, args=(fast, 990))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive()
    behind.advance(slow, 1000)                       # the slow reader ends (or fails and says so)
    waiting.join(5)
    assert not waiting.is_alive()
    behind.advance(fast, 1000)
    assert behind.released == 1000


def test_open_with_verify_that_fails_leaves_no_map_behind(tmp_path):
    """``open(verify=True)`` on a file whose hash is not the manifest's raised with the file
    still mapped, for as long as anyone held the error (its traceback holds open's frame)."""
    from ckptfmt.errors import FingerprintMismatchError
    path = make(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)

    def mapped() -> bool:
        with open("/proc/self/maps") as maps:
            return str(path) in maps.read()
    with pytest.raises(FingerprintMismatchError) as info:
        ckptfmt.open(path, verify=True)
    assert info.value.path == str(path) and not mapped()
