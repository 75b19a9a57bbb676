import numpy as np
import pytest

import ckptfmt
from ckptfmt import fingerprint
from ckptfmt.tools.convert import convert, load
from ckptfmt.tools.convert.planes import planes, unplanes
from ckptfmt.errors import ConvertError, DestinationExistsError
from conftest import arrays

LAYOUT = [{"name": "a.weight", "shape": [10, 5], "offset": 0}, {"name": "b.bias", "shape": [50], "offset": 50}]


@pytest.fixture
def src(tmp_path):
    w, m, v = arrays(100)
    w[3] = np.float32(np.nan)
    w[4] = -0.0
    path = tmp_path / "step_000042.bin"
    ckptfmt.save(path, 42, w, m, v, manifest={"layout": LAYOUT})
    return path


@pytest.mark.parametrize("ext", ["safetensors", "pt", "npz", "zst"])
def test_round_trip_is_byte_identical(tmp_path, src, ext):
    mid = tmp_path / f"x.{ext}"
    rep = convert(str(src), str(mid))
    assert rep.verified == "round-trip" and rep.blake3 == fingerprint.of_file(src)
    back = tmp_path / "back" / "step_000042.bin"
    back.parent.mkdir()
    convert(str(mid), str(back))
    assert back.read_bytes() == src.read_bytes()
    assert ckptfmt.open(back, verify=True).layout == LAYOUT


def test_files_load_in_the_real_libraries(tmp_path, src):
    torch = pytest.importorskip("torch")
    safetensors_np = pytest.importorskip("safetensors.numpy")
    ck = ckptfmt.open(src)
    convert(str(src), str(tmp_path / "x.safetensors"))
    st = safetensors_np.load_file(str(tmp_path / "x.safetensors"))
    assert st["m/a.weight"].shape == (10, 5) and st["m/a.weight"].ravel().tobytes() == ck.m[:50].tobytes()
    convert(str(src), str(tmp_path / "x.pt"))
    state = torch.load(tmp_path / "x.pt", weights_only=True)
    assert state["v"].numpy().tobytes() == ck.v.tobytes() and state["step"] == "42"
    convert(str(src), str(tmp_path / "x.npz"))
    with np.load(tmp_path / "x.npz", allow_pickle=False) as z:
        assert z["weights"].tobytes() == ck.weights.tobytes()


@pytest.mark.parametrize("dtype,code", [("float16", "torch.float16"), ("bfloat16", "torch.bfloat16"), (None, "torch.float32")])
def test_weights_only_export(tmp_path, src, dtype, code):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    out = tmp_path / "w.safetensors"
    rep = convert(str(src), str(out), weights_only=True, dtype=dtype)
    assert rep.verified == "values"
    t = load_file(str(out))
    assert set(t) == {"weights/a.weight", "weights/b.bias"} and str(t["weights/a.weight"].dtype) == code
    ref = torch.from_numpy(ckptfmt.open(src).weights[:50].copy()).view(10, 5)
    got, want = t["weights/a.weight"], ref.to(t["weights/a.weight"].dtype)
    bits = torch.int32 if dtype is None else torch.int16
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)                 # NaN stays NaN (payload may differ)
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))   # everything else bit-exact, -0.0 included


def test_bfloat16_rounds_to_nearest_even():
    from ckptfmt.tools.convert import cast
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal(10_000).astype("<f4")
    x[:3] = [np.nan, -0.0, np.float32(3.0e38)]
    ours = cast(x, "bfloat16")[1]
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view("<u2")
    assert np.array_equal(ours[1:], theirs[1:])
    assert ours[0] & 0x7F80 == 0x7F80 and ours[0] & 0x7F   # still a NaN


def test_byte_planes_invert():
    x = np.random.default_rng(0).standard_normal(1001).astype("<f4")
    assert unplanes(planes(x)).tobytes() == x.tobytes()


def test_refusals(tmp_path, src):
    (tmp_path / "exists.npz").write_bytes(b"x")
    with pytest.raises(DestinationExistsError):
        convert(str(src), str(tmp_path / "exists.npz"))
    with pytest.raises(ConvertError, match="unknown format"):
        convert(str(src), str(tmp_path / "x.txt"))
    convert(str(src), str(tmp_path / "w.safetensors"), weights_only=True)
    with pytest.raises(ConvertError, match="weights-only"):
        convert(str(tmp_path / "w.safetensors"), str(tmp_path / "step_000001.bin"))
    with pytest.raises(ConvertError, match="numpy has no bfloat16"):
        convert(str(src), str(tmp_path / "w.npz"), weights_only=True, dtype="bfloat16")


@pytest.mark.parametrize("ext,data,text", [
    ("safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{}", "impossible"),
    ("safetensors", b"\x02\x00\x00\x00\x00\x00\x00\x00{x", "not JSON"),
    ("zst", b"NOTMAGIC", "not a zstd file"),
    ("ckz", b"NOTMAGIC", "bad magic"),
    ("npz", b"PK\x03\x04garbage", "not a ckptfmt .npz"),
])
def test_damaged_inputs_are_convert_errors(tmp_path, ext, data, text):
    bad = tmp_path / f"bad.{ext}"
    bad.write_bytes(data)
    with pytest.raises(ConvertError, match=text):
        load(str(bad))


def test_truncated_zst_is_detected(tmp_path, src):
    convert(str(src), str(tmp_path / "x.zst"))
    data = (tmp_path / "x.zst").read_bytes()
    (tmp_path / "t.zst").write_bytes(data[:-20])
    with pytest.raises(ConvertError):
        load(str(tmp_path / "t.zst"))


@pytest.mark.parametrize("ext", ["safetensors", "zst", "npz"])
def test_convert_progress_counts_check_write_and_verify(tmp_path, src, ext):
    seen = []
    convert(str(src), str(tmp_path / f"p.{ext}"), progress=seen.append)
    assert sum(seen) == 3 * src.stat().st_size


@pytest.mark.parametrize("head", [
    (0x184D2A5C).to_bytes(4, "little"),            # the .zst's metadata frame
    b"CKPTZST\x01"])                               # the byte-plane form
def test_a_metadata_header_nested_too_deeply_is_one_error_naming_the_file(tmp_path, head):
    """A header nested too deeply for the JSON parser was a RecursionError traceback."""
    deep = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "deep.bin.zst"
    path.write_bytes(head + len(deep).to_bytes(4, "little") + deep)
    with pytest.raises(ConvertError, match=r"deep.bin.zst: (metadata frame|byte-plane header) is not JSON: "
                                           r"nested too deeply$"):
        load(str(path))
