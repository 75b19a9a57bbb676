"""Shared CLI plumbing: exit codes, the one error mapping (``guarded``), JSON/human output.

The contract every command keeps: exit 0 ok, 1 a defect or difference found, 2 could not run;
a failure is one line on stderr naming the path and the problem, never a traceback; with
``--json`` stdout is one strict JSON document (RFC 8259: no NaN or Infinity) also on failure,
then holding an ``error`` object (``error_doc``).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import stat
import warnings
from typing import Any, Callable, Iterator

import click

from ..errors import CheckpointError, NotACheckpointError
from ..run.history import strict

EXIT_OK, EXIT_DEFECT, EXIT_CANNOT = 0, 1, 2
EXIT_INTERRUPTED = 130          # Ctrl-C: the shell's 128 + SIGINT; not a defect, nothing checked


class Fail(click.ClickException):
    """One line on stderr and a chosen exit code; with ``as_json`` also the ``error`` document
    on stdout. ``kind`` and ``path`` go into that document."""

    def __init__(self, message: str, code: int, *, kind: str = "usage", path: str | None = None,
                 as_json: bool = False):
        super().__init__(" ".join(message.split("\n")))
        self.exit_code = code
        self.kind, self.path, self.as_json = kind, path, as_json

    def show(self, file: Any = None) -> None:
        if self.as_json:
            click.echo(dumps(error_doc(self.format_message(), self.exit_code, self.kind, self.path)))
        click.echo(f"ckptfmt: {self.format_message()}", err=True)


def interrupted(as_json: bool) -> Fail:
    """A Ctrl-C: exit 130, one line (the console script says the same for one during start-up)."""
    return Fail("interrupted (Ctrl-C)", EXIT_INTERRUPTED, kind="Interrupted", as_json=as_json)


def error_doc(message: str, code: int, kind: str, path: str | None) -> dict[str, Any]:
    """What ``--json`` prints when a command fails: ``{"error": {...}}``, one strict document."""
    return {"error": {"type": kind, "message": message, "path": path, "exit_code": code}}


def guarded(fn: Callable, *, net: bool = True) -> Callable:
    """Turn library errors into one-line messages with the right exit code, never a traceback;
    with ``--json`` the failure is also one JSON document on stdout. ``net``: an error no check
    anticipated is one line too (``train`` keeps its traceback instead: a weeks-long run that
    dies of CUDA's out-of-memory or a NCCL error cannot be rerun just to see where)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        try:
            return fn(*args, **kwargs)
        except Fail as exc:
            exc.as_json = as_json
            raise
        except click.UsageError as exc:       # raised by a command's own checks: one line too
            raise Fail(exc.format_message(), EXIT_CANNOT, as_json=as_json) from None
        except CheckpointError as exc:
            raise Fail(str(exc), _exit_code(exc), kind=type(exc).__name__, path=exc.path,
                       as_json=as_json) from None
        except OSError as exc:
            if isinstance(exc, BrokenPipeError) and exc.filename is None and stdout_is_pipe():
                raise                                 # `| head` closed stdout: the group ends quietly
            where = exc.filename or given_path(kwargs) or ""
            message = f"{where}: {exc.strerror or exc}" if where else str(exc)
            raise Fail(message, EXIT_CANNOT, kind=type(exc).__name__, path=where or None,
                       as_json=as_json) from None
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:             # Ctrl-C: not a defect (a `validate || quarantine` must not fire)
            raise interrupted(as_json) from None
        except Exception as exc:              # a bug of ours: still one line, never a traceback
            if os.environ.get(DEBUG, "") not in ("", "0") or not net:
                raise
            raise Fail(internal_error(exc), EXIT_CANNOT, kind="InternalError", as_json=as_json) from None
    return wrapper


PATH_ARGUMENTS = ("path", "paths", "src", "source", "a", "run", "run_a", "runs", "archive", "dst", "dest", "b", "run_b")


def given_path(kwargs: dict[str, Any]) -> str | None:
    """The first path the command was given (its arguments by name, sources first), to name in
    an OS error that names no file itself (a read of an open file failing with EIO, a write of
    an open descriptor): every I/O error message names a path."""
    for key in PATH_ARGUMENTS:
        value = kwargs.get(key)
        if isinstance(value, (tuple, list)):
            value = value[0] if value else None
        if isinstance(value, str) and value:
            return value
    return None


DEBUG = "CKPTFMT_DEBUG"      # set (the test suite sets it): an internal error keeps its traceback


def guarded_keeping_tracebacks(fn: Callable) -> Callable:
    """``guarded`` without the net (``train``)."""
    return guarded(fn, net=False)


def internal_error(exc: Exception) -> str:
    """The one line of an error no check anticipated: what it was, that it is ckptfmt's defect,
    and how to see where it happened.

    >>> internal_error(KeyError("shards"))
    "internal error: KeyError: 'shards' (a defect of ckptfmt, please report it; CKPTFMT_DEBUG=1 shows the traceback)"
    """
    return (f"internal error: {type(exc).__name__}: {exc} (a defect of ckptfmt, please report it; "
            f"{DEBUG}=1 shows the traceback)")


def stdout_is_pipe() -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(1).st_mode) or stat.S_ISSOCK(os.fstat(1).st_mode)
    except OSError:
        return False


def quiet_after_closed_stdout() -> None:
    """The reader of stdout went away (``ckptfmt inspect RUN --tensors | head``): there is nobody
    to tell, so no message; stdout goes to /dev/null so the interpreter's last flush cannot raise
    again, and the command ends with 2 (it could not deliver its whole output)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    raise SystemExit(EXIT_CANNOT)


def _exit_code(exc: CheckpointError) -> int:
    if isinstance(exc, NotACheckpointError) and exc.path and os.path.isdir(exc.path):
        return EXIT_CANNOT       # a directory where a file was needed: a usage problem
    return EXIT_CANNOT if exc.could_not_run else EXIT_DEFECT


def dumps(data: Any) -> str:
    """Strict JSON (RFC 8259): a non-finite float is written as the string "nan", "inf" or
    "-inf" (the loss history's convention), never as the bare NaN/Infinity JSON lacks.

    >>> json.loads(dumps({"rel_l2": float("inf"), "n": [1.5, float("nan")]}))
    {'rel_l2': 'inf', 'n': [1.5, 'nan']}
    """
    return json.dumps(strict(data), indent=1, default=_jsonable, allow_nan=False)


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    """``--json``: one strict JSON document on stdout; otherwise the command's human form."""
    if as_json:
        click.echo(dumps(data))
    else:
        human(data)


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return str(obj)


def fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.6g}" if math.isfinite(x) else str(x)
    return str(x)


SIZE_UNITS = ("B", "KB", "MB", "GB", "TB")


def size(n: int | None) -> str:
    """Decimal units, as ``ls -h --si`` and disk vendors count: '153.60 MB', '8 B'.

    >>> size(153_600_008), size(8), size(None)
    ('153.60 MB', '8 B', '-')
    """
    if n is None:
        return "-"
    scaled, unit = float(n), 0
    while scaled >= 1000 and unit < len(SIZE_UNITS) - 1:
        scaled, unit = scaled / 1000, unit + 1
    return f"{n:.0f} B" if unit == 0 else f"{scaled:.2f} {SIZE_UNITS[unit]}"


class Tolerance(click.ParamType):
    """--atol / --rtol: a finite number >= 0 (a NaN tolerance would call any difference equal,
    a negative one every equal value different)."""
    name = "tolerance"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            x = math.nan
        if not (math.isfinite(x) and x >= 0):
            self.fail(f"{value!r} is not a finite number >= 0", param, ctx)
        return x


TOLERANCE = Tolerance()
json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Library warnings (a skipped generation, a zombie arm) as one line on stderr."""
    return f"ckptfmt: warning: {message}\n"


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """While a command runs, library warnings print as one line; the process's own format is
    put back after, so a program that imports the CLI or runs a command in-process (a test's
    CliRunner, a notebook) keeps Python's format for its own warnings."""
    before, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        yield
    finally:
        warnings.formatwarning = before


def metrics_words(metrics: Any, step: int | None) -> list[str]:
    """A generation's recorded metrics in words, ``name=value``, with ``@STEP`` where it was
    reported before the generation's ``step`` (``{"__float__": "nan"}`` is nan)."""
    def value(v: Any) -> str:
        return (str(v["__float__"]) if isinstance(v, dict) and "__float__" in v
                else f"{v:g}" if isinstance(v, float) else str(v))
    return [f"{k}={value(m.get('value'))}" + (f"@{m.get('step')}" if m.get("step") != step else "")
            for k, m in (metrics or {}).items() if isinstance(m, dict)] if isinstance(metrics, dict) else []


def print_memory(mem: dict | None) -> None:
    """The RAM tier's rows (spec/RUN.md §13), under the durable generations."""
    if not mem:
        return
    click.echo(f"  RAM tier {mem['dir']} (run id {mem['run_id']})"
               + ("" if mem["present"] else ": not there (a reboot or a wipe removed it)"))
    for g in mem["generations"]:
        age = "-" if g["age_s"] is None else f"{g['age_s']:.0f}s"
        click.echo(f"  {g['step']:>10}  {size(g['size']):>10}  {age:>10}  {g['status']} (RAM)")
