"""The package's version: one place, read by the package root and by the writers that record
who wrote a file (the manifest's seal, a manifest's ``versions``)."""
from __future__ import annotations

import platform
from typing import Mapping

import numpy as np

__version__ = "0.1.0"


def software_versions(framework: Mapping[str, str]) -> dict[str, str]:
    """The versions a manifest records (ckptfmt, the framework's, NumPy, Python), so a resume on
    other software can be told apart.

    >>> sorted(software_versions({"torch": "2.5.1"}))
    ['ckptfmt', 'numpy', 'python', 'torch']
    """
    return {"ckptfmt": __version__, **framework, "numpy": np.__version__, "python": platform.python_version()}
