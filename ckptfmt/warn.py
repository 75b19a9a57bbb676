"""The library's warnings, attributed to the user's line.

A warning says where it was raised from; the library's own layers (the manager over the state
side over the session over the run directory) sit between the user's ``mgr.restore()`` and the
line that decides to warn, and their depth differs from one path to another, so a fixed
``stacklevel`` named a line inside ckptfmt on some paths. ``warn`` names the first frame outside
the package instead: the user's call, or the framework's (Lightning's, the Trainer's) where a
callback warns. (Python 3.12's ``skip_file_prefixes`` does this; 3.10 and 3.11 do not have it.)
"""
from __future__ import annotations

import sys
import warnings

PACKAGE = __name__.split(".")[0]


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside ckptfmt.

    Examples:
        >>> import warnings
        >>> from ckptfmt.warn import warn
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn("runs/a: skipping generation 40: truncated")
        >>> seen[0].filename.endswith("warn.py"), str(seen[0].message)
        (False, 'runs/a: skipping generation 40: truncated')
    """
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == PACKAGE:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
