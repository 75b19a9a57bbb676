"""torch ``.pt``: a dict of one tensor per region plus metadata, loaded only with
``torch.load(weights_only=True)``. torch is imported lazily (``require_torch``), so the other
conversions work without it."""
from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np

from ... import atomic
from ... import format as fmt
from ...errors import ConvertError, UnsupportedConversionError
from .source import Source, meta, meta_source, regions_of, require_torch


def read(path: str) -> Any:
    """What ``torch.load(weights_only=True)`` gives for ``path`` (nothing is unpickled beyond
    tensors and plain containers)."""
    torch = require_torch(path)
    try:
        with warnings.catch_warnings():   # torch's "Detected pickle protocol N ... please file an issue"
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:     # the legacy (pre-1.6, non-zip) format has no mmap
                if "mmap can only be used with files saved with" not in str(exc):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file
        text = str(exc)
        # "Unsupported global: GLOBAL x.y", or "unsupported GLOBAL os.system whose module os is blocked"
        found = re.search(r"unsupported(?: global:)? GLOBAL ([\w.]+)", text, re.IGNORECASE)
        if found:
            raise UnsupportedConversionError(path, f"holds a pickled {found.group(1)}, which "
                                                   "torch.load(weights_only=True) refuses to run: save "
                                                   "model.state_dict() (and optimizer.state_dict()) instead") from None
        # torch's first line for a refused pickle advises weights_only=False: the specific line instead
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        first = next((line for line in lines if line.startswith("Unsupported")), lines[0] if lines else type(exc).__name__)
        raise ConvertError(path, f"cannot load with torch.load(weights_only=True): {first}") from None


def is_ckptfmt(state: Any) -> bool:
    """True for ckptfmt's own .pt form (``format`` = ``ckptfmt``); False for a foreign checkpoint."""
    return isinstance(state, dict) and state.get("format") == "ckptfmt"


def load(path: str, state: Any = None) -> Source:
    """ckptfmt's .pt form as a ``Source`` (``state``: what ``read`` returned, when already read)."""
    state = read(path) if state is None else state
    torch = require_torch(path)
    if not isinstance(state, dict):
        raise ConvertError(path, "not a ckptfmt .pt: expected a dict")
    regions = {r: _numpy(torch, path, r, state[r]) for r in fmt.REGIONS if r in state}
    meta = {k: v for k, v in state.items() if k not in fmt.REGIONS}
    return meta_source(path, meta, regions)


def _numpy(torch: Any, path: str, region: str, value: Any) -> np.ndarray:
    """A region tensor as numpy (bfloat16 as its uint16 bits, which numpy lacks); anything
    that is not a tensor is refused here, before its type could surprise a writer."""
    if not isinstance(value, torch.Tensor):
        raise ConvertError(path, f"region {region} is a {type(value).__name__}, expected a tensor")
    value = value.detach().contiguous().cpu()
    if value.dtype == torch.bfloat16:
        return value.view(torch.int16).numpy().view("<u2")
    return value.numpy()


def write(src: Source, dst: str, weights_only: bool, dtype: str | None, progress=None) -> None:
    torch = require_torch(dst)
    state: dict[str, Any] = dict(meta(src, weights_only))
    for region in regions_of(src, weights_only):
        t = torch.from_numpy(np.array(getattr(src, region), copy=True))
        state[region] = t.to(getattr(torch, dtype)) if dtype else t
    with atomic.AtomicWriter(dst) as out:
        with out.fileobj() as f:
            torch.save(state, f)
        out.commit()


