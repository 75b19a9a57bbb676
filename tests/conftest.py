"""Shared helpers: small checkpoints, the independent seed reader/writer, a CLI runner."""
from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptfmt

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
# An internal error keeps its traceback under test (cli/output.py): the CLI contract tests look
# for tracebacks, and a defect must fail them rather than hide behind the one-line safety net.
os.environ["CKPTFMT_DEBUG"] = "1"


def seed_read(path):
    """The independent 10-line reader of spec Appendix B."""
    data = open(path, "rb").read()
    step, n = struct.unpack("<ii", data[:8])
    assert n >= 0 and len(data) == 8 + 12 * n
    f = np.frombuffer(data, dtype="<f4", offset=8)
    return step, f[:n], f[n:2 * n], f[2 * n:]


def seed_write(path, step, w, m, v):
    """The independent writer from the byte table (no manifest, no ckptfmt)."""
    with open(path, "wb") as f:
        f.write(struct.pack("<ii", step, len(w)))
        for a in (w, m, v):
            f.write(np.asarray(a, dtype="<f4").tobytes())


def arrays(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n).astype("<f4")
    m = (rng.standard_normal(n) * 1e-3).astype("<f4")
    v = (rng.random(n) * 1e-6).astype("<f4")
    return w, m, v


def make(directory, step: int, n: int = 100, seed: int = 0, **kwargs) -> Path:
    path = Path(directory) / f"step_{step:06d}.bin"
    ckptfmt.save(path, step, *arrays(n, seed), **kwargs)
    return path


def commit_rewritten(path, doc) -> None:
    """Write ``doc`` as the manifest ``path`` the way another writer (another device, release or
    commit time) commits it: sealed, then named by a checkpoint event with its root digest in
    the run's history, as that writer records it (spec/RUN.md §3.7). A manifest edited without
    the event is a generation the run did not commit."""
    from ckptfmt import format as fmt
    from ckptfmt import manifest as mf
    from ckptfmt.run import roots
    mf.write(path, doc)
    roots.record(Path(path).parent, "checkpoint", fmt.parse_name(Path(path).name)[0])


def without_root_digests(run) -> None:
    """The run's history as a writer before root digests wrote it: its events without ``root``."""
    import json
    path = Path(run) / ".loss.json"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "root"}, separators=(",", ":")) + "\n"
                            for r in lines))


def last_step(run: Path) -> int:
    """The newest step recorded in a run's .loss.json (0 before the first; a torn line is skipped)."""
    import json
    try:
        lines = (Path(run) / ".loss.json").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(x)["step"] for x in lines if '"loss"' in x and x.endswith("}")), default=0)


# Commands that read and write files only: run in this process through click's CliRunner (a
# fresh interpreter costs a second of imports). The rest start a process of their own: train and
# verify-resume run trainers and take signals; mirror and import talk to object storage on
# threads of their own.
IN_PROCESS = frozenset({"inspect", "validate", "diff", "convert", "ls", "gc", "ram", "pin", "pivot", "fork",
                        "bisect", "plot", "export"})


def cli(*args: str, cwd=None, env=None, timeout=300, process: bool = False) -> subprocess.CompletedProcess:
    """Run a ckptfmt command line: the file commands in this process (click's CliRunner, with the
    console's exit code, stdout and stderr, warnings on stderr and an internal error's traceback),
    the others, or any with ``process=True``, through the real entry point in a fresh process."""
    if process or not args or args[0] not in IN_PROCESS:
        return subprocess.run([PY, "-m", "ckptfmt.cli", *args], capture_output=True, text=True,
                              cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout)
    return cli_in_process(args, cwd, env)


# The console script's main where ``import torch`` fails: what a user without the torch extra gets.
BLOCKED = "import sys; sys.modules['torch'] = None; from ckptfmt.cli import main; sys.argv = ['ckptfmt', *sys.argv[1:]]; main()"


def without_torch(*args: str) -> subprocess.CompletedProcess:
    """A ckptfmt command line in a fresh process where ``import torch`` fails."""
    return subprocess.run([PY, "-c", BLOCKED, *map(str, args)], capture_output=True, text=True, timeout=300)


def _warning_on_stderr(message, category, filename, lineno, file=None, line=None):
    import warnings
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def cli_in_process(args, cwd=None, env=None) -> subprocess.CompletedProcess:
    """``ckptfmt ARGS`` through click's CliRunner in this process, as the console would end it."""
    args = list(map(str, args))
    import traceback
    import warnings

    from click.testing import CliRunner

    from ckptfmt.cli import main
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with warnings.catch_warnings():     # as a fresh interpreter shows them: once, on stderr
            warnings.resetwarnings()
            warnings.simplefilter("default")
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", PendingDeprecationWarning)
            warnings.simplefilter("ignore", ResourceWarning)   # as python does: an earlier test's garbage is not this command's
            warnings.showwarning = _warning_on_stderr
            result = CliRunner().invoke(main, args, env=env, prog_name="ckptfmt")
    finally:
        os.chdir(here)
    stderr = result.stderr
    if result.exc_info is not None and not issubclass(result.exc_info[0], SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))   # what the console prints
    return subprocess.CompletedProcess(["ckptfmt", *args], result.exit_code, result.stdout, stderr)


@pytest.fixture
def runner():
    from click.testing import CliRunner
    return CliRunner()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "64k"):
    """A tmpfs of ``size`` mounted at ``path`` (made here) for a full-disk test (root mounts
    it, as the read-only fixture does); unmounted after."""
    path.mkdir()
    assert subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode == 0, \
        "this test needs a full file system (root: mount -t tmpfs)"
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


# ------------------------------------------------ what the children said, shown when a test fails
# Every subprocess a test waits on through communicate() (subprocess.run, cli(), the library's own
# runs) is remembered with its exit code and output; a failing test's report ends with them, so a
# bare `assert 1 == 0` on a return code still shows why the child failed.
_children: list = []
_communicate = subprocess.Popen.communicate


def _remembering_communicate(self, *args, **kwargs):
    try:
        out, err = _communicate(self, *args, **kwargs)
    except subprocess.TimeoutExpired as exc:
        _children.append((self.args, "timed out", exc.output, exc.stderr))
        raise
    _children.append((self.args, self.returncode, out, err))
    return out, err


subprocess.Popen.communicate = _remembering_communicate


def _tail(data, lines: int = 25) -> str:
    if data is None:
        return ""
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    return "\n".join(text.rstrip().splitlines()[-lines:])


def pytest_runtest_logstart(nodeid, location):
    _children.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _children:
        parts = []
        for argv, code, out, err in _children[-6:]:
            command = " ".join(map(str, argv)) if isinstance(argv, (list, tuple)) else str(argv)
            parts.append(f"$ {command[:300]}\nexit: {code}\n--- stderr (tail)\n{_tail(err)}"
                         f"\n--- stdout (tail)\n{_tail(out, 10)}")
        report.sections.append(("child processes (the last 6 this test waited on)", "\n\n".join(parts)))



@pytest.fixture(autouse=True)
def signal_handlers_put_back():
    """Each test leaves SIGTERM, SIGINT and SIGUSR1 with the handlers it found: a loop tested in
    this process that ends without giving its handlers back (a failed fit, a test stopped by its
    own assertion) must not decide what a later test's signal does; the handlers, held weakly,
    pass a signal whose owner is gone on to the default action, which ends the worker."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    found = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for sig, handler in found.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
