"""The layers and import rules (spec/FORMAT.md §12) hold, and the linter that holds them bites."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).parent / "lint-imports"
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=tree, capture_output=True, text=True,
                          timeout=300)


def test_every_core_module_is_in_the_core_layer():
    layers = next(c for c in CONFIG["contracts"] if c["type"] == "layers")["layers"]
    core = {m.strip() for m in layers[-1].split(":")}
    on_disk = {f"ckptfmt.{p.stem}" for p in (ROOT / "ckptfmt").glob("*.py") if p.stem not in ("__init__", "__main__")}   # __main__: the entry point, above every layer
    on_disk |= {"ckptfmt.store"}          # the one core package: where a run's files live (Store)
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


def example_lines(tree: ast.Module) -> set[int]:
    """The lines of the docstrings' ``Attributes:``, ``What to do:`` and ``Examples:`` sections
    (from the first of these headings, and the blank line above it, to the docstring's end): what
    each field means, what to do about an error and how a name is used, documentation the API
    reference and the exit-codes table render rather than code, so no size rule counts them."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = node.body[0] if node.body else None
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        text = doc.value.value.splitlines()
        heading = next((i for i, line in enumerate(text) if line.strip() in ("Attributes:", "Examples:")
                        or line.strip().startswith("What to do:")), None)
        if heading is not None:
            heading -= heading > 0 and not text[heading - 1].strip()     # with the blank line above it
            lines.update(range(doc.lineno + heading, doc.end_lineno + 1))
    return lines


def test_no_module_over_400_lines_and_no_function_over_50():
    """Sizes without the docstrings' field lists, advice and examples (``example_lines``)."""
    too_long = []
    for path in sorted((ROOT / "ckptfmt").rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        examples = example_lines(tree)
        if source.count("\n") - len(examples) > 400:
            too_long.append(f"{path.relative_to(ROOT)}: {source.count(chr(10)) - len(examples)} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1 - len(examples & set(range(node.lineno, node.end_lineno + 1)))
                if lines > 50:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long, too_long


def test_a_docstrings_examples_are_not_counted_as_code():
    """Not vacuous: the lines from a docstring's ``Attributes:``, ``What to do:`` or
    ``Examples:`` heading (and the blank line above it) to its end, and only those."""
    source = 'def f():\n    """Doc.\n\n    Examples:\n        >>> f()\n    """\n    return 1\n'
    assert example_lines(ast.parse(source)) == {3, 4, 5, 6}
    source = 'class C:\n    """Doc.\n\n    Attributes:\n        a: what.\n    """\n    a: int\n'
    assert example_lines(ast.parse(source)) == {3, 4, 5, 6}
    source = 'class E(Exception):\n    """Doc.\n\n    What to do: retry.\n    """\n'
    assert example_lines(ast.parse(source)) == {3, 4, 5}
    assert example_lines(ast.parse('def f():\n    """Doc."""\n')) == set()


# ---------------------------------------------------------------- import cycles, found by parsing
def _modules(package: Path) -> dict[str, Path]:
    """Every module of the package on disk, by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports anywhere: at module level, in a function, under
    ``if TYPE_CHECKING:`` (every node of the tree counts); relative imports resolved. ``from X
    import y`` is an import of X.y when that is a module, else of X."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[:len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:      # import a.b.c: the deepest module of ours
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_cycles(package: Path) -> list[list[str]]:
    """Each import circle between the package's modules, as the modules around it (one circle
    per strongly connected set: Tarjan's algorithm), sorted."""
    mods = _modules(package)
    graph = {name: sorted(_imports(name, path, set(mods))) for name, path in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(_circle(graph, set(component)))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _circle(graph: dict[str, list[str]], component: set[str]) -> list[str]:
    """One circle through a strongly connected set, from its first module back to it."""
    start = min(component)
    paths = {start: [start]}
    todo = [start]
    while todo:                                        # breadth first: the shortest way back
        v = todo.pop(0)
        for w in graph[v]:
            if w == start:
                return paths[v] + [start]
            if w in component and w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    raise AssertionError(f"no circle through {start}")


def test_no_import_cycle_between_modules_type_checking_imports_included():
    """Parsed independently of import-linter: any import of the package's own modules, at any
    level and under ``TYPE_CHECKING`` too, forms no circle."""
    cycles = import_cycles(ROOT / "ckptfmt")
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


BACK_IMPORT = ("\n\nfrom typing import TYPE_CHECKING  # noqa\n\n"
               "if TYPE_CHECKING:\n    from .stateside import TorchState  # noqa\n")


def _with_back_import(tmp_path: Path) -> Path:
    """A copy of the package (and pyproject.toml) where restore imports, behind
    ``TYPE_CHECKING``, the torch state side that imports it."""
    shutil.copytree(ROOT / "ckptfmt", tmp_path / "ckptfmt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    restore = tmp_path / "ckptfmt" / "torch" / "restore.py"
    restore.write_text(restore.read_text() + BACK_IMPORT)
    return tmp_path / "ckptfmt"


def test_the_cycle_detector_finds_a_type_checking_back_import(tmp_path):
    cycles = import_cycles(_with_back_import(tmp_path))
    assert ["ckptfmt.torch.restore", "ckptfmt.torch.stateside", "ckptfmt.torch.restore"] in cycles, cycles


def test_lint_imports_counts_type_checking_imports_in_its_cycle_contract(tmp_path):
    """``exclude_type_checking_imports = false``: the acyclic_siblings contract sees the same
    hidden back-import and names it."""
    assert CONFIG["exclude_type_checking_imports"] is False
    _with_back_import(tmp_path)
    broken = _lint(tmp_path)
    assert broken.returncode == 1
    assert "No cycles are allowed in ckptfmt.torch." in broken.stdout, broken.stdout[-2000:]
    assert "- .restore -> .stateside" in broken.stdout or "- .stateside -> .restore" in broken.stdout


def test_an_xdist_group_runs_on_one_worker(tmp_path):
    """The suite keeps the tests that launch several processes (torchrun, two nodes) in one
    ``xdist_group`` so that two never run side by side on 2 cores; the installed pytest and
    pytest-xdist must honour the mark under scripts/test.sh's ``--dist loadgroup``."""
    (tmp_path / "test_group.py").write_text(
        "import os, pytest\n"
        "pytestmark = pytest.mark.xdist_group('g')\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_where(i):\n"
        "    open(f'w{i}', 'w').write(os.environ['PYTEST_XDIST_WORKER'])\n")
    # only xdist loaded: the other installed plugins' start-up took a minute of this test's wall time
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", "test_group.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=110, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workers = {(tmp_path / f"w{i}").read_text() for i in range(6)}
    assert len(workers) == 1, f"one group ran on {sorted(workers)}"


# A ticket number of this project ("#" and two digits or more); another project's thread cited for a fact
# ("pytest-xdist#1386") is not one.
TRACKER_REFERENCE = re.compile(r"(?<![\w/-])#\d{2,}\b")

BEHAVIOUR_FOLDERS = {"format", "writer", "run", "retention", "manager", "frameworks", "distributed", "tiers",
                     "cli", "reliability", "trainer", "project"}


def test_every_test_module_lives_in_a_behaviour_folder_and_is_on_the_map():
    tests = ROOT / "tests"
    the_map = (tests / "README.md").read_text()
    modules = sorted(tests.rglob("test_*.py"))
    assert len(modules) > 50
    for module in modules:
        rel = module.relative_to(tests)
        assert len(rel.parts) == 2 and rel.parts[0] in BEHAVIOUR_FOLDERS, f"{rel}: not in a behaviour folder"
        assert not re.search(r"_(edges|misuse)\b", module.stem), f"{rel}: named by its history, not its subject"
        assert not re.search(TRACKER_REFERENCE, module.read_text()), f"{rel}: points at the tracker, not a behaviour"
        assert f"`{module.stem}`" in the_map or module.stem.startswith(("test_lightning", "test_hf_")), \
            f"{rel}: missing from tests/README.md's map"
