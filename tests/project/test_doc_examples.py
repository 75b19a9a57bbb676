"""The examples of the README and the docs site run as written: every ```python and ```bash block
of a page, in order, in one fresh empty directory per page (a page's later blocks build on its
earlier ones, as a reader's terminal does), with nothing defined for them that the page does not
show. Python blocks share one namespace per page; shell blocks run under ``bash -e`` with the
venv's ``bin`` first on PATH (``ckptfmt``, ``python``), the variables one block exports seen by
the next and by the Python blocks after it.

What a page says about a block, in an HTML comment on the line above it (unseen on the site):

- ``<!-- not run: WHY; twin: tests/DIR/test_X.py::test_name -->``: a block CI cannot run as it
  is (the whole suite, a GPU, several nodes); the twin is the test that runs its equivalent.
- ``<!-- exits N -->``: the block ends with a command that exits N (a diff that finds a
  difference: 1), which is what the page says it does.
- ``<!-- output -->`` above a block without a language (or ``text``) that follows a block that
  runs: it is what that block prints (stdout and stderr as a terminal interleaves them, a
  warning as ``FILE:LINE: Category: message``), line for line. ``<!-- output: lines -->``: each
  of its lines is printed, in this order, other lines may come between and around them. In
  both, trailing spaces and trailing blank lines do not count, a line ``...`` stands for any run
  of lines (none included), and ``…`` or ``<...>`` inside a line for any text (a timing, an
  age, a temporary path, a PID). Nothing else is a pattern. An output block without the note is
  not checked: one after a block not run, or an illustration the page makes up.

A Python block the paragraph above it tells the reader to save (Save this as `loop.py`) is
written to that file, not run: a later shell block runs it. A page whose blocks run the
checkout's ``examples/`` finds a copy of them in its directory, as in a checkout. A page that
points ``s3://`` at the endpoint ``http://localhost:9000`` gets the local S3 server
(tests/s3server.py) there."""
from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SHELLS = {"bash", "sh", "shell", "console"}
ENDPOINT = "http://localhost:9000"          # the S3 endpoint a page shows; the local server's instead
NOT_RUN = re.compile(r"not run: (?P<why>[^;]+); twin: (?P<twin>\S+)")
EXITS = re.compile(r"exits (?P<code>\d+)")
SAVE_AS = re.compile(r"[Ss]ave (?:this|it) as `(?P<name>[^`]+)`")
OUTPUT = re.compile(r"output(?P<lines>: lines)?")
ANY_LINES = "..."                           # a shown line standing for any run of printed lines
ANY_TEXT = re.compile(r"…|<\.\.\.>")        # within a shown line: any text


@dataclass
class Block:
    """One fenced block of a page: its language, code, the page's line its code starts on, the
    comment right above it and the file the paragraph above it says to save it as."""
    lang: str
    code: str
    line: int
    note: str = ""
    save_as: str = ""

    @property
    def runs(self) -> bool:
        return self.lang in SHELLS | {"python"} and not self.note.startswith("not run")

    @property
    def shown_output(self) -> bool:
        return self.lang in ("", "text") and OUTPUT.fullmatch(self.note) is not None


def line_matches(shown: str, printed: str) -> bool:
    """``printed`` is the shown line, its ``…`` and ``<...>`` standing for any text."""
    pattern = ".*".join(re.escape(part) for part in ANY_TEXT.split(shown.rstrip()))
    return re.fullmatch(pattern, printed.rstrip(), re.S) is not None


def first_unmatched(shown: str, printed: str, in_order: bool) -> int | None:
    """The index of the first line of ``shown`` that ``printed`` cannot match (the number of
    shown lines: printed goes on after them), or None when it matches: line for line, or with
    ``in_order`` each shown line somewhere after the one before. A ``...`` line matches any run
    of lines. The printed positions each shown line can end at are kept (a set), so a ``...``
    that swallows too much or too little is never a wrong guess."""
    want, got = shown.rstrip().splitlines(), printed.rstrip().splitlines()
    reach = {0}                             # printed lines consumed so far, per way of matching
    for i, line in enumerate(want):
        if in_order or line.strip() == ANY_LINES:
            reach = set(range(min(reach), len(got) + 1))
        if line.strip() != ANY_LINES:
            reach = {j + 1 for j in reach if j < len(got) and line_matches(line, got[j])}
        if not reach:
            return i
    return None if in_order or len(got) in reach else len(want)


def output_mismatch(shown: Block, printed: str, name: str) -> str:
    """Nothing when the page's shown output is what the block above it printed; else why not,
    naming the page's line of the first shown line not printed."""
    i = first_unmatched(shown.code, printed, in_order=bool(OUTPUT.fullmatch(shown.note).group("lines")))
    if i is None:
        return ""
    want = shown.code.rstrip().splitlines()
    why = f"not printed: {want[i]!r}" if i < len(want) else "the block printed more after it"
    return (f"{name}:{shown.line + i}: the shown output is not what the block above printed; "
            f"{why}\n--- shown:\n{shown.code}--- printed:\n{printed}")


def page_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown page, each with what the page says about it."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        indent = len(fence.group(1))
        code = "".join(line[indent:] + "\n" for line in lines[i + 1:end])
        above = lines[:i]
        while above and not above[-1].strip():
            above.pop()
        note = ""
        if above and re.fullmatch(r"\s*<!--(.*)-->\s*", above[-1]):
            note = re.fullmatch(r"\s*<!--(.*)-->\s*", above.pop()).group(1).strip()
        paragraph = []
        while above and above[-1].strip() and not above[-1].startswith("```"):
            paragraph.insert(0, above.pop())
        save = SAVE_AS.search(" ".join(paragraph))
        blocks.append(Block(fence.group(2), code, i + 2, note, save.group("name") if save else ""))
        i = end + 1
    return blocks


def pages() -> list[Path]:
    """The README and every page of the site but the benchmark pages (rendered from results)."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "benchmarks" not in p.relative_to(ROOT / "docs").parts)
    return [ROOT / "README.md", *docs]


RUNNABLE = [p for p in pages() if any(b.runs for b in page_blocks(p.read_text()))]


def shell_env(page_env: dict[str, str]) -> dict[str, str]:
    """What a reader's terminal has: the venv's bin first on PATH and this checkout's ckptfmt
    importable (its install), no AWS settings but those the page exported, and the page's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(PATH=f"{BIN}{os.pathsep}{env['PATH']}", PYTHONUNBUFFERED="1",   # printed when printed
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return {**env, **page_env}


def run_shell(block: Block, where: Path, state: Path, page_env: dict[str, str], name: str) -> tuple[dict[str, str], str]:
    """``block`` under ``bash -e`` in ``where``; its exit status checked against the page's note;
    what the shell exported when it ended (the next block's environment) and what it printed."""
    code = block.code
    if block.lang == "console":             # "$ command" lines run; the rest is their output
        code = "".join(line[2:] + "\n" for line in code.splitlines() if line.startswith("$ "))
    script = f"trap 'env -0 > {state}' EXIT\n{code}"
    started = time.monotonic()
    proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=where, env=shell_env(page_env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)     # whatever the block left in the background
        except ProcessLookupError:
            pass
    seconds = time.monotonic() - started
    print(f"--- {name}:{block.line} exit {proc.returncode} in {seconds:.1f} s\n{out}")   # shown when the page fails
    said = EXITS.fullmatch(block.note)
    expected = int(said.group("code")) if said else 0
    assert proc.returncode == expected, f"{name}:{block.line}: exit {proc.returncode}, not {expected}\n{block.code}\n{out}"
    pairs = dict(item.split("=", 1) for item in state.read_text().split("\0") if "=" in item)
    base = shell_env({})
    exported = {k: v for k, v in pairs.items() if base.get(k) != v and k not in ("PWD", "OLDPWD", "SHLVL", "_")}
    return exported, out


def run_python(block: Block, namespace: dict, name: str) -> str:
    """``block`` in the page's namespace; what it printed, its warnings as a reader's session
    shows them (each once per place, ``FILE:LINE: Category: message``) among its prints."""
    code = "\n" * (block.line - 1) + block.code        # a traceback names the page's line
    printed = io.StringIO()

    def show(message, category, filename, lineno, file=None, line=None):
        # Python's own format, whatever warnings.formatwarning a test before this one left set
        printed.write(f"{filename}:{lineno}: {category.__name__}: {message}\n")

    started = time.monotonic()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed), warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = show
            exec(compile(code, name, "exec"), namespace)
    finally:
        print(f"--- {name}:{block.line} (Python) in {time.monotonic() - started:.1f} s\n{printed.getvalue()}")
    return printed.getvalue()


def run_page(page: Path, where: Path, state: Path, monkeypatch, endpoint: str = "") -> None:
    """Every block of ``page`` in order in ``where``: Python in one namespace, shell in bash; each
    shown output the page marks compared with what the block above it printed."""
    name = str(page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name)
    namespace: dict = {"__name__": "__main__"}
    page_env: dict[str, str] = {}
    monkeypatch.chdir(where)
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    printed, mismatches = "", []            # what the last block that ran printed
    for block in page_blocks(page.read_text()):
        if block.shown_output:
            mismatches.append(output_mismatch(block, printed, name))
        if not block.runs:
            continue
        if endpoint:
            block.code = block.code.replace(ENDPOINT, endpoint)
        if block.lang == "python" and block.save_as:
            (where / block.save_as).write_text(block.code)
            printed = ""
        elif block.lang == "python":
            for key, value in page_env.items():
                monkeypatch.setenv(key, value)
            printed = run_python(block, namespace, name)
        else:
            page_env, printed = run_shell(block, where, state, page_env, name)
    assert not any(mismatches), "\n".join(filter(None, mismatches))   # all of the page's at once


@pytest.mark.timeout(240)
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_pages_blocks_run_as_written_in_an_empty_directory(page, tmp_path, monkeypatch):
    """Every block of the page, in order, in a fresh empty directory, with the local S3 server
    behind the endpoint the page exports where it shows one."""
    where = tmp_path / "page"
    where.mkdir()
    if any("examples/" in b.code for b in page_blocks(page.read_text()) if b.runs):
        shutil.copytree(ROOT / "examples", where / "examples")    # run from a checkout, as the page says
    if ENDPOINT not in page.read_text():
        run_page(page, where, tmp_path / "exported.env", monkeypatch)
        return
    from s3server import S3Server
    with S3Server() as s3:
        run_page(page, where, tmp_path / "exported.env", monkeypatch, s3.endpoint)


def test_a_block_not_run_says_why_and_names_a_twin_that_exists():
    """A block the pages mark as not run names why and its twin: a test file and, after ``::``,
    a test function in it (or the script CI runs); an output note is on an output block right
    after a block that runs (else it would check nothing); no note but these three is taken."""
    problems, marked = [], 0
    for page in pages():
        blocks = page_blocks(page.read_text())
        for before, block in zip([None, *blocks], blocks):
            where = f"{page.relative_to(ROOT)}:{block.line}"
            if OUTPUT.fullmatch(block.note) and not (block.shown_output and before and before.runs and not before.save_as):
                problems.append(f"{where}: an output note on a block with a language or after no block that runs")
            if not block.note or EXITS.fullmatch(block.note) or OUTPUT.fullmatch(block.note):
                continue
            found = NOT_RUN.fullmatch(block.note)
            if not found:
                problems.append(f"{where}: a note neither 'not run: WHY; twin: TEST', 'exits N' nor 'output': {block.note!r}")
                continue
            marked += 1
            path, _, test = found.group("twin").partition("::")
            if not path.startswith(("tests/", "scripts/")) or not (ROOT / path).is_file():
                problems.append(f"{where}: twin {path} is no test file nor script CI runs")
            elif test and not re.search(rf"^def {re.escape(test)}\(", (ROOT / path).read_text(), re.M):
                problems.append(f"{where}: {path} has no test {test}")
    assert not problems, "\n".join(problems)
    assert marked, "no block is marked as not run: the check above checked nothing"


def test_the_reader_finds_blocks_notes_and_files_to_save():
    """Not vacuous: the parser sees a page's blocks, the note above one and the file a paragraph
    says to save one as, and skips what is neither Python nor shell."""
    text = ("Save this as `loop.py` in an empty directory:\n\n```python\nprint(1)\n```\n\n"
            "<!-- exits 1 -->\n```bash\nckptfmt diff a b\n```\n\n```\nan output\n```\n\n"
            "<!-- not run: needs a GPU; twin: tests/x.py::test_y -->\n```bash\nnvidia-smi\n```\n")
    blocks = page_blocks(text)
    assert [(b.lang, b.save_as, b.note, b.runs) for b in blocks] == [
        ("python", "loop.py", "", True), ("bash", "", "exits 1", True), ("", "", "", False),
        ("bash", "", "not run: needs a GPU; twin: tests/x.py::test_y", False)]
    assert blocks[1].code == "ckptfmt diff a b\n" and blocks[0].line == 4
    assert not blocks[2].shown_output and page_blocks("<!-- output: lines -->\n```text\na\n```\n")[0].shown_output


SHOWN_PAGE = """```bash
printf 'saved step 10\\ntook 0.31 s\\nin /tmp/x1\\n\\ndone\\n'
```

<!-- output -->
```
saved step 10
took … s
...
done
```

```python
import warnings
print("a"); warnings.warn("careful"); print("b")
```

<!-- output: lines -->
```
a
<...>: UserWarning: careful
```
"""


@pytest.mark.parametrize("wrong, line", [("saved step 10", 7), ("done", 10), ("<...>: UserWarning: careful", 21)],
                         ids=["a-shell-line", "a-line-after-dots", "a-python-warning"])
def test_a_shown_output_that_is_not_what_the_block_printed_fails_naming_the_pages_line(tmp_path, monkeypatch, wrong, line):
    """Not vacuous: the page above passes as it is (a shell block's lines, ``…`` for a timing,
    ``...`` for a path and a blank line; a Python block's prints and warning among them), and
    one shown line made wrong fails the page, naming the page and that line."""
    where = tmp_path / "page"
    where.mkdir()
    page = tmp_path / "page.md"
    page.write_text(SHOWN_PAGE)
    run_page(page, where, tmp_path / "exported.env", monkeypatch)
    page.write_text(SHOWN_PAGE.replace(f"\n{wrong}\n", f"\n{wrong}!\n", 1))
    with pytest.raises(AssertionError, match=rf"^page.md:{line}: the shown output is not what the block above printed"):
        run_page(page, where, tmp_path / "exported.env", monkeypatch)


def test_the_output_patterns_are_a_line_of_dots_and_an_ellipsis_within_a_line():
    """``...`` alone is any run of lines (none too); ``…`` and ``<...>`` any text within one line,
    never a line break; ``...`` inside a line is itself; exact mode refuses lines printed after
    the shown ones, ``lines`` mode skips lines anywhere but keeps the order."""
    printed = "one\ntwo 0.25 s\nthree\n"
    assert first_unmatched("one\n...\ntwo … s\nthree", printed, in_order=False) is None
    assert first_unmatched("one\n...\nthree", printed, in_order=False) is None
    assert first_unmatched("one…three", printed, in_order=False) == 0
    assert first_unmatched("one\ntwo ... s\nthree", printed, in_order=False) == 1
    assert first_unmatched("one\ntwo <...>", printed, in_order=False) == 2
    assert first_unmatched("two <...>\nthree", printed, in_order=True) is None
    assert first_unmatched("three\none", printed, in_order=True) == 1
