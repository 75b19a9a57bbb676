#!/usr/bin/env python3
"""Write the seed inputs of the conversion and archive targets into fuzz/corpus (issue 18).

Each seed is the selector byte of ``target.py`` followed by a valid file written by ckptfmt
itself (a .npz, a .safetensors, a .zst, an export .tar.zst, a .pt), plus one variant per reader
whose metadata is partial, so coverage-guided fuzzing starts from inputs that get past the
first checks. Names are the sha1 of the content, as libFuzzer names its corpus.

    .venv/bin/python fuzz/seeds.py
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import ckptfmt  # noqa: E402
from ckptfmt import tensorfile  # noqa: E402
from ckptfmt.tools.convert import convert  # noqa: E402
from ckptfmt.tools.archive import archive  # noqa: E402
from target import ARCHIVE, CONVERSION_READERS, TORCH  # noqa: E402

LAYOUT = [{"name": "a", "shape": [2, 2], "offset": 0}, {"name": "b", "shape": [2], "offset": 4}]


def _seed(selector: int, data: bytes) -> None:
    blob = bytes([selector]) + data
    with open(os.path.join(HERE, "corpus", hashlib.sha1(blob).hexdigest()), "wb") as f:
        f.write(blob)


def main() -> None:
    tmp = tempfile.mkdtemp()
    run = os.path.join(tmp, "run")
    os.makedirs(run)
    w = np.arange(6, dtype="<f4") - 2.5
    src = ckptfmt.save_generation(run, 3, w, w / 10, np.abs(w) / 100, manifest={"layout": LAYOUT}).path
    with open(os.path.join(run, ".loss.json"), "w") as f:
        f.write('{"step": 3, "loss": 1.5}\n')
    by_ext = {name.split(".")[-1]: selector for selector, (name, _) in CONVERSION_READERS.items()}
    for ext, selector in (*by_ext.items(), ("pt", TORCH)):
        out = os.path.join(tmp, f"x.{ext}")
        convert(src, out)
        _seed(selector, open(out, "rb").read())
    meta = {"format": "ckptfmt", "step": "3", "layout": json.dumps(LAYOUT[:1])}
    partial = os.path.join(tmp, "partial.safetensors")
    tensorfile.write(partial, [(r, "F32", [6], w) for r in ("weights", "m", "v")], meta)
    _seed(by_ext["safetensors"], open(partial, "rb").read())
    archive(run, os.path.join(tmp, "run.tar.zst"))
    _seed(ARCHIVE, open(os.path.join(tmp, "run.tar.zst"), "rb").read())


if __name__ == "__main__":
    main()
