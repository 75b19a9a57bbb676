"""The layers and import rules (spec/FORMAT.md §12) hold, and the linter that holds them bites."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=tree, capture_output=True, text=True,
                          timeout=300)


def test_every_core_module_is_in_the_core_layer():
    layers = next(c for c in CONFIG["contracts"] if c["type"] == "layers")["layers"]
    core = {m.strip() for m in layers[-1].split(":")}
    on_disk = {f"ckptfmt.{p.stem}" for p in (ROOT / "ckptfmt").glob("*.py") if p.stem != "__init__"}
    assert core == on_disk


def test_lint_imports_fails_on_a_forbidden_import(tmp_path):
    """A copy of the package with one forbidden import added (the core importing torch, and
    the run layer importing the trainer) breaks the contracts; the clean copy keeps them."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "ckptfmt", tree / "ckptfmt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    clean = _lint(tree)
    assert clean.returncode == 0, clean.stdout[-2000:]
    fmt = tree / "ckptfmt" / "format.py"
    fmt.write_text(fmt.read_text() + "\n\ndef _bad():\n    import torch  # noqa\n    return torch\n")
    ops = tree / "ckptfmt" / "run" / "ops.py"
    ops.write_text(ops.read_text() + "\n\nfrom ..trainer import config as _bad_config  # noqa\n")
    broken = _lint(tree)
    assert broken.returncode == 1
    assert "ckptfmt.format -> torch" in broken.stdout
    assert "ckptfmt.run.ops -> ckptfmt.trainer.config" in broken.stdout


def test_no_module_over_400_lines_and_no_function_over_50():
    too_long = []
    for path in sorted((ROOT / "ckptfmt").rglob("*.py")):
        source = path.read_text()
        if source.count("\n") > 400:
            too_long.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 50:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long, too_long
