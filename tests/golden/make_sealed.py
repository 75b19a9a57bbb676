"""How the golden files in tests/golden/sealed/ were made: run once, when manifests gained their
seal (spec/FORMAT.md §4.7), and never again; the files are committed.

``run/`` holds a sealed generation written by the code of that commit. The two others are what a
released ckptfmt (0.1.0 before the seal, commit e469dbc, extracted from git into a temporary
directory) makes of it when it rewrites the manifest: ``fork/`` (``ckptfmt fork``: copies every
field and adds ``provenance``) and ``shards/`` (``ckptfmt convert --to shards``: copies every field
but ``facts`` beside a new ``file``, ``size``, ``blake3``, ``shards`` and ``world_size``) and
``joined/`` (``ckptfmt convert`` of those shards back into a ``.bin``: adds ``consolidated_from``). All carry
the seal the released code copied without knowing it. tests/format/test_golden.py checks that the
code of every later commit reads all four, calls none of them damaged, and says what is not
self-checked.

    .venv/bin/python tests/golden/make_sealed.py
"""
import base64
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import ckptfmt

RELEASED = "e469dbc"
OUT = Path(__file__).resolve().parent / "sealed"
ROOT = Path(__file__).resolve().parents[2]
LAYOUT = [{"name": "a.weight", "shape": [2, 2], "offset": 0}, {"name": "b.bias", "shape": [2], "offset": 4}]


def released(tree: Path, *argv: str) -> None:
    """A command line of the released ckptfmt, from its own source tree."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "-m", "ckptfmt.cli", *argv], check=True, env=env, cwd=tree)


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    (OUT / "run").mkdir(parents=True)
    w = (np.arange(6, dtype="<f4") - 2.5) * 9
    extra = {"layout": LAYOUT, "optimizer": {"type": "AdamW", "step": 9, "groups": [{"lr": 0.001, "betas": [0.9, 0.999]}]},
             "scheduler": {"last_epoch": 9, "base_lrs": [0.001], "_step_count": 10},
             "rng": {"python": base64.b64encode(bytes(range(64))).decode(), "torch_cpu": base64.b64encode(bytes(range(64, 128))).decode()},
             "config": {"name": "golden", "weight_decay": 0.1}}
    ckptfmt.save(OUT / "run" / "step_000009.bin", 9, w, w / 1000, np.abs(w) / 1e6, manifest=extra)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "released"
        tree.mkdir()
        archive = subprocess.run(["git", "archive", RELEASED, "ckptfmt"], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        released(tree, "fork", str(OUT / "run"), "--step", "9", str(OUT / "fork"))
        released(tree, "convert", str(OUT / "run" / "step_000009.bin"), str(OUT / "shards"), "--to", "shards")
        (OUT / "joined").mkdir()
        released(tree, "convert", str(OUT / "shards" / "step_000009.json"), str(OUT / "joined" / "step_000009.bin"))
    for name in ("fork", "shards", "joined"):        # what a fork or convert leaves beside the generation: not golden
        for leftover in (OUT / name).glob(".*"):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()


if __name__ == "__main__":
    main()
