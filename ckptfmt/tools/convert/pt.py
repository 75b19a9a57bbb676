"""torch ``.pt``: ckptfmt's form, a dict of one tensor per region plus metadata, loaded only
with ``torch.load(weights_only=True)``. The torch side is ``ckptfmt.torch.torchsave``, reached
through ``torchside``, so the other conversions work without torch."""
from __future__ import annotations

from typing import Any

from ... import format as fmt
from .source import Source, meta, meta_source, regions_of
from .torchside import torchsave


def load(path: str, state: Any = None) -> Source:
    """ckptfmt's .pt form as a ``Source`` (``state``: what ``torchsave.read`` returned, when
    already read)."""
    ts = torchsave(path)
    state = ts.read(path) if state is None else state
    metadata, regions = ts.own_form(state, path, fmt.REGIONS)
    return meta_source(path, metadata, regions)


def write(src: Source, dst: str, weights_only: bool, dtype: str | None, progress=None) -> None:
    regions = {region: getattr(src, region) for region in regions_of(src, weights_only)}
    torchsave(dst).write_own_form(dst, dict(meta(src, weights_only)), regions, dtype)
