"""The one definition of what is fingerprinted (spec §6): blake3 of every byte of the .bin.

Hashing the whole file (header included) means ``b3sum step_000100.bin`` prints the same hex
digest the manifest holds, so a user can check a copy without ckptfmt.
"""
from __future__ import annotations

import mmap
import os
from typing import Any, Callable

import blake3
import numpy as np

from . import format as fmt

ALGORITHM = "blake3"
CHUNK = 16 << 20


def mismatch(claimed: str, digest: str, what: str = "file", by: str = "manifest") -> str:
    """The one wording of a hash that is not the committed one, wherever it is found (a file, a
    shard, a companion): what ``by`` (the manifest, a commit record) claimed first, then what
    the bytes hash to.

    >>> mismatch("ab", "cd", "shard")
    'blake3 mismatch: manifest says ab, shard hashes to cd'
    >>> mismatch("ab", "cd", by="record")
    'blake3 mismatch: record says ab, file hashes to cd'
    """
    return f"{ALGORITHM} mismatch: {by} says {claimed}, {what} hashes to {digest}"


def hasher(threads: int = 1) -> "blake3.blake3":
    """A fresh hasher; ``threads=0`` lets blake3 use every core (large in-memory inputs)."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO if threads == 0 else threads)


def of_bytes(data: "bytes | memoryview") -> str:
    return blake3.blake3(data).hexdigest()


def of_file(path: "str | os.PathLike[str]") -> str:
    """blake3 of a whole file, read through one mmap (no copy into Python)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return of_bytes(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return of_buffer(memoryview(mm))


def of_buffer(view: memoryview, progress=None) -> str:
    h = hasher(0)
    try:
        for start in range(0, len(view), CHUNK):
            h.update(view[start:start + CHUNK])
            if progress is not None:
                progress(min(CHUNK, len(view) - start))
    finally:
        view.release()
    return h.hexdigest()


def of_regions(step: int, regions: "tuple[Any, Any, Any]", progress: "Callable[[int], None] | None" = None) -> str:
    """blake3 of the ``.bin`` that ``step`` and the three float32 regions (weights, m, v) make,
    header and regions hashed as they would stand in the file (spec §2), never written: equal to
    ``of_file`` of that ``.bin``.

    >>> z = np.zeros(2, fmt.DTYPE)
    >>> of_regions(3, (z, z, z)) == of_bytes(fmt.pack_header(3, 2) + bytes(24))
    True
    """
    n = int(np.asarray(regions[0]).size)
    h = hasher(0)
    h.update(fmt.pack_header(step, n))
    if progress is not None:
        progress(fmt.HEADER_SIZE)
    for region in regions:
        view = memoryview(np.ascontiguousarray(region)).cast("B")
        for start in range(0, view.nbytes, CHUNK):
            piece = view[start:start + CHUNK]
            h.update(piece)
            if progress is not None:
                progress(len(piece))
    return h.hexdigest()
