"""Markdown pieces every block uses: a table, a figure's formats, where a table's numbers come from."""
from __future__ import annotations

import statistics
from typing import Any, Iterable


def table(headers: list[str], rows: Iterable[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def fmt(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def ratio(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}x"


def mm(xs: list[float], scale: float = 1.0, form: str = "{:.2f}") -> str:
    """"min / median" of samples."""
    return f"{form.format(min(xs) * scale)} / {form.format(statistics.median(xs) * scale)}"


def mb(x: float) -> str:
    return f"{x / 1e6:,.0f}"


def short(commit: str | None) -> str:
    if not commit:
        return "commit not recorded"
    head, _, rest = commit.partition(" ")
    return f"commit {head[:7]}" + (f" {rest}" if rest else "")


def source(path: str, records: list[dict[str, Any]]) -> str:
    """One line under a table: its results file and each run in it (command, date, commit)."""
    runs: list[tuple[Any, Any, Any]] = []
    for r in records:
        run = (r["command"], r["date"], r["commit"])
        if run not in runs:
            runs.append(run)
    said = "; ".join(f"`{command or 'command not recorded'}`, {date or 'date not recorded'}, {short(commit)}"
                     for command, date, commit in runs)
    return f"<sub>From `{path}`: {said}.</sub>"
