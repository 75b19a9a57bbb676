"""Shared CLI plumbing: exit codes, the one error mapping (``guarded``), JSON/human output."""
from __future__ import annotations

import functools
import json
import math
import os
import warnings
from typing import Any, Callable

import click

from ..errors import CheckpointError, NotACheckpointError

EXIT_OK, EXIT_DEFECT, EXIT_CANNOT = 0, 1, 2


class Fail(click.ClickException):
    """One line on stderr and a chosen exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.exit_code = code

    def show(self, file: Any = None) -> None:
        click.echo(f"ckptfmt: {self.format_message()}", err=True)


def guarded(fn: Callable) -> Callable:
    """Turn library errors into one-line messages with the right exit code, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NotACheckpointError as exc:
            code = EXIT_CANNOT if exc.path and os.path.isdir(exc.path) else EXIT_DEFECT
            raise Fail(str(exc), code) from None
        except CheckpointError as exc:
            raise Fail(str(exc), EXIT_CANNOT if exc.could_not_run else EXIT_DEFECT) from None
        except OSError as exc:
            where = exc.filename or ""
            raise Fail(f"{where}: {exc.strerror or exc}" if where else str(exc), EXIT_CANNOT) from None
    return wrapper


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=1, default=_jsonable, allow_nan=True))
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


def size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Library warnings (a skipped generation, a zombie arm) as one line on stderr."""
    return f"ckptfmt: warning: {message}\n"


warnings.formatwarning = _one_line_warning
