"""Check files for ``b3sum --check`` (spec §6.3): one line per file in b3sum's own format,
``<64 hex digits>  <path>``, the path relative to the check file's directory, so
``cd DIR && b3sum --check B3SUMS`` verifies everything listed with a standard tool.

``ckptfmt export`` writes ``DEST/B3SUMS`` (every file of the export); ``ckptfmt validate RUN
--b3sums FILE`` writes one for the committed generations of a run (``.bin``, companion,
manifest, shards). Every digest is computed now, from the file, and a ``.bin`` whose digest is
not its manifest's is refused rather than listed: a check file never vouches for bytes the
manifest does not.

>>> line("ab" * 32, "step_000100.bin")
'abababababababababababababababababababababababababababababababab  step_000100.bin\\n'
>>> line("ab" * 32, "odd\\nname").startswith("\\\\abab")    # b3sum's escape for such names
True
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from .. import atomic, fingerprint
from .. import manifest as mf
from ..errors import DestinationExistsError, FingerprintMismatchError
from ..run import Run
from ..generation import Generation

NAME = "B3SUMS"


def line(digest: str, name: str) -> str:
    """One check-file line, escaped as b3sum escapes names holding a backslash or newline."""
    if "\\" in name or "\n" in name:
        return "\\" + digest + "  " + name.replace("\\", "\\\\").replace("\n", "\\n") + "\n"
    return f"{digest}  {name}\n"


def write(path: "str | os.PathLike[str]", rows: Iterable[tuple[str, str]]) -> int:
    """Durably write ``rows`` ((digest, name) pairs) as a check file; returns the line count.
    An existing file is never replaced."""
    if os.path.lexists(path):
        raise DestinationExistsError(os.fspath(path), "exists already; refusing to overwrite")
    text = "".join(line(digest, name) for digest, name in rows)
    atomic.write_bytes(path, text.encode())
    return text.count("\n")


def _listed(path: Path, claimed: str | None, base: Path) -> tuple[str, str]:
    """(digest hashed now, path relative to ``base``); refused if it is not ``claimed``."""
    digest = fingerprint.of_file(path)
    if claimed is not None and digest != claimed:
        raise FingerprintMismatchError(str(path), f"{fingerprint.mismatch(claimed, digest)}; not listed",
                                       expected=claimed, got=digest)
    return digest, os.path.relpath(path, base)


def generation_rows(gen: Generation, base: Path) -> list[tuple[str, str]]:
    """The lines for one generation: every part (its .bin or shards, companion, manifest), each
    hashed now and refused if it is not what the manifest records."""
    return [_listed(part.path, part.blake3, base) for part in gen.parts()]


def for_run(run_dir: "str | os.PathLike[str]", base: Path) -> list[tuple[str, str]]:
    """Lines for every committed, valid generation of a run (every generation of a bare run).
    The history and sidecars are left out: a live run appends to them, so their lines would
    go stale at the next step."""
    run = Run(run_dir)
    bare = run.is_bare()
    rows = []
    for gen in run.generations():
        if bare or gen.check() is None:
            rows += generation_rows(gen, base)
    return rows


def write_for(paths: Iterable[str], out: str) -> dict[str, Any]:
    """Write check file ``out`` for run directories and single ``.bin`` files."""
    base = Path(os.path.abspath(os.path.dirname(os.path.abspath(out))))
    rows: list[tuple[str, str]] = []
    for p in paths:
        if os.path.isdir(p):
            rows += for_run(p, base)
        else:
            bin_path = Path(p)
            manifest = mf.path_for(bin_path)
            rows += generation_rows(Generation(0, bin=bin_path, manifest=manifest if manifest.exists() else None), base)
    return {"file": out, "lines": write(out, rows)}
