"""A conversion trusts nothing (spec §10.6): its source is checked against its own digest
before anything is written, and the result is checked by going back.

``source`` hashes the bytes of the ``.bin`` the source holds (the file itself, or header and
regions rebuilt from a foreign form) and compares them with the digest the source carries (the
manifest beside a ``.bin``, the ``blake3`` in a converted file's metadata). A mismatch is a
``FingerprintMismatchError`` (CLI exit 1) raised before the target is opened; a source without a
digest is reported as unverified, and a conversion of it is never called "verified".

>>> import numpy as np
>>> from ckptfmt import format as fmt
>>> z = np.zeros(2, "<f4")
>>> src = Source("x", 3, z, z, z, None, None)
>>> digest_of(src) == fingerprint.of_bytes(fmt.pack_header(3, 2) + bytes(24))
True
"""
from __future__ import annotations

from typing import Any, Callable

from ... import companion, fingerprint
from ...errors import FingerprintMismatchError
from .source import Source

VERIFIED = "manifest"          # the source matched the digest it carries


def digest_of(src: Source, progress: Callable[[int], None] | None = None) -> str:
    """blake3 of the ``.bin`` bytes ``src`` holds: header, weights, m, v."""
    return fingerprint.of_regions(src.step, (src.weights, src.m, src.v), progress)


def source(src: Source, kind: str, doc: dict[str, Any] | None,
           progress: Callable[[int], None] | None = None) -> tuple[str | None, str]:
    """(blake3 of the bytes the source holds, how the source was checked): ``"manifest"``, or
    ``"unverified: <why>"`` (``src.extra["no_digest"]`` where the source says why it has none).
    Raises ``FingerprintMismatchError`` when the digests disagree.
    ``doc`` is the manifest beside a ``.bin`` source (None for a bare file or another kind)."""
    if src.m is None or src.v is None:
        return None, "unverified: a weights-only file carries no digest of its own"
    digest = digest_of(src, progress)
    claimed = src.blake3
    if not claimed:
        why = src.extra.get("no_digest") or \
            ("a bare .bin without a manifest" if kind == "bin" else f"the {kind} file carries no blake3")
        return digest, f"unverified: {why}"
    if digest != claimed:
        raise FingerprintMismatchError(src.path, f"{_mismatch(kind, claimed, digest)}; nothing was written",
                                       expected=claimed, got=digest)
    if doc is not None and companion.FIELD in doc:
        companion.require(src.path, doc[companion.FIELD], deep=True)
    return digest, VERIFIED


def _mismatch(kind: str, claimed: str, digest: str) -> str:
    """What differs, in the words of the form: a DCP directory's arrays against the blake3 of the
    ``.bin`` its embedded manifest records, any other form's bytes against its metadata."""
    if kind == "dcp":
        return (f"its arrays do not match the recorded blake3: its embedded manifest says {claimed}, the .bin "
                f"of its arrays hashes to {digest}")
    where = "manifest" if kind == "bin" else "metadata"
    return f"blake3 mismatch: its {where} says {claimed}, its bytes hash to {digest}"
