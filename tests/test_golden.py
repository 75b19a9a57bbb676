"""Golden files of every earlier format keep loading (issue 15 §7; spec/FORMAT.md "Schema").

tests/golden/v1/ was written once by the code before the layout change (make_v1.py says how).
Each file must be read by today's code through the public API and the CLI, and give the values
and bytes it was written with.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import ckptfmt
from conftest import cli

V1 = Path(__file__).resolve().parent / "golden" / "v1"
GOLDEN_BIN = V1 / "bin" / "step_000007.bin"


def regions(step: int):
    w = (np.arange(6, dtype="<f4") - 2.5) * step
    return w, w / 1000, np.abs(w) / 1e6


def test_v1_generation_opens_verifies_and_reads_by_name():
    with ckptfmt.open(GOLDEN_BIN, verify=True) as ck:
        assert ck.step == 7 and ck.n_params == 6
        for got, want in zip((ck.weights, ck.m, ck.v), regions(7)):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(ck.tensor("a.weight"), regions(7)[0][:4].reshape(2, 2))
        assert ck.manifest["optimizer"] == {"type": "AdamW", "step": 7}
    assert ckptfmt.validate(GOLDEN_BIN).ok


@pytest.mark.parametrize("source", ["sharded/step_000007.json", "zst/step_000007.zst",
                                    "dcp/step_000007.dcp"])
def test_v1_foreign_forms_convert_back_to_the_same_bytes(tmp_path, source):
    out = tmp_path / "step_000007.bin"
    proc = cli("convert", str(V1 / source), str(out), "--to", "bin")
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == GOLDEN_BIN.read_bytes()
    assert cli("validate", str(out)).returncode == 0


def test_v1_sharded_generation_validates():
    proc = cli("validate", str(V1 / "sharded"), "--json")   # a run holding one sharded generation
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_v1_export_archive_imports_verified(tmp_path):
    dest = tmp_path / "back"
    proc = cli("import", str(V1 / "export" / "run.tar.zst"), str(dest), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == [5, 7]
    for step in (5, 7):
        with ckptfmt.open(dest / f"step_{step:06d}.bin", verify=True) as ck:
            for got, want in zip((ck.weights, ck.m, ck.v), regions(step)):
                np.testing.assert_array_equal(got, want)
    assert cli("validate", str(dest)).returncode == 0
    assert sum(1 for _ in open(dest / ".loss.json")) == 7
