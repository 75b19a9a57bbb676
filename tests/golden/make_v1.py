"""How the golden files in tests/golden/v1/ were made: run once, at commit fe7d78e (the module
layout before folders became layers), and never again. The files are committed; tests/format/test_golden.py must read every
one with the code of every later commit. Kept as the record of how they were made; it imports
the module paths of that commit, so it does not run on today's layout. A later format writes
its own make_vN.py and vN/ beside these.
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np

import ckptfmt
from ckptfmt.convert import convert
from ckptfmt.export import archive
from ckptfmt.history import History
from ckptfmt.run import Run

OUT = Path(__file__).resolve().parent / "v1"
LAYOUT = [{"name": "a.weight", "shape": [2, 2], "offset": 0},
          {"name": "b.bias", "shape": [2], "offset": 4}]


def regions(step):
    w = (np.arange(6, dtype="<f4") - 2.5) * step
    return w, w / 1000, np.abs(w) / 1e6


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    extra = {"layout": LAYOUT, "optimizer": {"type": "AdamW", "step": 7}, "config": {"name": "golden"}}
    (OUT / "bin").mkdir()
    ckptfmt.save(OUT / "bin" / "step_000007.bin", 7, *regions(7), manifest=extra)
    convert(str(OUT / "bin" / "step_000007.bin"), str(OUT / "sharded"), to="shards", shards=2)
    (OUT / "zst").mkdir()
    convert(str(OUT / "bin" / "step_000007.bin"), str(OUT / "zst" / "step_000007.zst"))
    (OUT / "dcp").mkdir()
    convert(str(OUT / "bin" / "step_000007.bin"), str(OUT / "dcp" / "step_000007.dcp"), to="dcp")
    run = OUT / "run"
    r = Run(run, create=True)
    history = History(run / ".loss.json")
    for step in range(1, 8):
        history.append({"step": step, "loss": 3.0 / step, "lr": 1e-3, "time": 1764500000.0 + step})
        if step in (5, 7):
            r.commit(step, *regions(step), manifest=extra)
    history.close()
    (OUT / "export").mkdir()
    archive(str(run), str(OUT / "export" / "run.tar.zst"), steps=[5, 7])
    shutil.rmtree(run)
    print(json.dumps(sorted(str(p.relative_to(OUT)) for p in OUT.rglob("*") if p.is_file()), indent=1))


if __name__ == "__main__":
    sys.exit(main())
