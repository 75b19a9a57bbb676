"""Ctrl-C and the other signals as users expect them: a file command interrupted is not a
defect (exit 130), a manager built outside the main thread works without signals, a second
Ctrl-C (or one after the manager is closed or gone) does what it did before the manager, and a
checkpoint event names the signal that asked for it."""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ckptfmt.cli.output import error_doc
from ckptfmt.torch import CheckpointManager
from conftest import make
from models import tiny_adamw


@pytest.fixture
def python_sigint():
    """SIGINT as a plain Python process has it (a test worker may ignore it), put back after."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def blocked_on(fifo: str, proc: subprocess.Popen, deadline_s: float = 120) -> int:
    """Wait until ``proc`` has the FIFO open, hold its write end, and wait until ``proc`` sleeps
    in the pipe's read: a SIGINT sent in the instants between its open and its read can land in
    a finalizer the interpreter runs there, which swallows the KeyboardInterrupt, and the
    command would then wait on the FIFO for ever."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            held = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert proc.poll() is None, f"the command ended before it opened the FIFO: {proc.communicate()}"
            assert time.monotonic() < deadline, "the command never opened the FIFO"
            time.sleep(0.02)
    while "pipe" not in (where := sleeping_in(proc.pid)) and where != "unknown":
        assert proc.poll() is None, f"the command ended before it read the FIFO: {proc.communicate()}"
        assert time.monotonic() < deadline, f"the command never read the FIFO (it sleeps in {where})"
        time.sleep(0.01)
    return held


def sleeping_in(pid: int) -> str:
    """The kernel function process ``pid`` sleeps in (``anon_pipe_read``, ``pipe_read``,
    ``wait_for_partner`` in a FIFO's open; "0" while it runs), or "unknown" where the kernel
    keeps no such file."""
    try:
        return open(f"/proc/{pid}/wchan").read().strip() or "0"
    except OSError:
        return "unknown"


def ctrl_c_once_blocked(argv: list[str], fifo: str) -> tuple[subprocess.Popen, str, str]:
    """Run ``argv``, send it SIGINT once it is blocked reading ``fifo``; (process, stdout, stderr).
    A command that does not end is shown with what it printed once the FIFO is let go."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held = blocked_on(fifo, proc)
    try:
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.close(held)
        held = None
        proc.kill()
        pytest.fail(f"the command did not end after SIGINT; it said: {proc.communicate()}")
    finally:
        if held is not None:
            os.close(held)
        proc.kill()
    return proc, stdout, stderr


HELD_WRITE = """
import sys, ckptfmt_console
from ckptfmt import fsio
fifo = sys.argv[1]
def held(op, path):               # the conversion's first write waits on a FIFO: a Ctrl-C lands mid-save
    if op == "write":
        fsio.hook = None
        open(fifo, "rb").read()
fsio.hook = held
sys.argv = ["ckptfmt", *sys.argv[2:]]
sys.exit(ckptfmt_console.main())
"""


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_during_a_conversion_exits_130_in_one_line_and_leaves_nothing(tmp_path, as_json, python_sigint):
    # python_sigint: a child started while SIGINT is ignored (a background job of a
    # non-interactive shell, as CI runs) inherits SIG_IGN and rightly never sees the Ctrl-C
    (tmp_path / "src").mkdir()
    src = make(tmp_path / "src", 1)
    fifo, out = str(tmp_path / "held"), tmp_path / "step_000001.bin"
    os.mkfifo(fifo)
    argv = [sys.executable, "-c", HELD_WRITE, fifo, "convert", str(src), str(out), *(["--json"] if as_json else [])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held = blocked_on(fifo, proc)
    try:
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckptfmt-tmp")]   # the save is under way
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        os.close(held)
        proc.kill()
    assert proc.returncode == 130, stderr
    assert stderr == "ckptfmt: interrupted (Ctrl-C)\n"
    if as_json:
        assert json.loads(stdout)["error"] == {"type": "Interrupted", "message": "interrupted (Ctrl-C)",
                                               "path": None, "exit_code": 130}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held", "src"]      # no destination, no temp file


HELD_IMPORT = """
import sys, ckptfmt_console
fifo = sys.argv[1]
class Held:                       # the CLI's import waits on a FIFO: a Ctrl-C lands mid-import
    def find_spec(self, name, path=None, target=None):
        if name == "ckptfmt.cli.files":
            open(fifo, "rb").read()
sys.meta_path.insert(0, Held())
sys.argv = ["ckptfmt", *sys.argv[2:]]
sys.exit(ckptfmt_console.main())
"""


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_while_the_command_line_imports_is_one_line_and_exit_130(tmp_path, as_json, python_sigint):
    fifo = str(tmp_path / "held")
    os.mkfifo(fifo)
    argv = [sys.executable, "-c", HELD_IMPORT, fifo, *(["--json"] if as_json else []), "inspect", fifo]
    proc, stdout, stderr = ctrl_c_once_blocked(argv, fifo)
    assert (proc.returncode, stderr) == (130, "ckptfmt: interrupted (Ctrl-C)\n")
    if as_json:
        assert json.loads(stdout) == error_doc("interrupted (Ctrl-C)", 130, "Interrupted", None)
    else:
        assert stdout == ""


def test_importing_ckptfmt_leaves_the_programs_signals_alone():
    code = ("import signal; before = {s: signal.getsignal(s) for s in signal.valid_signals()}; "
            "import ckptfmt, ckptfmt.cli, ckptfmt.torch; "
            "assert {s: signal.getsignal(s) for s in signal.valid_signals()} == before")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_a_manager_built_in_a_worker_thread_runs_without_signals_and_says_so(tmp_path):
    said, result = [], {}

    def work():
        model, opt = tiny_adamw()
        with CheckpointManager(tmp_path / "run", model, opt, every=1, keep_last=None, log=said.append) as mgr:
            result["start"] = mgr.restore()
            result["stop"] = mgr.step(1, loss=1.0)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert result == {"start": 0, "stop": False}
    assert (tmp_path / "run" / "step_000001.json").exists()
    assert [m for m in said if "signals are not handled" in m] and \
        "outside the main thread" in said[0], said


def test_a_second_ctrl_c_after_a_stop_was_requested_raises_keyboard_interrupt(tmp_path, python_sigint, capsys):
    model, opt = tiny_adamw()
    with CheckpointManager(tmp_path / "run", model, opt, every=None, keep_last=None) as mgr:
        mgr.restore()
        os.kill(os.getpid(), signal.SIGINT)          # the first asks for a stop, and says so
        assert mgr.step(1, loss=1.0) is True
        said = capsys.readouterr().err
        assert said == (f"ckptfmt: Ctrl-C: the checkpoint manager of {tmp_path / 'run'} commits at its next "
                        "step() and stops the loop; Ctrl-C again interrupts at once\n"), said
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)      # the loop went on regardless: Ctrl-C forces
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_after_a_manager_was_dropped_unclosed_raises_keyboard_interrupt(tmp_path, python_sigint):
    model, opt = tiny_adamw()
    mgr = CheckpointManager(tmp_path / "run", model, opt, every=None, keep_last=None)
    mgr.restore()
    del mgr
    gc.collect()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    model, opt = tiny_adamw()
    with CheckpointManager(tmp_path / "run", model, opt, every=None, keep_last=None) as again:
        assert again.restore() == 0                  # its lock went with it


def test_the_checkpoint_event_names_the_signal_that_asked_for_it(tmp_path, python_sigint):
    model, opt = tiny_adamw()
    with CheckpointManager(tmp_path / "run", model, opt, every=None, keep_last=None) as mgr:
        mgr.restore()
        os.kill(os.getpid(), signal.SIGINT)
        assert mgr.step(1, loss=1.0) is True
    events = [json.loads(line) for line in (tmp_path / "run" / ".loss.json").read_text().splitlines()]
    assert [e.get("reason") for e in events if e.get("event") == "checkpoint"] == ["SIGINT"]
