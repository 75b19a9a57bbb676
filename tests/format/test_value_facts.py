"""Value facts recorded at save: deep validation of a committed generation is one hash,
and what the facts say is what a scan finds, in every region, in shards, with reused buffers."""
import json

import numpy as np
import pytest

import ckptfmt
from ckptfmt import manifest as mf
from ckptfmt import facts as valfacts
from ckptfmt import format as fmt
from ckptfmt import shards
from ckptfmt.tools.validate import validate_file, validate_run
from conftest import arrays, cli, make, seed_write


def codes(report):
    return [f.code for f in report.findings]


def with_values(n=1000, **changes):
    """weights, m, v with {region: {index: value}} written in."""
    regions = dict(zip(fmt.REGIONS, arrays(n)))
    for name, edits in changes.items():
        for i, value in edits.items():
            regions[name][i] = value
    return regions["weights"], regions["m"], regions["v"]


def test_facts_are_recorded_as_strict_json_counts(tmp_path):
    w, m, v = with_values(weights={3: np.nan, 4: np.inf}, v={0: -0.0, 9: -1e-9, 10: -np.inf})
    r = ckptfmt.save(tmp_path / "step_000001.bin", 1, w, m, v)
    text = (tmp_path / "step_000001.json").read_text()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the manifest"))
    assert doc["facts"] == r.facts == {
        "weights": {"finite": False, "non_finite": 2},
        "m": {"finite": True, "non_finite": 0},
        "v": {"finite": False, "non_finite": 1, "non_negative": False, "negative": 1}}
    assert valfacts.diverged(doc) == {"weights": 2, "v": 1}


def test_clean_regions_record_clean_facts_and_validate_by_one_hash(tmp_path):
    path = make(tmp_path, 1, n=5000)
    doc = json.loads(path.with_suffix(".json").read_text())
    assert all(doc["facts"][r]["finite"] for r in fmt.REGIONS) and doc["facts"]["v"]["non_negative"]
    report = validate_file(path)
    assert report.ok and report.status == "verified" and report.details["values"] == "recorded"
    scanned = validate_file(path, scan=True)
    assert scanned.ok and scanned.details["values"] == "scanned"


@pytest.mark.parametrize("region", fmt.REGIONS)
def test_a_flipped_bit_in_any_region_is_still_found_by_the_hash(tmp_path, region):
    path = make(tmp_path, 1, n=300)
    data = bytearray(path.read_bytes())
    data[fmt.region_offset(region, 300) + 4 * 123 + 3] ^= 0x7F     # the exponent: a huge or NaN value
    path.write_bytes(bytes(data))
    report = validate_file(path)
    assert not report.ok and "fingerprint_mismatch" in codes(report)
    assert report.details["values"] == "scanned"     # other bytes than the facts describe


@pytest.mark.parametrize("region,value,code", [("weights", np.nan, "non_finite"), ("m", np.inf, "non_finite"),
                                               ("v", np.nan, "non_finite"), ("v", -1e-9, "negative_v")])
def test_recorded_facts_and_the_scan_agree(tmp_path, region, value, code):
    path = tmp_path / "step_000001.bin"
    ckptfmt.save(path, 1, *with_values(**{region: {7: value, 8: value}}))
    recorded, scanned = validate_file(path), validate_file(path, scan=True)
    assert recorded.details["values"] == "recorded" and scanned.details["values"] == "scanned"
    assert codes(recorded) == codes(scanned) == [code]
    assert recorded.details.get("non_finite") == scanned.details.get("non_finite")
    if code == "non_finite":
        assert recorded.status == "diverged" and recorded.details["non_finite"] == {region: 2}
        assert f"region {region} holds 2 non-finite values" in recorded.findings[0].message


def test_a_manifest_without_facts_and_a_bare_file_are_scanned(tmp_path):
    w, m, v = with_values(m={5: np.nan})
    path = tmp_path / "step_000001.bin"
    ckptfmt.save(path, 1, w, m, v, value_facts=False)
    assert "facts" not in json.loads(path.with_suffix(".json").read_text())
    report = validate_file(path)
    assert report.details["values"] == "scanned" and codes(report) == ["non_finite"]
    seed_write(tmp_path / "step_000002.bin", 2, w, m, v)
    bare = validate_file(tmp_path / "step_000002.bin")
    assert bare.details["values"] == "scanned" and codes(bare) == ["unverified", "non_finite"]


def test_facts_given_by_a_caller_are_never_kept(tmp_path):
    """A ``facts`` field copied from another manifest describes other bytes."""
    lie = {"weights": {"finite": True, "non_finite": 0}, "m": {"finite": True, "non_finite": 0},
           "v": {"finite": True, "non_finite": 0, "non_negative": True, "negative": 0}}
    w, m, v = with_values(weights={1: np.nan})
    ckptfmt.save(tmp_path / "step_000001.bin", 1, w, m, v, manifest={"facts": lie})
    assert json.loads((tmp_path / "step_000001.json").read_text())["facts"]["weights"]["non_finite"] == 1
    ckptfmt.save(tmp_path / "step_000002.bin", 2, w, m, v, manifest={"facts": lie}, value_facts=False)
    assert "facts" not in json.loads((tmp_path / "step_000002.json").read_text())


def test_scan_finds_what_hand_edited_facts_hide(tmp_path):
    """The rule trusts facts exactly as far as it trusts the manifest's blake3; --scan looks."""
    path = tmp_path / "step_000001.bin"
    ckptfmt.save(path, 1, *with_values(m={2: np.nan}))
    mpath = path.with_suffix(".json")
    doc = json.loads(mpath.read_text())
    doc["facts"]["m"] = {"finite": True, "non_finite": 0}
    mpath.write_text(json.dumps(doc))
    assert not validate_file(path).ok                 # edited after its seal: damaged
    mf.write(mpath, doc)                              # a writer that sealed facts it got wrong
    assert validate_file(path).ok
    proc = cli("validate", "--scan", str(path))
    assert proc.returncode == 1 and "region m holds 1 NaN and 0 inf values" in proc.stdout


def test_malformed_facts_are_ignored_and_the_values_scanned(tmp_path):
    path = make(tmp_path, 1)
    mpath = path.with_suffix(".json")
    doc = json.loads(mpath.read_text())
    doc["facts"]["v"]["negative"] = -1
    mf.write(mpath, doc)                              # as a writer that seals what it writes left it
    report = validate_file(path)
    assert report.ok and report.details["values"] == "scanned"


def test_facts_cover_reused_buffers_as_written(tmp_path):
    """A producer refilling one scratch buffer (spec §5.7.1): each piece's facts are computed
    before the producer is resumed, so a NaN in one piece is counted exactly once."""
    n, piece = 3000, 1000
    w, m, v = with_values(n, m={1500: np.nan, 2999: np.inf})

    def staged(region):
        scratch = np.empty(piece, dtype="<f4")
        for start in range(0, n, piece):
            scratch[:] = region[start:start + piece]
            yield scratch
    r = ckptfmt.save(tmp_path / "step_000001.bin", 1, staged(w), staged(m), staged(v), n_params=n)
    assert r.facts["m"]["non_finite"] == 2 and r.facts["weights"]["non_finite"] == 0
    assert validate_file(tmp_path / "step_000001.bin", scan=True).details["non_finite"] == {"m": 2}


def test_sharded_generation_records_each_shard_and_the_combination(tmp_path):
    src = tmp_path / "step_000007.bin"
    ckptfmt.save(src, 7, *with_values(999, weights={0: np.nan, 998: np.nan}, v={500: -np.inf}))
    run = tmp_path / "run"
    manifest = shards.split(src, run, 3)
    doc = json.loads(manifest.read_text())
    per_shard = [row["facts"]["weights"]["non_finite"] for row in doc["shards"]]
    assert per_shard == [1, 0, 1] and doc["facts"]["weights"]["non_finite"] == 2
    assert doc["facts"]["v"]["non_finite"] == 1 and doc["facts"] == valfacts.combine([r["facts"] for r in doc["shards"]])
    recorded, scanned = validate_run(run), validate_run(run, scan=True)
    assert recorded.details["diverged"] == scanned.details["diverged"] == [7]
    assert recorded.details["generations"][0]["non_finite"] == {"weights": 2, "v": 1}
    assert scanned.details["generations"][0]["non_finite"] == {"weights": 2, "v": 1}


def test_combination_needs_every_shard():
    clean = valfacts.ValueFacts().to_dict()
    assert valfacts.combine([clean, None]) is None and valfacts.combine([clean, clean]) == clean


@pytest.mark.parametrize("seed", range(12))
def test_facts_equal_an_exact_count(seed):
    """The one-reduction proof never hides a value: huge finite values that overflow the sum,
    -0.0, subnormals, NaN payloads and infinities, in random places and chunk sizes."""
    rng = np.random.default_rng(seed)
    specials = np.array([np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, -0.0, 1e-45, -1e-45,
                         np.frombuffer(b"\x01\x00\xc0\xff", "<f4")[0]], dtype="<f4")
    facts = valfacts.ValueFacts()
    regions = {}
    for name in fmt.REGIONS:
        x = rng.standard_normal(int(rng.integers(1, 5000))).astype("<f4")
        hits = rng.integers(0, x.size, int(rng.integers(0, 6)))
        x[hits] = rng.choice(specials, hits.size)
        regions[name] = x
        cut = int(rng.integers(0, x.size + 1))
        facts.add(name, x[:cut])
        facts.add(name, x[cut:])
    got = facts.to_dict()
    for name, x in regions.items():
        finite = np.isfinite(x)
        assert got[name]["non_finite"] == int(np.count_nonzero(~finite))
        if name == "v":
            assert got[name]["negative"] == int(np.count_nonzero(x[finite] < 0))
