"""Shared helpers: small checkpoints, the independent seed reader/writer, a CLI runner."""
from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptfmt

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
# An internal error keeps its traceback under test (cli/output.py): the CLI contract tests look
# for tracebacks, and a defect must fail them rather than hide behind the one-line safety net.
os.environ["CKPTFMT_DEBUG"] = "1"


def seed_read(path):
    """The independent 10-line reader of spec Appendix B."""
    data = open(path, "rb").read()
    step, n = struct.unpack("<ii", data[:8])
    assert n >= 0 and len(data) == 8 + 12 * n
    f = np.frombuffer(data, dtype="<f4", offset=8)
    return step, f[:n], f[n:2 * n], f[2 * n:]


def seed_write(path, step, w, m, v):
    """The independent writer from the byte table (no manifest, no ckptfmt)."""
    with open(path, "wb") as f:
        f.write(struct.pack("<ii", step, len(w)))
        for a in (w, m, v):
            f.write(np.asarray(a, dtype="<f4").tobytes())


def arrays(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n).astype("<f4")
    m = (rng.standard_normal(n) * 1e-3).astype("<f4")
    v = (rng.random(n) * 1e-6).astype("<f4")
    return w, m, v


def make(directory, step: int, n: int = 100, seed: int = 0, **kwargs) -> Path:
    path = Path(directory) / f"step_{step:06d}.bin"
    ckptfmt.save(path, step, *arrays(n, seed), **kwargs)
    return path


def last_step(run: Path) -> int:
    """The newest step recorded in a run's .loss.json (0 before the first; a torn line is skipped)."""
    import json
    try:
        lines = (Path(run) / ".loss.json").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(x)["step"] for x in lines if '"loss"' in x and x.endswith("}")), default=0)


def cli(*args: str, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    """Run the real console entry point in a fresh process."""
    return subprocess.run([PY, "-m", "ckptfmt.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.fixture
def runner():
    from click.testing import CliRunner
    return CliRunner()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "64k"):
    """A tmpfs of ``size`` mounted at ``path`` (made here) for a full-disk test (root mounts
    it, as the read-only fixture does); unmounted after."""
    path.mkdir()
    assert subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode == 0, \
        "this test needs a full file system (root: mount -t tmpfs)"
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
