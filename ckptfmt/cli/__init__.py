"""The ``ckptfmt`` command line: thin commands over library functions that return data.

Exit codes everywhere: 0 ok / valid / identical; 1 the check ran and found a defect or a
difference; 2 the check could not run (unreadable input, usage error). Errors are one line.

``main`` (the click group) lives in ``app``; importing the command modules registers them:
``files`` (inspect, validate, diff, convert), ``runs`` (ls, gc, ram, pin, pivot, fork, bisect, plot),
``archive`` (export, import), ``remote`` (mirror), ``train`` (train, verify-resume). Shared plumbing is in ``output``.
"""
from __future__ import annotations

from . import archive, files, remote, runs, train  # noqa: F401  (registers the commands on main)
from .app import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
