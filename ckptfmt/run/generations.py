"""What the run layer asks of a generation beyond the core type (``ckptfmt.generation``): its
manifest when readable, its recorded non-finite values, the check of a run without manifests.
"""
from __future__ import annotations

from .. import facts as valfacts
from ..errors import CheckpointError, RemoteError
from ..generation import LOST_PAYLOAD, Generation, opens

__all__ = ["manifest_of", "non_finite", "check_bare"]


def manifest_of(gen: Generation) -> dict | None:
    """The generation's manifest, from the store it lives in (``Generation.read_manifest``: a
    local file, or an object), None where there is none or it cannot be read (the checks that
    report why are ``Generation.check``'s); a store that cannot be reached is raised."""
    try:
        return gen.read_manifest()
    except RemoteError:
        raise
    except (CheckpointError, OSError):
        return None


def non_finite(gen: Generation) -> dict[str, int]:
    """{region: count} of the NaN and inf values the generation's manifest recorded at save
    (spec/FORMAT.md §5.9): non-empty means the generation is *diverged*. Empty when it is
    finite, or nothing is known (no manifest, no facts, unreadable: other checks report that).
    The facts describe the bytes only while their blake3 matches; callers that act on them
    check that too (``gen.check(deep=True)``)."""
    doc = manifest_of(gen)
    try:
        return valfacts.diverged(doc) if doc is not None else {}
    except CheckpointError:
        return {}


def check_bare(gen: Generation) -> str | None:
    """``Generation.check`` for a run of the original trainer, which wrote no manifests: the
    header, the size law and the name are all there is to check."""
    if gen.bin is None:
        return LOST_PAYLOAD
    return opens(gen.bin, manifest="ignore")
