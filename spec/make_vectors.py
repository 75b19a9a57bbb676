"""Regenerate spec/vectors/: tiny golden files with their expected header values and blake3.

    python spec/make_vectors.py        # rewrites spec/vectors/ and prints the appendix dump

The files are written with the independent 10-line writer below (not with ckptfmt), so the
vectors pin the byte layout of spec §2 rather than whatever the library happens to do.
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import blake3
import numpy as np

HERE = Path(__file__).resolve().parent / "vectors"


def seed_writer(path: Path, step: int, w, m, v) -> bytes:
    """The byte table of spec §2, nothing more."""
    data = struct.pack("<ii", step, len(w)) + b"".join(
        (a if isinstance(a, np.ndarray) else np.asarray(a, dtype="<f4")).tobytes() for a in (w, m, v))
    path.write_bytes(data)
    return data


def _bits(*words: int) -> np.ndarray:
    return np.array(words, dtype="<u4").view("<f4")


VECTORS = {
    "step_000003.bin": (3, [1.0, -2.0], [0.5, 0.25], [0.125, 0.0]),
    "step_000000.bin": (0, [], [], []),
    # NaN with payloads, -0.0, +-inf, the smallest subnormal, the largest float32: by bit pattern
    "step_1000000.bin": (1_000_000, _bits(0x7FC00001, 0x80000000, 0x7F800000, 0x00000001),
                         _bits(0xFFA5A5A5, 0x00000000, 0x7F7FFFFF, 0xBFC00000),
                         _bits(0x00000000, 0x000116C2, 0x40000000, 0x40E00000)),
}


def main() -> int:
    HERE.mkdir(exist_ok=True)
    expected = {}
    for name, (step, w, m, v) in VECTORS.items():
        data = seed_writer(HERE / name, step, w, m, v)
        expected[name] = {"step": step, "n_params": len(w), "size": len(data),
                          "blake3": blake3.blake3(data).hexdigest(), "hex": data.hex()}
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    data = (HERE / "step_000003.bin").read_bytes()
    for off in range(0, len(data), 16):
        chunk = data[off:off + 16]
        print(f"{off:08x}  {chunk.hex(' ')}")
    print("blake3", expected["step_000003.bin"]["blake3"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
