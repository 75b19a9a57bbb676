#!/usr/bin/env python3
"""Fuzz target: every parser that sees untrusted bytes. Only CheckpointError may escape.

The first byte picks the parser: ``% 4`` for the core's (a .bin from bytes, a manifest, a
safetensors file, the loss history), and 0xF8..0xFC for the readers of the conversions and the
archive (a ckptfmt .npz, a ckptfmt .safetensors, the .zst form, an export .tar.zst unpacked
into a scratch DEST, a torch .pt when torch is installed), so the committed corpus keeps its
meaning as targets are added.

    .venv/bin/pip install atheris
    .venv/bin/python fuzz/target.py fuzz/corpus -max_total_time=600    # coverage-guided, 10 min
    .venv/bin/python fuzz/target.py -merge=1 fuzz/min fuzz/corpus      # minimise the corpus

tests/reliability/test_fuzz_corpus.py replays fuzz/corpus in CI without atheris.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import shutil  # noqa: E402

from ckptfmt.run import history  # noqa: E402
from ckptfmt import manifest  # noqa: E402
from ckptfmt import tensorfile  # noqa: E402
from ckptfmt.errors import CheckpointError  # noqa: E402
from ckptfmt.reader import from_bytes  # noqa: E402
from ckptfmt.tools.convert import npz, safetensors, zst  # noqa: E402
from ckptfmt.tools.archive import import_archive  # noqa: E402

SCRATCH = tempfile.mkdtemp(prefix="ckptfmt-fuzz-")
CONVERSION_READERS = {0xF8: ("x.npz", npz.load), 0xF9: ("x.safetensors", safetensors.load),
                      0xFA: ("x.zst", zst.load)}
ARCHIVE, TORCH = 0xFB, 0xFC


def one_input(data: bytes) -> None:
    if data and data[0] in CONVERSION_READERS or data[:1] in (bytes([ARCHIVE]), bytes([TORCH])):
        _conversion_or_archive(data[0], data[1:])
        return
    selector, body = (data[0] % 4, data[1:]) if data else (0, b"")
    try:
        if selector == 0:
            from_bytes(body)
        elif selector == 1:
            _manifest(body)
        elif selector == 2:
            path = os.path.join(SCRATCH, "x.safetensors")
            with open(path, "wb") as f:
                f.write(body)
            sf = tensorfile.TensorFile(path)
            for name in sf.names():
                sf.tensor(name)
        else:
            path = os.path.join(SCRATCH, ".loss.json")
            with open(path, "wb") as f:
                f.write(body)
            history.read(path).canonical()
    except CheckpointError:
        pass


def _scratch_file(name: str, body: bytes) -> str:
    path = os.path.join(SCRATCH, name)
    with open(path, "wb") as f:
        f.write(body)
    return path


def _conversion_or_archive(selector: int, body: bytes) -> None:
    """A conversion reader reads the whole file into a checked ``Source``; the archive reader
    unpacks into a scratch DEST that must not exist afterwards unless the import succeeded."""
    try:
        if selector in CONVERSION_READERS:
            name, load = CONVERSION_READERS[selector]
            source = load(_scratch_file(name, body))
            assert source.weights.size == source.n_params and 0 <= source.step <= 2**31 - 1
        elif selector == TORCH:
            from ckptfmt.tools.convert import pt
            pt.load(_scratch_file("x.pt", body))
        else:
            dest = os.path.join(SCRATCH, "imported")
            shutil.rmtree(dest, ignore_errors=True)
            try:
                import_archive(_scratch_file("x.tar.zst", body), dest)
            except CheckpointError:
                assert not os.path.exists(dest), "a failed import left its destination behind"
                raise
    except CheckpointError:
        pass


def _manifest(body: bytes) -> None:
    path = os.path.join(SCRATCH, "step_000001.json")
    with open(path, "wb") as f:
        f.write(body)
    doc = manifest.read(path)
    manifest.check_matches(path, doc, os.path.join(SCRATCH, "step_000001.bin"), size=8, step=1, n_params=0)
    json.dumps(doc)


def main() -> None:
    import atheris
    atheris.instrument_all()
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
