"""Launch plumbing for the tests that run torchrun jobs (gloo ranks on the CPU): the launcher
command, a job whose output goes to a file (read while it runs, shown when an assertion fails,
its whole process tree killed when a test ends early), the PID of a rank's worker, waits on
what a test can observe, and free ports for a rendezvous of several "nodes" on one machine."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]
TAIL = 4000

# A c10d rendezvous of several agents on one machine: a lost node is given up after 3 missed
# 1-second heartbeats (torchrun's default: 3 of 5 s, a 15 s wait before the survivor's new round
# can close), and a rendezvous that cannot complete fails in 2 minutes, not 10.
FAST_RDZV = "keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"


def standalone(nproc: int = 2, *options: str) -> list[str]:
    """torchrun on one node: it picks a free port itself, so parallel test workers never collide."""
    return [*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), *options]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent PID) of a process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def children(parent: int) -> list[int]:
    """The live (not zombie) child processes of ``parent``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(int(entry))
        if stat is not None and stat[1] == parent and stat[0] != "Z":
            found.append(int(entry))
    return found


def descendants(root: int) -> list[int]:
    """Every live process under ``root`` (children, theirs, ...)."""
    tree: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(int(entry))
        if stat is not None and stat[0] != "Z":
            tree.setdefault(stat[1], []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


def workers_of(agent: int, timeout: float = 60) -> list[int]:
    """The PIDs of a torchrun agent's workers (its children that run the script), waiting
    until it has started at least one."""
    deadline = time.monotonic() + timeout
    while True:
        found = [pid for pid in children(agent) if _rank_of(pid) is not None]
        if found:
            return found
        assert _stat(agent) is not None and time.monotonic() < deadline, f"no worker under torchrun agent {agent}"
        time.sleep(0.02)


def worker_of_rank(agent: int, rank: int, timeout: float = 60) -> int:
    """The PID of the worker of global ``rank`` under the torchrun agent ``agent`` (its child whose
    environment has ``RANK=rank``), waiting until that worker exists."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in children(agent):
            if _rank_of(pid) == rank:
                return pid
        assert _stat(agent) is not None and time.monotonic() < deadline, \
            f"no worker of rank {rank} under torchrun agent {agent}"
        time.sleep(0.02)


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every process under it (torchrun starts each worker in a session of
    its own: a process group kill of the agent does not reach them)."""
    for pid in [root, *descendants(root)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Job:
    """A command started in a session of its own, stdout and stderr into ``log`` (stdout into
    ``log`` + ``.out`` of its own with ``split``). Used as a context manager, a job still running
    at the end (a failed assertion, a test timeout) is killed with every process under it."""

    def __init__(self, argv: list[str], log: Path, *, env: dict[str, str] | None = None,
                 cwd: Path | str | None = None, split: bool = False):
        self.argv, self.log = [str(a) for a in argv], Path(log)
        self.out = self.log.with_name(self.log.name + ".out") if split else None
        with open(self.log, "ab") as err, open(self.out or os.devnull, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out if split else err, stderr=err, cwd=cwd,
                                         env={**os.environ, **(env or {})}, start_new_session=True)
        self.pid = self.proc.pid

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def tail(self, chars: int = TAIL) -> str:
        return f"[{' '.join(self.argv[:8])} ... exit {self.proc.poll()}]\n" + self.output()[-chars:]

    def worker_of_rank(self, rank: int, timeout: float = 60) -> int:
        return worker_of_rank(self.pid, rank, timeout)

    def wait_for(self, condition: Callable[[], object], what: str, timeout: float = 120) -> None:
        """Poll ``condition`` until it holds; fail (with the log) if the job ends first or
        ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the job ended before {what}\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s\n{self.tail()}"
            time.sleep(0.01)

    def finish(self, timeout: float = 240) -> int:
        """The job's exit status; a job still running after ``timeout`` is killed and fails the test."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s\n{self.tail()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.pid)
        self.proc.wait()


def run(argv: list[str], log: Path, *, timeout: float = 240, **options) -> Job:
    """Run ``argv`` to its end (``timeout``) as a ``Job``: ``.returncode``, ``.output()``, ``.tail()``."""
    with Job(argv, log, **options) as job:
        job.finish(timeout)
    return job


def succeeds(argv: list[str], log: Path, *, timeout: float = 240, **options) -> Job:
    """``run``, asserting exit 0 (the failure shows the job's output)."""
    job = run(argv, log, timeout=timeout, **options)
    assert job.returncode == 0, job.tail()
    return job
