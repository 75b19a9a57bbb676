"""The spec cannot drift: its appendix and the golden vectors are decoded here."""
import json
import re
import subprocess
import sys

import blake3

import ckptfmt
from conftest import ROOT, seed_read

SPEC = (ROOT / "spec" / "FORMAT.md").read_text()
VECTORS = ROOT / "spec" / "vectors"


def appendix_bytes() -> tuple[bytes, str]:
    block = SPEC.split("## Appendix A", 1)[1].split("```")[1]
    data = b"".join(bytes.fromhex(" ".join(line.split()[1:])) for line in block.strip().splitlines()
                    if re.match(r"^[0-9a-f]{8} ", line))
    digest = re.search(r"blake3 ([0-9a-f]{64})", block).group(1)
    return data, digest


def test_appendix_dump_decodes_to_the_documented_file():
    data, digest = appendix_bytes()
    ck = ckptfmt.reader.from_bytes(data)
    assert (ck.step, ck.n_params, len(data)) == (3, 2, 32)
    assert ck.weights.tolist() == [1.0, -2.0] and ck.m.tolist() == [0.5, 0.25] and ck.v.tolist() == [0.125, 0.0]
    assert blake3.blake3(data).hexdigest() == digest
    assert (VECTORS / "step_000003.bin").read_bytes() == data


def test_every_vector_matches_its_expectations():
    expected = json.loads((VECTORS / "expected.json").read_text())
    assert set(expected) == {p.name for p in VECTORS.glob("*.bin")}
    for name, exp in expected.items():
        path = VECTORS / name
        data = path.read_bytes()
        assert data.hex() == exp["hex"]
        ck = ckptfmt.open(path)
        assert (ck.step, ck.n_params, ck.size) == (exp["step"], exp["n_params"], exp["size"])
        assert ck.fingerprint() == exp["blake3"] == blake3.blake3(data).hexdigest()
        s, w, m, v = seed_read(path)
        assert s == ck.step and w.tobytes() == ck.weights.tobytes() and v.tobytes() == ck.v.tobytes()


def test_nan_payloads_survive_in_the_vectors():
    ck = ckptfmt.open(VECTORS / "step_1000000.bin")
    assert ck.weights.view("<u4").tolist() == [0x7FC00001, 0x80000000, 0x7F800000, 0x00000001]
    assert ck.m.view("<u4")[0] == 0xFFA5A5A5


def test_vectors_are_reproducible_by_the_committed_script(tmp_path):
    script = (ROOT / "spec" / "make_vectors.py").read_text().replace(
        'Path(__file__).resolve().parent / "vectors"', f"Path({str(tmp_path)!r})")
    (tmp_path / "gen.py").write_text(script)
    subprocess.run([sys.executable, str(tmp_path / "gen.py")], check=True, capture_output=True)
    for p in VECTORS.iterdir():
        assert (tmp_path / p.name).read_bytes() == p.read_bytes(), p.name


def test_the_12_8m_file_is_exactly_153600008_bytes(tmp_path):
    import numpy as np
    n = 12_800_000
    z = np.zeros(n, dtype="<f4")
    r = ckptfmt.save(tmp_path / "step_000001.bin", 1, z, z, z)
    assert r.size == (tmp_path / "step_000001.bin").stat().st_size == 153_600_008
