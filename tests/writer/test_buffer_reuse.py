"""A producer that reuses its buffers must never corrupt the manifest's digest.

The writer hashes on a second thread. A region iterator that refills the buffer it yielded
before (the torch adapter's CUDA staging pair, or any generator with one scratch buffer) must
not be resumed while a hash of that buffer is outstanding (spec/FORMAT.md §5.1).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import blake3
import numpy as np
import pytest

import ckptfmt
from ckptfmt import fingerprint, manifest as mf

PIECE = 2 << 20           # floats per staging buffer (8 MiB, staging.STAGING)


def staged(source: np.ndarray, n_buffers: int):
    """Yield ``source`` through ``n_buffers`` reused scratch buffers, refilled in turn."""
    buffers = [np.empty(PIECE, dtype="<f4") for _ in range(n_buffers)]
    for turn, start in enumerate(range(0, source.size, PIECE)):
        piece = source[start:start + PIECE]
        buf = buffers[turn % n_buffers][:piece.size]
        buf[:] = piece          # overwrites what the writer was handed n_buffers pieces ago
        yield buf


class SlowHasher:
    """A hasher whose update is slow, so a producer that runs ahead overwrites what it reads."""

    def __init__(self, real):
        self.real = real

    def update(self, data):
        time.sleep(0.02)
        self.real.update(data)

    def hexdigest(self):
        return self.real.hexdigest()


def _destinations():
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return [shm] if shm else []


def _check(path, result) -> None:
    data = open(path, "rb").read()
    assert blake3.blake3(data).hexdigest() == result.blake3
    assert mf.read(mf.path_for(path))["blake3"] == result.blake3
    b3 = subprocess.run(["b3sum", "--no-names", path], capture_output=True, text=True, check=True)
    assert b3.stdout.strip() == result.blake3
    report = ckptfmt.validate(path)
    assert report.ok, report


@pytest.mark.parametrize("n_buffers", [1, 2])
@pytest.mark.parametrize("slow", [True, False], ids=["slow-hasher", "tmpfs"])
def test_reused_staging_buffers_never_corrupt_the_digest(tmp_path, monkeypatch, n_buffers, slow):
    if slow:
        real = fingerprint.hasher
        monkeypatch.setattr(fingerprint, "hasher", lambda threads=1: SlowHasher(real(threads)))
        directory, saves, n = str(tmp_path), 3, 2 * PIECE + 12345
    else:
        directory = tempfile.mkdtemp(dir=(_destinations() or [str(tmp_path)])[0])
        saves, n = 10, 4 * PIECE + 777
    try:
        base = np.random.default_rng(n_buffers).random(n, dtype=np.float32)
        for step in range(1, saves + 1):
            w, m, v = base + step, base * step, base / step
            path = os.path.join(directory, f"step_{step:06d}.bin")
            result = ckptfmt.save(path, step, *(staged(a, n_buffers) for a in (w, m, v)),
                                  n_params=n)
            expected = blake3.blake3(open(path, "rb").read()).hexdigest()
            assert result.blake3 == expected, f"save {step}: manifest digest is not the file's"
            _check(path, result)
            os.remove(path)
            os.remove(mf.path_for(path))
    finally:
        if not slow:
            shutil.rmtree(directory, ignore_errors=True)


def test_writer_finishes_every_buffer_before_resuming_the_producer(tmp_path, monkeypatch):
    """The contract, observed directly: when the producer is resumed no hash is outstanding."""
    outstanding = []
    real = fingerprint.hasher

    class Counting(SlowHasher):
        active = 0

        def update(self, data):
            Counting.active += 1
            try:
                super().update(data)
            finally:
                Counting.active -= 1

    monkeypatch.setattr(fingerprint, "hasher", lambda threads=1: Counting(real(threads)))
    source = np.arange(5 * PIECE + 3, dtype="<f4")

    def producer():
        for piece in staged(source, 2):
            yield piece
            outstanding.append(Counting.active)

    ckptfmt.save(tmp_path / "step_000001.bin", 1, producer(), source, source, n_params=source.size)
    assert outstanding and set(outstanding) == {0}
