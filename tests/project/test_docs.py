"""Docs that run: every docstring example in the library, the public API's docstrings, the
README's example, and the docs site: its strict build, and a nav that reaches every command and
public name."""
from __future__ import annotations

import doctest
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import zlib
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


def test_the_examples_exist(tmp_path, monkeypatch):
    """Not vacuous: the examples that document the core are found and run (in an empty
    directory: they write the files they show)."""
    monkeypatch.chdir(tmp_path)
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


def test_the_readmes_example_runs_as_written_in_an_empty_directory_and_resumes(tmp_path, monkeypatch, capsys):
    """The README's one example, pasted into an empty directory as it is: a run of 50 steps, the
    last three generations kept and verified; run again, it says it resumes at its last step (as
    the README shows) and leaves every generation as it was."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## A first example\n.*?```python\n(.*?)```", text, re.S)
    assert block, "README has no first example"
    monkeypatch.chdir(tmp_path)
    code = compile(block.group(1), "README.md", "exec")
    exec(code, {"__name__": "__main__"})
    assert "starting after step 0\n" in capsys.readouterr().out
    run = tmp_path / "runs" / "demo"
    assert sorted(p.name for p in run.glob("step_*.bin")) == [f"step_0000{s}.bin" for s in (30, 40, 50)]
    assert ckptfmt.validate(run).ok
    before = {p.name: p.read_bytes() for p in run.glob("step_*")}
    exec(code, {"__name__": "__main__"})
    assert "starting after step 50\n" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in run.glob("step_*")} == before


def build_site(site: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of ``config`` into ``site``, with this checkout's ckptfmt. Never
    ``--quiet``: it drops the warnings before strict mode counts them, and a broken link passes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "-d", str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)


def inventory(site: Path) -> set[str]:
    """The names the API pages document: mkdocstrings' ``objects.inv`` (Sphinx's format: four
    header lines, then zlib)."""
    body = (site / "objects.inv").read_bytes().split(b"\n", 4)[4]
    return {line.split(" ")[0] for line in zlib.decompress(body).decode().splitlines()}


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    items = nav.values() if isinstance(nav, dict) else nav
    return [page for item in items for page in nav_pages(item)]


@pytest.mark.timeout(300)               # one strict build: ~15 s alone, more beside the suite
def test_the_site_builds_strictly_and_its_nav_reaches_every_command_and_public_name(tmp_path):
    """The docs site builds with ``--strict`` (a broken link, a missing anchor, a section
    reference that names no section, a page outside the nav, a docstring mkdocstrings cannot
    read: each fails it); every CLI command has its page in the nav, and every public class and
    function of the public modules is on an API page."""
    import yaml
    from ckptfmt.cli import main
    proc = build_site(tmp_path / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    texts = "\n".join((ROOT / "docs" / page).read_text() for page in nav)
    missing = [name for name in main.commands if f":prog_name: ckptfmt {name}\n" not in texts]
    assert not missing, f"CLI commands without a page in the nav: {missing}"
    documented = inventory(tmp_path / "site")
    missing = []
    for name in PUBLIC:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", []):
            obj = vars(module).get(attr)      # None: imported lazily (Lightning's, transformers' classes)
            if obj is not None and not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if f"{name}.{attr}" in documented or (obj is not None and f"{obj.__module__}.{attr}" in documented):
                continue
            if obj is None and any(d.startswith(f"{name}.") and d.endswith(f".{attr}") for d in documented):
                continue
            missing.append(f"{name}.{attr}")
    assert not missing, f"public names on no API page: {missing}"


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """Not vacuous: the site's own settings (its validation, its hook) turn a link to a page that
    does not exist, an anchor that does not exist and a section reference to no section into
    failures of the build, each named."""
    import yaml
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    (docs / "reference").mkdir(parents=True)
    (docs / "index.md").write_text("# Home\n\n[a page](nowhere.md), [a heading](reference/run-directory.md#nothing), RUN §99.9\n")
    (docs / "reference" / "run-directory.md").write_text("# The run directory\n\n<!-- spec: RUN -->\n")
    config.update(docs_dir=str(docs), nav=["index.md", "reference/run-directory.md"],
                  hooks=[str(ROOT / "scripts" / "docs_hooks.py")],
                  plugins=["search"], markdown_extensions=[e for e in config["markdown_extensions"]
                                                           if e != "mkdocs-click"])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    proc = build_site(tmp_path / "site", tmp_path / "mkdocs.yml")
    assert proc.returncode != 0
    for problem in ("'nowhere.md', but the target is not found", "does not contain an anchor '#nothing'",
                    "does not contain an anchor '#sec-99.9'"):
        assert problem in proc.stderr, proc.stderr


# The result dataclasses the reference shows: each field's meaning in the class's Attributes.
RESULTS = ["ckptfmt.writer.SaveResult", "ckptfmt.tools.report.Report", "ckptfmt.tools.report.Finding",
           "ckptfmt.tools.diff.DiffResult", "ckptfmt.tools.diff.RegionDiff", "ckptfmt.tools.convert.source.ConvertReport",
           "ckptfmt.tools.stats.RegionStats", "ckptfmt.generation.Generation", "ckptfmt.generation.Listing"]


def resolve(dotted: str):
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def module_members(module) -> list[str]:
    """What mkdocstrings shows of a module (filter ``!^_``): the classes and functions it
    defines, and the ones it imports from ckptfmt where it has no ``__all__``, else those
    ``__all__`` names."""
    public = {k: v for k, v in vars(module).items() if not k.startswith("_") and
              (inspect.isclass(v) or inspect.isfunction(v)) and v.__module__.startswith("ckptfmt")}
    exported = getattr(module, "__all__", None)
    if exported is None:
        return list(public)
    return list(exported) + [k for k, v in public.items() if v.__module__ == module.__name__ and k not in exported]


def reference_entries() -> list[tuple[str, str]]:
    """Each ``::: NAME`` entry of the API reference pages: (NAME, its options' text)."""
    return [(entry.group(1), entry.group(2)) for page in sorted((ROOT / "docs" / "reference" / "api").glob("*.md"))
            for entry in re.finditer(r"^::: (\S+)\n((?:    .*\n)*)", page.read_text(), re.M)]


def reference_names() -> dict[str, object]:
    """The classes and functions the API reference pages show: each ``::: NAME`` entry's object,
    and for a module the ``members:`` the entry lists, else its members as mkdocstrings shows them."""
    names = {}
    for name, options in reference_entries():
        obj = resolve(name)
        if not inspect.ismodule(obj):
            names[name] = obj
            continue
        listed = re.search(r"members: \[(.*)\]", options)
        members = [m.strip() for m in listed.group(1).split(",")] if listed else module_members(obj)
        names.update({f"{obj.__name__}.{m}": getattr(obj, m) for m in members})
    return {k: v for k, v in names.items() if inspect.isclass(v) or inspect.isfunction(v)}


def examples_section(doc: str | None) -> str:
    """A docstring's ``Examples:`` section: from that heading to its end ("" without one)."""
    found = re.search(r"^Examples:[ \t]*\n(.*)", doc or "", re.M | re.S)
    return found.group(1) if found else ""


def has_example(doc: str | None) -> bool:
    """An ``Examples:`` section holding a doctest (``>>>``) or a code block; a doctest outside
    that section does not count: the site renders it as a quote, not as code."""
    section = examples_section(doc)
    return ">>>" in section or "```" in section


def bare_doctest(doc: str | None) -> bool:
    """A ``>>>`` line before any ``Examples:`` heading."""
    head = (doc or "").split("\nExamples:", 1)[0]
    return any(line.lstrip().startswith(">>>") for line in head.splitlines())


def documented_fields(doc: str) -> set[str]:
    """The names an ``Attributes:`` section (Google style: ``name: what``, ``name (type): what``) explains."""
    section = re.search(r"^Attributes:\s*\n((?:[ \t]+.*\n|\s*\n)*)", doc + "\n", re.M)
    if not section:
        return set()
    indent = min(len(line) - len(line.lstrip()) for line in section.group(1).splitlines() if line.strip())
    return {m.group(1) for line in section.group(1).splitlines()
            if (m := re.match(rf"^ {{{indent}}}(\w+)(?: \(.*?\))?:", line))}


def test_every_name_the_reference_shows_says_what_it_does_with_an_example():
    """Each class and function on an API page has a docstring with a runnable example: a
    doctest (run by the test above) or an Example code block."""
    names = reference_names()
    assert {"ckptfmt.save", "ckptfmt.torch.CheckpointManager", "ckptfmt.tools.diff.diff"} <= set(names)
    missing = [name for name, obj in names.items() if not has_example(inspect.getdoc(obj))]
    assert not missing, f"no example in the docstring of {len(missing)}: {missing}"
    modules = [(name, obj) for name, _ in reference_entries() if inspect.ismodule(obj := resolve(name))]
    quoted = [name for name, obj in [*names.items(), *modules] if bare_doctest(inspect.getdoc(obj))]
    assert not quoted, f"a doctest outside an Examples section (rendered as a quote): {quoted}"


def test_the_result_dataclasses_say_what_each_field_means():
    import dataclasses
    missing = []
    for name in RESULTS:
        cls = resolve(name)
        fields = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        missing += [f"{name}.{f}" for f in sorted(fields - documented_fields(inspect.getdoc(cls) or ""))]
    assert not missing, f"fields no Attributes section explains: {missing}"


def test_the_docstring_checks_read_examples_and_attributes():
    """Not vacuous: what counts as an example and as a field explained, on made-up docstrings."""
    assert has_example("Add.\n\nExamples:\n    >>> 1 + 1\n    2")
    assert has_example("Add.\n\nExamples:\n    Two numbers:\n\n    ```python\n    add(1, 2)\n    ```")
    assert not has_example("Add two numbers.") and not has_example("Examples:\n    add(1)")
    assert not has_example("Add.\n\n>>> 1 + 1\n2") and bare_doctest("Add.\n\n>>> 1 + 1\n2")
    assert not bare_doctest("Add.\n\nExamples:\n    >>> 1 + 1\n    2")
    doc = "A result.\n\nAttributes:\n    path: where.\n    size (int): how big,\n        in bytes.\n\nMore."
    assert documented_fields(doc) == {"path", "size"} and documented_fields("A result.") == set()


def test_every_error_class_says_what_to_do():
    """Each class of ``ckptfmt.errors`` has its "What to do:" paragraph, the column the
    exit-codes page's table shows (scripts/docs_hooks.py builds it from the docstrings)."""
    from ckptfmt import errors
    missing = [name for name in errors.__all__ if not any(
        p.startswith("What to do: ") for p in (inspect.getdoc(getattr(errors, name)) or "").split("\n\n"))]
    assert not missing, f"error classes without a 'What to do:' paragraph: {missing}"
