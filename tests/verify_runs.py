"""What the tests of verify-resume and of its trainers share.

``verify_resume(*args)``: ``ckptfmt verify-resume ARGS`` through click's CliRunner in this process,
its trainer runs forked from the warm parent (tests/warm.py) instead of cold interpreters: each is
still a process of its own (its own pid, exit code, output, real signals), started by the
protocol's own code (ckptfmt/verify/protocol.py), judged by its own verdict.

``once_per_session(tmp_path_factory, name, make)``: a module fixture's work done once per test
session, also when pytest-xdist spreads the module's tests over several workers (the first worker
to ask does it under a file lock; the others wait for the lock and read what it left).
``xdist_group`` would keep such tests on one worker, but with pytest 9.2 ``--dist loadgroup``
ignores the mark (pytest-dev/pytest-xdist#1386).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import types
from pathlib import Path
from typing import Any, Callable

import warm


class _WarmSubprocess(types.ModuleType):
    """``subprocess`` as the protocol sees it here: ``Popen`` forks from the warm parent (or
    starts cold when the argv is not one the warm server runs); everything else is subprocess's."""
    Popen = warm.Popen

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


@contextlib.contextmanager
def runs_from_the_warm_parent():
    from ckptfmt.verify import protocol
    saved, protocol.subprocess = protocol.subprocess, _WarmSubprocess("subprocess")
    try:
        yield
    finally:
        protocol.subprocess = saved


def verify_resume(*args: str) -> subprocess.CompletedProcess:
    """``ckptfmt verify-resume ARGS`` in this process (conftest's ``cli_in_process``): the console's
    exit code, stdout and stderr, an internal error's traceback on stderr."""
    from conftest import cli_in_process
    with runs_from_the_warm_parent():
        return cli_in_process(["verify-resume", *args])


def once_per_session(tmp_path_factory, name: str, make: Callable[[Path], Any]) -> tuple[Path, Any]:
    """``make(folder)`` run once in this session in a new ``folder``; (folder, what it returned,
    as JSON gives it back) to every caller, on every worker. A ``make`` that raised is tried
    again by the next caller."""
    base = tmp_path_factory.getbasetemp()
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    root = base.parent / f"once-{run}" if run else base / "once"      # one session's, all its workers'
    root.mkdir(exist_ok=True)
    folder, done = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # released when the file closes
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            done.write_text(json.dumps(make(folder)))
        return folder, json.loads(done.read_text())
