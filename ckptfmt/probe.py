"""What ``ckptfmt.kinds`` looks at to tell a file's kind (spec/FORMAT.md §8.6): a path's stat
and first bytes, and on demand, once, a zip's member names, a small JSON document or the first
block a zstd frame decompresses to. A FIFO or a device is never opened."""
from __future__ import annotations

import json
import os
import stat
import zipfile
from functools import cached_property
from typing import Any

import zstandard

__all__ = ["HEAD", "MAX_JSON", "TAR_BLOCK", "Probe"]

HEAD = 64                     # bytes read from every file
TAR_BLOCK = 512               # a tar header: what a zstd frame's start is decompressed to
MAX_JSON = 16 << 20           # a manifest or an index.json larger than this is no document we sniff


class Probe:
    """What the sniffers look at: the path's stat, its first ``HEAD`` bytes, and (on demand,
    once) a zip's member names or a JSON document's top-level object."""

    def __init__(self, path: "str | os.PathLike[str]"):
        self.path = os.fspath(path)
        self.name = os.path.basename(self.path.rstrip("/")).lower()
        st = os.stat(self.path)            # a missing path stays FileNotFoundError (exit 2)
        self.is_dir = stat.S_ISDIR(st.st_mode)
        self.is_file = stat.S_ISREG(st.st_mode)
        self.size = st.st_size if self.is_file else 0
        self.head = b""
        if self.is_file:                   # never open a FIFO or a device: it could hang or lie
            with open(self.path, "rb") as f:
                self.head = f.read(HEAD)

    @cached_property
    def zip_names(self) -> list[str] | None:
        """A zip's member names; None when the directory cannot be read (a torn zip)."""
        try:
            with zipfile.ZipFile(self.path) as z:
                return z.namelist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            return None

    @cached_property
    def document(self) -> dict[str, Any] | None:
        """A small JSON file's top-level object (None for anything else)."""
        if not (self.is_file and self.name.endswith(".json") and self.size <= MAX_JSON):
            return None
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError, RecursionError):
            return None
        return doc if isinstance(doc, dict) else None

    @cached_property
    def unpacked_head(self) -> bytes:
        """The first ``TAR_BLOCK`` bytes a zstd file decompresses to (fewer, or none, for a
        short or damaged one)."""
        try:
            with open(self.path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as z:
                return z.read(TAR_BLOCK)
        except (OSError, zstandard.ZstdError):
            return b""
