import json

import numpy as np
import pytest

import ckptfmt
from ckptfmt import manifest as mf
from ckptfmt.tools.diff import diff, ordered_bits
from ckptfmt.tools.validate import validate_file
from conftest import arrays, make, seed_write


def codes(report):
    return [f.code for f in report.findings]


def test_valid_committed_file_is_verified(tmp_path):
    r = validate_file(make(tmp_path, 1))
    assert r.ok and r.status == "verified" and r.details["blake3"]


def test_bare_file_is_valid_but_unverified(tmp_path):
    seed_write(tmp_path / "step_000001.bin", 1, *arrays(10))
    r = validate_file(tmp_path / "step_000001.bin")
    assert r.ok and r.status == "unverified" and codes(r) == ["unverified"]


def test_fast_mode_skips_hashing(tmp_path):
    path = make(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert validate_file(path, deep=False).ok
    r = validate_file(path)
    assert not r.ok and codes(r) == ["fingerprint_mismatch"]


@pytest.mark.parametrize("region,value,code", [("weights", np.nan, "non_finite"), ("m", np.inf, "non_finite"),
                                               ("v", -1e-9, "negative_v")])
def test_value_checks(tmp_path, region, value, code):
    w, m, v = arrays(50)
    {"weights": w, "m": m, "v": v}[region][7] = value
    ckptfmt.save(tmp_path / "step_000001.bin", 1, w, m, v)
    r = validate_file(tmp_path / "step_000001.bin")
    assert not r.ok and code in codes(r)


def test_negative_zero_in_v_is_not_negative(tmp_path):
    w, m, v = arrays(5)
    v[0] = -0.0
    ckptfmt.save(tmp_path / "step_000001.bin", 1, w, m, v)
    assert validate_file(tmp_path / "step_000001.bin").ok


def test_structural_and_manifest_defects(tmp_path):
    path = make(tmp_path, 1)
    (tmp_path / "t.bin").write_bytes(path.read_bytes()[:50])
    assert codes(validate_file(tmp_path / "t.bin")) == ["truncated"]
    mpath = tmp_path / "step_000001.json"
    doc = json.loads(mpath.read_text())
    mpath.write_text(json.dumps({**doc, "n_params": 3}))
    assert codes(validate_file(path)) == ["manifest_seal"]        # edited after its seal
    mf.write(mpath, {**doc, "n_params": 3})                          # sealed by a writer that got n wrong
    assert codes(validate_file(path)) == ["manifest_mismatch"]


def layout_of(n):
    return [{"name": "emb", "shape": [n // 2], "offset": 0}, {"name": "head.weight", "shape": [2, n // 4], "offset": n // 2}]


def test_diff_identical_and_single_change_named(tmp_path):
    n = 1000
    w, m, v = arrays(n)
    a = tmp_path / "a" / "step_000001.bin"
    b = tmp_path / "b" / "step_000001.bin"
    a.parent.mkdir(), b.parent.mkdir()
    ckptfmt.save(a, 1, w, m, v, manifest={"layout": layout_of(n)})
    ckptfmt.save(b, 1, w, m, v, manifest={"layout": layout_of(n)})
    assert diff(a, b).identical
    m2 = m.copy()
    m2[777] = np.nextafter(m2[777], np.float32(1))
    ckptfmt.save(b, 1, w, m2, v, overwrite=True, manifest={"layout": layout_of(n)})
    d = diff(a, b)
    r = d.regions["m"]
    assert not d.identical and d.verdict == "different"
    assert r.n_diff == 1 and r.first_index == 777 and r.max_ulp == 1
    assert (r.first_param, r.first_param_index) == ("head.weight", 277)
    assert d.regions["weights"].n_diff == 0 and d.regions["v"].n_diff == 0
    assert diff(a, b, atol=1e-6).verdict == "equal within tolerance"


def test_diff_statistics(tmp_path):
    w = np.array([1.0, 2.0, -0.0, np.nan], dtype="<f4")
    w2 = np.array([1.0, 2.5, 0.0, np.nan], dtype="<f4")
    z = np.zeros(4, dtype="<f4")
    ckptfmt.save(tmp_path / "a.bin", 1, w, z, z)
    ckptfmt.save(tmp_path / "b.bin", 2, w2, z, z)
    d = diff(tmp_path / "a.bin", tmp_path / "b.bin").to_dict()
    r = d["regions"]["weights"]
    assert d["header"]["step"] == [1, 2] and not d["identical"]
    assert r["n_diff"] == 2 and r["max_abs"] == 0.5 and r["max_rel"] == pytest.approx(0.2)
    assert r["first_index"] == 1


def test_diff_of_different_sizes_is_not_comparable(tmp_path):
    make(tmp_path, 1, n=10)
    make(tmp_path, 2, n=11)
    d = diff(tmp_path / "step_000001.bin", tmp_path / "step_000002.bin")
    assert not d.comparable and d.verdict == "different"


def test_ulp_ordering_is_monotonic():
    x = np.array([-np.inf, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, np.inf], dtype="<f4")
    o = ordered_bits(x)
    assert list(o) == sorted(o) and o[3] == o[4]


def test_diff_finds_one_element_in_a_12_8m_file(tmp_path):
    n = 12_800_000
    rng = np.random.default_rng(0)
    w = rng.standard_normal(n, dtype=np.float32)
    layout = [{"name": "tok.weight", "shape": [256, 384], "offset": 0},
              {"name": "blocks", "shape": [n - 256 * 384], "offset": 256 * 384}]
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    ckptfmt.save(a, 10, w, w, w, manifest={"layout": layout})
    m = w.copy()
    m[9_876_543] += 1.0
    ckptfmt.save(b, 10, w, m, w, manifest={"layout": layout})
    d = diff(a, b)
    assert d.regions["m"].n_diff == 1 and d.regions["m"].first_index == 9_876_543
    assert d.regions["m"].first_param == "blocks" and d.regions["m"].first_param_index == 9_876_543 - 256 * 384
    assert d.regions["weights"].n_diff == 0


def test_progress_callbacks_cover_every_byte(tmp_path):
    a = make(tmp_path, 1, n=3_000_000, seed=1)
    b = tmp_path / "b" / "step_000001.bin"
    b.parent.mkdir()
    ckptfmt.save(b, 1, *arrays(3_000_000, seed=2))
    seen = []
    assert validate_file(a, progress=seen.append).ok
    assert sum(seen) == a.stat().st_size and len(seen) > 1
    seen.clear()
    diff(a, b, progress=seen.append)
    assert sum(seen) == 2 * (a.stat().st_size - 8)


def test_terminal_bar_stays_silent_off_a_terminal(capsys):
    from ckptfmt.cli.progress import terminal_bar
    with terminal_bar("x", 10**12) as bar:
        assert bar is None              # pytest's stderr is not a TTY
    with terminal_bar("x", 10**12, quiet=True) as bar:
        assert bar is None
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("rows", [[], [1, 2], [{}], "ROWS_WITH_BAD_DIGEST"])
def test_a_malformed_shard_list_makes_the_generation_invalid_not_a_traceback(tmp_path, rows):
    """A manifest's ``shards`` rows were used unchecked: an empty list, a row that is not an
    object or lacks a field, or a digest that is not hex escaped ``validate`` and ``ls`` as
    IndexError / TypeError / KeyError / ValueError tracebacks."""
    from ckptfmt import shards
    from conftest import cli
    run = tmp_path / "r"
    w, m, v = arrays(10)
    good = [shards.save_shard(run, 100, r, 2, *shards.partition(10, 2, r),
                              *(x[slice(*shards.partition(10, 2, r))] for x in (w, m, v))) for r in range(2)]
    path = shards.commit(run, 100, good)
    doc = json.loads(path.read_text())
    doc["shards"] = [{**good[0], "blake3": "z" * 64}, good[1]] if rows == "ROWS_WITH_BAD_DIGEST" else rows
    path.write_text(json.dumps(doc))
    assert "shard" in shards.check(path)
    for command in ("validate", "ls"):
        proc = cli(command, str(run))
        assert proc.returncode == (1 if command == "validate" else 0) and "Traceback" not in proc.stderr
    assert "no committed generation is valid" in cli("validate", str(run)).stdout
