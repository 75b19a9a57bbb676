"""The tools layer's one way to the torch layer's file forms (``.pt`` files and DCP
directories), imported inside the function that needs it: every other conversion, and
``import ckptfmt.tools.convert``, work without torch (the ``torch`` extra).
"""
from __future__ import annotations

from typing import Any

from ...errors import MissingDependencyError


def _missing(path: str, what: str, exc: ImportError) -> MissingDependencyError:
    if exc.name is not None and exc.name.split(".")[0] != "torch":
        raise exc
    return MissingDependencyError(path, f"{what} needs torch: pip install 'ckptfmt[torch]'")


def torchsave(path: str) -> Any:
    """``ckptfmt.torch.torchsave``: ``torch.save`` files, ckptfmt's ``.pt`` form and foreign
    training checkpoints."""
    try:
        from ...torch import torchsave as module   # lazy: torch is the optional extra
    except ImportError as exc:
        raise _missing(path, "a .pt file", exc) from None
    return module


def dcp(path: str) -> Any:
    """``ckptfmt.torch.dcp``: torch.distributed.checkpoint directories."""
    try:
        from ...torch import dcp as module     # lazy: torch is the optional extra
    except ImportError as exc:
        raise _missing(path, "a DCP directory", exc) from None
    return module
