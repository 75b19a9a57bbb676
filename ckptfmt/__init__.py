"""ckptfmt: durable, fingerprinted training checkpoints in the seed's step_NNNNNN.bin layout.

Examples:
    >>> import ckptfmt, numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp(); w = np.arange(4, dtype="<f4")
    >>> r = ckptfmt.save(os.path.join(d, "step_000003.bin"), 3, w, w, w)
    >>> ckptfmt.open(r.path).step
    3
"""
from .errors import *  # noqa: F401,F403  (the hierarchy is part of the public API)
from .errors import CheckpointError
from .reader import Checkpoint, open, read_header
from .version import __version__
from .writer import SaveResult, save, save_generation


def validate(path, *, deep: bool = True):
    """Validate a ``.bin`` or a run directory: a ``Report`` (see ``ckptfmt.tools.validate``).

    The one declared upward reference of the core (spec/FORMAT.md "Architecture"): the tools
    layer is imported here, lazily, so ``import ckptfmt`` and ``open`` stay cheap.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> os.makedirs("checked", exist_ok=True)
        >>> z = np.zeros(4, np.float32)
        >>> _ = ckptfmt.save_generation("checked", 10, z, z, z)
        >>> report = ckptfmt.validate("checked")
        >>> report.ok, report.status, report.details["generations"]
        (True, 'verified', [{'step': 10, 'status': 'verified'}])
    """
    from .tools.validate import validate_path  # upward, lazy: the declared exception
    return validate_path(path, deep=deep)


__all__ = ["CheckpointError", "Checkpoint", "open", "read_header", "save", "save_generation",
           "SaveResult", "validate", "__version__"]
