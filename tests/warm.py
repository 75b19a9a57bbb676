"""Training processes started from a warm parent: ``warm.Popen`` and ``warm.run`` take the argv a
test would give ``subprocess`` (``[sys.executable, "-m", "ckptfmt.cli", "train", ...]``,
``[sys.executable, "examples/plain_loop.py", ...]``) and start it as a fork of a server that has
torch, torch._dynamo (every optimizer's constructor imports it) and ckptfmt already imported,
instead of a cold interpreter spending seconds on imports before its first step.

The child is a real process of its own: its pid takes real signals (SIGTERM, SIGKILL, SIGUSR1),
its exit code and stdout/stderr are what a cold start would give (pipes, files or DEVNULL, as
``subprocess`` takes them), it exits through the interpreter's normal shutdown (threads joined,
atexit run). What differs from a cold start: the modules are imported before its environment is
set (nothing the trainers read at import time is set by these tests), and it is a child of the
server, not of the test (the server reports its exit status). Anything ``subprocess`` takes that
the server does not know (other interpreter flags, a non-Python argv, preexec_fn) starts cold.

One server per test process, started on first use, gone when the test process goes.

    python tests/warm.py SOCKET      # the server (tests start it themselves)
"""
from __future__ import annotations

import array
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = ("numpy", "torch", "torch._dynamo", "torch.nn.functional", "ckptfmt", "ckptfmt.torch",
           "ckptfmt.cli", "ckptfmt.trainer.entry", "ckptfmt.trainer.mini")
FLAGS = {"-B", "-u"}


def parse(argv: list) -> dict | None:
    """What a warm child runs, or None when it must start cold: ``python [-B] [-u] (-m MOD | -c
    CODE | SCRIPT) ARGS...`` of this interpreter only."""
    argv = [str(a) for a in argv]
    if not argv or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return None
    i, flags = 1, []
    while i < len(argv) and argv[i] in FLAGS:
        flags.append(argv[i])
        i += 1
    if i >= len(argv) or (argv[i].startswith("-") and argv[i] not in ("-m", "-c")):
        return None
    if argv[i] in ("-m", "-c"):
        if i + 1 >= len(argv):
            return None
        return {"kind": argv[i], "target": argv[i + 1], "args": argv[i + 2:], "flags": flags}
    return {"kind": "script", "target": argv[i], "args": argv[i + 1:], "flags": flags}


# ------------------------------------------------------------------------------- the client
_server: "tuple[subprocess.Popen, str] | None" = None


def _address() -> str:
    global _server
    if _server is None or _server[0].poll() is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="ckptfmt-warm-"), "s")
        proc = subprocess.Popen([sys.executable, __file__, path], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"the warm server did not start: {line!r}"
        _server = (proc, path)
    return _server[1]


class Popen(subprocess.Popen):
    """``subprocess.Popen`` whose child is forked by the warm server (or started cold when its
    argv is not one the server runs)."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        plan = None if (shell or executable or preexec_fn or pass_fds or gid is not None or gids
                        or uid is not None or umask >= 0 or process_group not in (None, -1)) else parse(args)
        self._warm = None
        if plan is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                          startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                          c2pwrite, errread, errwrite, restore_signals, gid, gids, uid,
                                          umask, start_new_session, process_group)
        plan.update(cwd=os.fspath(cwd) if cwd is not None else os.getcwd(),
                    env={k: v for k, v in (os.environ if env is None else env).items()},
                    new_session=bool(start_new_session))
        fds = [fd if fd != -1 else default for fd, default in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(_address())
        body = json.dumps(plan).encode()
        conn.sendmsg([len(body).to_bytes(8, "little") + body],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        reply = _line(conn)
        self.pid = int(reply)
        self._warm = conn
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)   # the child's ends

    def _status(self, timeout: "float | None") -> bool:
        """Read the exit status from the server within ``timeout``; True once known."""
        if self.returncode is not None:
            return True
        ready, _, _ = select.select([self._warm], [], [], timeout)
        if not ready:
            return False
        line = _line(self._warm)
        self.returncode = int(line) if line else -9       # a server that died took its children
        self._warm.close()
        return True

    def _internal_poll(self, _deadstate=None, **kwargs):
        if self._warm is None:
            return super()._internal_poll(_deadstate, **kwargs)
        self._status(0)
        return self.returncode

    def _wait(self, timeout):
        if self._warm is None:
            return super()._wait(timeout)
        if not self._status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def run(argv, *, input=None, capture_output=False, timeout=None, check=False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` through the warm server."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with Popen(argv, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# ------------------------------------------------------------------------------- the server
_server_streams: list = []


def _child(plan: dict, fds: list) -> None:
    """In the forked child: become the process the argv names, then exit as it would."""
    import io
    import random
    if plan["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(plan["cwd"])
    os.environ.clear()
    os.environ.update(plan["env"])
    _server_streams.extend((sys.stdin, sys.stdout, sys.stderr))    # never collected: they own fds 0-2
    sys.dont_write_bytecode = "-B" in plan["flags"]
    unbuffered = "-u" in plan["flags"] or bool(plan["env"].get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False) if unbuffered else io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
        line_buffering=os.isatty(1), write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                                   line_buffering=True, write_through=True)
    random.seed()                           # a fresh process draws fresh seeds
    try:
        import numpy
        numpy.random.seed()
    except ImportError:
        pass
    try:
        _become(plan["kind"], plan["target"], plan["args"], plan["cwd"])
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:                 # as the interpreter does: die of the SIGINT
        import signal
        import traceback
        traceback.print_exc()
        _shutdown()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _shutdown()
    os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _shutdown() -> None:
    """The interpreter's shutdown without its module teardown (0.6 s with torch loaded): the
    threads that are not daemons joined, the atexit functions run, stdio flushed."""
    import atexit
    import threading
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _become(kind: str, target: str, args: list, cwd: str) -> None:
    import runpy
    if kind == "-m":
        sys.argv = [target, *args]
        sys.path[0] = cwd
        runpy._run_module_as_main(target, alter_argv=True)
    elif kind == "-c":
        sys.argv = ["-c", *args]
        sys.path[0] = ""
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        script = os.path.join(cwd, target)
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def serve(path: str) -> None:
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    parent = os.getppid()
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.01)
        if ready:
            conn, _ = listener.accept()
            head, anc, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * array.array("i").itemsize))
            fds = array.array("i")
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
            size = int.from_bytes(head[:8], "little")
            body = head[8:]
            while len(body) < size:
                body += conn.recv(size - len(body))
            plan = json.loads(body)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                conn.close()
                _child(plan, list(fds))
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()
    for pid in children:             # the test process went: its children go with it
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    serve(sys.argv[1])
