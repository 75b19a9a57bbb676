"""Docs that run: every docstring example in the library, the public API's
docstrings, and the README's library example."""
from __future__ import annotations

import doctest
import importlib
import inspect
import os
import pkgutil
import re
from pathlib import Path

import pytest

import ckptfmt

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(m.name for m in pkgutil.walk_packages(ckptfmt.__path__, "ckptfmt.")
                 if not m.name.endswith("__main__"))
PUBLIC = ["ckptfmt", "ckptfmt.errors", "ckptfmt.run", "ckptfmt.torch", "ckptfmt.tools.validate",
          "ckptfmt.tools.inspect", "ckptfmt.tools.diff", "ckptfmt.tools.convert", "ckptfmt.tools.export",
          "ckptfmt.tools.archive",
          "ckptfmt.tools.plot", "ckptfmt.tools.stats", "ckptfmt.verify", "ckptfmt.lightning",
          "ckptfmt.hf"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"


def test_the_examples_exist():
    """Not vacuous: the examples that document the core are found and run."""
    counts = {name: doctest.testmod(importlib.import_module(name)).attempted
              for name in ("ckptfmt", "ckptfmt.reader", "ckptfmt.errors", "ckptfmt.manifest",
                           "ckptfmt.run.retention", "ckptfmt.tools.convert.zst")}
    assert all(counts.values()), counts


@pytest.mark.parametrize("name", PUBLIC)
def test_public_api_has_docstrings(name):
    module = importlib.import_module(name)
    assert inspect.getdoc(module), f"{name} has no module docstring"
    missing = []
    for attr in getattr(module, "__all__", []):
        obj = getattr(module, attr)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if not inspect.getdoc(obj):
            missing.append(attr)
        if inspect.isclass(obj) and not issubclass(obj, Exception):
            missing += [f"{attr}.{k}" for k, v in vars(obj).items() if not k.startswith("_")
                        and (inspect.isfunction(v) or isinstance(v, property)) and not inspect.getdoc(v)]
    assert not missing, f"{name}: no docstring on {missing}"


def test_readme_library_example_runs(tmp_path, monkeypatch):
    """The README's library section, as a user would paste it (into an empty directory)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## The library\n+```python\n(.*?)```", text, re.S)
    assert block, "README has no library example"
    monkeypatch.chdir(tmp_path)
    os.makedirs("runs/x")
    code = block.group(1)
    setup = ("import numpy as np, torch\n"
             "weights = m = v = np.arange(6, dtype='<f4')\n"
             "layout = [{'name': 'blocks.0.qkv.weight', 'shape': [2, 3], 'offset': 0}]\n"
             "model = torch.nn.Linear(2, 3, bias=False)\n"
             "optimizer = torch.optim.AdamW(model.parameters())\n")
    exec(compile(setup + code, "README.md", "exec"), {})
