"""Corruption is always detected (RELIABILITY.md items 6-10, 12, 15)."""
import ast
import os
import random
import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import ckptfmt
from ckptfmt.errors import CheckpointError
from ckptfmt.reader import from_bytes
from ckptfmt.tools.validate import validate_file
from faults import arrays, scale

ROOT = Path(__file__).resolve().parents[2]


def test_every_single_bit_flip_is_rejected(tmp_path):
    path = tmp_path / "step_000007.bin"
    ckptfmt.save(path, 7, *arrays(64, 7))
    good = path.read_bytes()
    rng = random.Random(0)
    flips = [(i // 8, i % 8) for i in range(64)]                      # all 64 header bits
    flips += [(rng.randrange(len(good)), rng.randrange(8)) for _ in range(scale(10_000, 1_000_000))]
    rejected = 0
    for offset, bit in flips:
        data = bytearray(good)
        data[offset] ^= 1 << bit
        path.write_bytes(bytes(data))
        if not validate_file(path).ok:
            rejected += 1
    print(f"FIGURE bit flips: {rejected} of {len(flips)} rejected")
    assert rejected == len(flips)


def test_truncation_at_every_byte_and_1000_points_of_a_large_file(tmp_path):
    small = tmp_path / "s.bin"
    ckptfmt.save(small, 1, *arrays(50, 1), write_manifest=False)
    data = small.read_bytes()
    for cut in range(len(data)):
        with pytest.raises(CheckpointError):
            from_bytes(data[:cut])
    big = tmp_path / "step_000001.bin"
    n = 3_000_000
    ckptfmt.save(big, 1, *arrays(n, 1))
    size = big.stat().st_size
    points = sorted(random.Random(2).sample(range(size), 1000), reverse=True)
    for cut in points:                       # ever shorter: one truncate and one O(1) check each
        os.truncate(big, cut)
        with pytest.raises(CheckpointError):
            ckptfmt.open(big)
        assert not validate_file(big, deep=False).ok


def test_1_to_4096_trailing_bytes_are_rejected():
    data = struct.pack("<ii", 1, 3) + bytes(36)
    for extra in range(1, 4097):
        with pytest.raises(CheckpointError):
            from_bytes(data + b"\x00" * extra)


@pytest.mark.parametrize("fill", ["zeros", "garbage"])
def test_pages_at_the_end_overwritten_are_rejected(tmp_path, fill):
    path = tmp_path / "step_000001.bin"
    ckptfmt.save(path, 1, *arrays(20_000, 1))
    good = path.read_bytes()
    rng = np.random.default_rng(3)
    for pages in (1, 2, 5):
        data = bytearray(good)
        tail = pages * 4096
        data[-tail:] = bytes(tail) if fill == "zeros" else rng.integers(0, 256, tail, dtype=np.uint8).tobytes()
        path.write_bytes(bytes(data))
        report = validate_file(path)
        assert not report.ok and "fingerprint_mismatch" in {f.code for f in report.findings}


def test_hostile_headers_fail_fast_without_allocating(tmp_path):
    """n larger than the file, every extreme value: a typed error in < 10 ms, < 1 MiB allocated."""
    path = tmp_path / "step_000001.bin"
    for step in (-2**31, -1, 0, 1, 2**31 - 1):
        for n in (-2**31, -1, 0, 1, 2**31 - 1):
            path.write_bytes(struct.pack("<ii", step, n) + bytes(12 * 5))
            tracemalloc.start()
            t = time.perf_counter()
            try:
                ckptfmt.open(path)
                ok = True
            except CheckpointError:
                ok = False
            took = time.perf_counter() - t
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert took < 0.010 and peak < 1 << 20, (step, n, took, peak)
            assert ok == (n == 5 and step == 1)
    (tmp_path / "step_000002.bin").write_bytes(struct.pack("<ii", 3, 5) + b"".join(
        a.tobytes() for a in arrays(5, 1)))       # save refuses such a name; another writer did not
    with pytest.raises(ckptfmt.errors.BadNameError):           # header step not the name's step
        ckptfmt.open(tmp_path / "step_000002.bin")


# ---------------------------------------------------------------- no code execution on load
LOAD_PATH = sorted(str(p.relative_to(ROOT / "ckptfmt")) for p in (ROOT / "ckptfmt").rglob("*.py"))
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_MODULES = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}


def test_no_pickle_or_eval_on_any_load_path_statically():
    for rel in LOAD_PATH:
        tree = ast.parse((ROOT / "ckptfmt" / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in FORBIDDEN_CALLS, (rel, node.lineno)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                assert not FORBIDDEN_MODULES & {n.split(".")[0] for n in names}, (rel, node.lineno)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("torch", "np", "numpy"):
                kw = {k.arg: k.value for k in node.keywords}
                if node.func.value.id == "torch":
                    assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, (rel, node.lineno)
                else:
                    assert "allow_pickle" not in kw or kw["allow_pickle"].value is False, (rel, node.lineno)


def test_no_pickle_or_eval_at_run_time(tmp_path, monkeypatch):
    """Open, validate, diff, convert (non-.pt), history, resume into torch: with pickle and
    eval patched to raise."""
    import builtins
    import pickle
    torch = pytest.importorskip("torch")
    import ckptfmt.torch as ct
    from ckptfmt.tools.convert import convert
    from ckptfmt.tools.diff import diff
    from ckptfmt.tools.validate import validate_run
    from models import tiny_adamw, tiny_linear, train_steps
    model, opt = tiny_adamw()
    train_steps(model, opt, 1)
    r = ct.save(str(tmp_path / "step_000001.bin"), model, opt,
                manifest={"rng": ct.rng_state({"g": np.random.default_rng(0)})})

    def every_load_path():
        ck = ckptfmt.open(r.path, verify=True)
        assert validate_file(r.path).ok and validate_run(tmp_path).ok and diff(r.path, r.path).identical
        for ext in ("safetensors", "npz", "zst"):
            out = tmp_path / f"x.{ext}"
            if out.exists():
                out.unlink()
            convert(r.path, str(out))
        fresh = tiny_linear(seed=1)
        ct.load(r.path, fresh, torch.optim.AdamW(fresh.parameters()))
        assert torch.equal(fresh.weight, model.weight)
        ct.restore_rng(ck.manifest["rng"], {"g": np.random.default_rng(1)})
    every_load_path()              # once unpatched, so lazy imports (which exec module code) are done

    def boom(*a, **k):
        raise AssertionError("pickle/eval called on a load path")
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, boom)
    monkeypatch.setattr(builtins, "eval", boom)
    monkeypatch.setattr(builtins, "exec", boom)
    every_load_path()
