"""Progress for long operations: the library takes a callback, the CLI draws a bar.

A callback receives the number of bytes just processed. The bar is drawn only on a terminal,
never with --json or in a pipe, and only for inputs large enough to take about a second.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

Callback = Callable[[int], None]
MIN_BYTES = 256 << 20     # below this an operation finishes in well under a second here


@contextlib.contextmanager
def terminal_bar(label: str, total: int, *, quiet: bool = False) -> Iterator[Callback | None]:
    if quiet or total < MIN_BYTES or not sys.stderr.isatty():
        yield None
        return
    import click
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield bar.update


def bytes_in(path: str) -> int:
    """Bytes a deep validation of PATH will hash (the .bin files in a run): the bar's total."""
    if os.path.isdir(path):
        return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(path)   # as list_dir: a symlink
                   if e.name.endswith(".bin") and e.is_file(follow_symlinks=False))     # (a loop too) is skipped
    return os.path.getsize(path)
