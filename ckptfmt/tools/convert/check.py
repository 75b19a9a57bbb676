"""A conversion trusts nothing (spec §10.6): its source is checked against its own digest
before anything is written, and the result is checked by going back.

``source`` hashes the bytes of the ``.bin`` the source holds (the file itself, or header and
regions rebuilt from a foreign form) and compares them with the digest the source carries (the
manifest beside a ``.bin``, the ``blake3`` in a converted file's metadata). A mismatch is a
``FingerprintMismatchError`` (CLI exit 1) raised before the target is opened; a source without a
digest is reported as unverified, and a conversion of it is never called "verified".

>>> import numpy as np
>>> z = np.zeros(2, "<f4")
>>> src = Source("x", 3, z, z, z, None, None)
>>> digest_of(src) == fingerprint.of_bytes(fmt.pack_header(3, 2) + bytes(24))
True
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ... import companion, fingerprint
from ... import format as fmt
from ...errors import FingerprintMismatchError
from .source import Source

VERIFIED = "manifest"          # the source matched the digest it carries


def digest_of(src: Source, progress: Callable[[int], None] | None = None) -> str:
    """blake3 of the ``.bin`` bytes ``src`` holds: header, weights, m, v."""
    h = fingerprint.hasher(0)
    h.update(fmt.pack_header(src.step, src.n_params))
    if progress is not None:
        progress(fmt.HEADER_SIZE)
    for region in fmt.REGIONS:
        view = memoryview(np.ascontiguousarray(getattr(src, region))).cast("B")
        for start in range(0, view.nbytes, fingerprint.CHUNK):
            piece = view[start:start + fingerprint.CHUNK]
            h.update(piece)
            if progress is not None:
                progress(len(piece))
    return h.hexdigest()


def source(src: Source, kind: str, doc: dict[str, Any] | None,
           progress: Callable[[int], None] | None = None) -> tuple[str | None, str]:
    """(blake3 of the bytes the source holds, how the source was checked): ``"manifest"``, or
    ``"unverified: <why>"``. Raises ``FingerprintMismatchError`` when the digests disagree.
    ``doc`` is the manifest beside a ``.bin`` source (None for a bare file or another kind)."""
    if src.m is None or src.v is None:
        return None, "unverified: a weights-only file carries no digest of its own"
    digest = digest_of(src, progress)
    claimed = src.blake3
    if not claimed:
        why = "a bare .bin without a manifest" if kind == "bin" else f"the {kind} file carries no blake3"
        return digest, f"unverified: {why}"
    if digest != claimed:
        where = "manifest" if kind == "bin" else "metadata"
        raise FingerprintMismatchError(src.path, f"blake3 mismatch: its {where} says {claimed}, its bytes hash to "
                                                 f"{digest}; nothing was written", expected=claimed, got=digest)
    if doc is not None and companion.FIELD in doc:
        companion.require(src.path, doc[companion.FIELD], deep=True)
    return digest, VERIFIED

