#!/usr/bin/env python3
"""Fuzz target: every parser that sees untrusted bytes. Only CheckpointError may escape.

    .venv/bin/pip install atheris
    .venv/bin/python fuzz/target.py fuzz/corpus -max_total_time=600    # coverage-guided, 10 min
    .venv/bin/python fuzz/target.py -merge=1 fuzz/min fuzz/corpus      # minimise the corpus

tests/test_fuzz_corpus.py replays fuzz/corpus in CI without atheris.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptfmt.run import history  # noqa: E402
from ckptfmt import manifest  # noqa: E402
from ckptfmt import tensorfile  # noqa: E402
from ckptfmt.errors import CheckpointError  # noqa: E402
from ckptfmt.reader import from_bytes  # noqa: E402

SCRATCH = tempfile.mkdtemp(prefix="ckptfmt-fuzz-")


def one_input(data: bytes) -> None:
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
