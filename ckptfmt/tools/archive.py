"""Export archives (seed 001): an export packed into one ``.tar.zst`` with its ``export.json``,
read back before it is called done, and its import: unpacked into a staging directory beside
DEST, every member checked against the archive's record and the generations validated, then
renamed to DEST, so a failed import leaves nothing there (spec/RUN.md §9).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import zstandard

from .. import atomic, fsio
from .. import format as fmt
from ..errors import DestinationExistsError, ExportError
from ..generation import list_dir
from ..run.lock import publish, refuse_live, writing_into
from .archived import ARCHIVE_MANIFEST, read_members, unmatched
from .export import export, mark_incomplete, new_dest
from .validate import INCOMPLETE, validate_committed

__all__ = ["archive", "import_archive"]

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"     # RFC 8878: every zstd frame starts with these bytes


def archive(run_dir: str, archive_path: str, **options: Any) -> dict[str, Any]:
    """Export into a temp dir, then pack it into one .tar.zst with an embedded manifest,
    verified by reading the archive back.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.tools.archive import archive
        >>> os.makedirs("to-pack", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("to-pack", 10, z, z, z)
        >>> archive("to-pack", "to-pack.tar.zst")["steps"]
        [10]
    """
    fsio.refuse_url(archive_path, "the archive", "an archive is written as a local file (its RUN may be a URL)")
    target = Path(archive_path)
    if target.exists():
        raise DestinationExistsError(str(target), "exists already; refusing to overwrite")
    with tempfile.TemporaryDirectory(dir=target.parent if target.parent.exists() else None) as tmp:
        staged = Path(tmp) / "export"
        doc = export(run_dir, str(staged), **options)
        names = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
        with atomic.AtomicWriter(target) as out:
            with out.fileobj() as f:
                cctx = zstandard.ZstdCompressor(level=3, threads=-1)
                with cctx.stream_writer(f, closefd=False) as z, tarfile.open(fileobj=z, mode="w|") as tar:
                    for name in names:
                        tar.add(staged / name, arcname=name)
            out.commit()
    unpacked, _ = read_members(target, None)
    for row in doc["files"]:
        if unpacked.get(row["file"]) != row["blake3"]:
            atomic.remove(target)
            raise ExportError(str(target), f"{row['file']} does not read back from the archive intact")
    doc["archive"] = {"path": str(target), "size": target.stat().st_size}
    return doc


def import_archive(archive_path: str, dest: str) -> dict[str, Any]:
    """Unpack a .tar.zst export into DEST and verify every file against its embedded manifest.

    The archive is unpacked into a sibling staging directory (``.ckptfmt-tmp.`` + DEST's name,
    carrying the ``EXPORT-INCOMPLETE`` marker until every check passed) that is then renamed
    to DEST: a failed import leaves nothing at DEST, and DEST never holds a partial import.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.tools.archive import archive, import_archive
        >>> os.makedirs("packed", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("packed", 10, z, z, z)
        >>> _ = archive("packed", "packed.tar.zst")
        >>> import_archive("packed.tar.zst", "unpacked")
        {'dest': 'unpacked', 'files': 2, 'steps': [10], 'verified': True}
    """
    fsio.refuse_url(dest, "the destination", "an archive is imported into a local run directory")
    source, out = Path(archive_path), Path(dest)
    _check_archive_path(source)
    refuse_live(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DestinationExistsError(str(out), "exists and is not empty; choose a new destination")
    staging = out.parent / f"{fmt.TEMP_PREFIX}import.{out.name}.{os.getpid()}"
    try:
        mark_incomplete(staging, new_dest(staging))
    except OSError as exc:          # name DEST, not the staging directory the user never chose
        raise OSError(exc.errno, exc.strerror, str(out)) from None
    try:
        with writing_into(staging, "import") as lock:     # held through the rename: DEST's lock
            doc = _unpack_verified(source, staging)
            atomic.remove(staging / INCOMPLETE)
            publish(staging, out, lock)       # onto a missing or empty DEST, in one rename
        atomic.sync_dir_of(str(out))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"dest": str(out), "files": len(doc["files"]), "steps": doc["steps"], "verified": True}


def _check_archive_path(source: Path) -> None:
    """A missing archive or a directory is a usage problem (exit 2), not a damaged archive."""
    if not source.exists():
        raise FileNotFoundError(errno.ENOENT, "no such archive", str(source))
    if source.is_dir():
        raise IsADirectoryError(errno.EISDIR, "a directory, expected an export .tar.zst", str(source))


def _unpack_verified(source: Path, staging: Path) -> dict[str, Any]:
    """Unpack into ``staging`` and check every member against the archive's export.json."""
    with open(source, "rb") as f:
        if f.read(4) != ZSTD_MAGIC:
            raise ExportError(str(source), "not an export archive: not zstd-compressed (expected a "
                                           ".tar.zst written by ckptfmt export --archive)")
    try:
        digests, _ = read_members(source, staging)
    except ExportError:
        raise
    except (tarfile.TarError, ValueError, zstandard.ZstdError, EOFError) as exc:
        raise ExportError(str(source), f"not an export archive, or a damaged one: {exc}") from None
    try:
        doc = json.loads((staging / ARCHIVE_MANIFEST).read_text())
        rows, steps = list(doc["files"]), [int(s) for s in doc["steps"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise ExportError(str(source), f"archive has no readable {ARCHIVE_MANIFEST}") from None
    problems = unmatched(rows, digests)
    if problems:
        raise ExportError(str(source), f"{problems[0]} (after unpacking)")
    for gen in list_dir(staging).generations:
        if gen.step in steps and gen.path is not None and gen.path.exists():
            report = validate_committed(gen, deep=True)
            if not report.ok:
                raise ExportError(str(source), "; ".join(f.message for f in report.findings))
    return doc
