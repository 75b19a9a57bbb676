"""Reading an export archive (``export --archive``: one ``.tar.zst``, spec/RUN.md §9) member by
member: each member's blake3, and ``validate ARCHIVE``, which checks every member against the
archive's own ``export.json`` without unpacking anything (``ckptfmt import`` unpacks and checks
the generations too)."""
from __future__ import annotations

import json
import os
import re
import tarfile
from pathlib import Path
from typing import Any

import zstandard

from .. import atomic, fingerprint
from .. import format as fmt
from ..errors import ExportError
from .report import Report

__all__ = ["ARCHIVE_MANIFEST", "read_members", "unmatched", "validate_archive"]

ARCHIVE_MANIFEST = "export.json"   # the export's own record of every file it wrote


def _safe_member(name: str) -> bool:
    """A bare file name, or a shard of a sharded generation (``step_N.shards/KKKKK-of-WWWWW.bin``):
    nothing an archive holds can land outside DEST."""
    if os.path.basename(name) == name:
        return name not in ("", ".", "..")
    directory, _, file = name.partition("/")
    parsed = fmt.parse_name(directory)
    return parsed is not None and parsed[1] == "shards" and re.fullmatch(r"\d{5}-of-\d{5}\.bin", file) is not None


def read_members(path: Path, dest: Path | None, keep: str | None = None) -> tuple[dict[str, str], bytes | None]:
    """(blake3 of every member, the bytes of member ``keep``: None where there is none),
    extracting into ``dest`` when given; refuses unsafe members."""
    digests: dict[str, str] = {}
    kept_bytes: bytes | None = None
    with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as z, \
            tarfile.open(fileobj=z, mode="r|") as tar:
        for member in tar:
            if not member.isfile() or not _safe_member(member.name):
                raise ExportError(str(path), f"unsafe archive member {member.name!r}")
            data = tar.extractfile(member)
            h = fingerprint.hasher(0)
            kept = [] if member.name == keep else None
            if dest and "/" in member.name:
                atomic.make_durable_dir(dest / member.name.split("/")[0])
            writer = atomic.AtomicWriter(dest / member.name) if dest else None
            if writer:
                writer.__enter__()
            try:
                while chunk := data.read(8 << 20):
                    h.update(chunk)
                    if writer:
                        writer.write(chunk)
                    if kept is not None:
                        kept.append(chunk)
                if writer:
                    writer.commit()
            finally:
                if writer:
                    writer.__exit__(None, None, None)
            digests[member.name] = h.hexdigest()
            if kept is not None:
                kept_bytes = b"".join(kept)
    return digests, kept_bytes


def validate_archive(path: "str | os.PathLike[str]") -> Report:
    """Every file the archive's ``export.json`` records against it: one missing or of another
    blake3, a torn stream, an unsafe member name or no readable record is a defect (exit 1)."""
    report = Report(os.fspath(path), kind="archive")
    try:
        found, data = read_members(Path(path), None, keep=ARCHIVE_MANIFEST)
        record = json.loads(data if data is not None else b"")
        report.step = max(int(s) for s in record["steps"]) if record["steps"] else None
    except ExportError as exc:
        report.defect("archive_defect", str(exc))
        return report
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        report.defect("archive_defect", f"{path}: a torn or damaged archive: {exc}")
        return report
    except (KeyError, ValueError, TypeError):
        report.defect("archive_defect", f"{path}: no readable {ARCHIVE_MANIFEST} in the archive")
        return report
    for problem in unmatched(record.get("files"), found):    # its B3SUMS and EXPORT.md derive from these
        report.defect("archive_defect", f"{path}: {problem}")
    if report.ok:
        report.status = "verified"
    return report


def unmatched(rows: Any, digests: dict[str, str]) -> list[str]:
    """``NAME: why`` for each file the export's record (its ``files`` rows) names that the
    archive does not hold with the recorded blake3 (``digests``: what ``read_members`` found)."""
    if not isinstance(rows, list):
        return [f"{ARCHIVE_MANIFEST}: its files are not a list"]
    out = []
    for row in rows:
        name = row.get("file") if isinstance(row, dict) else None
        want = row.get("blake3") if isinstance(row, dict) else None
        if name is None or want is None:
            out.append(f"{ARCHIVE_MANIFEST}: a row names no file and blake3: {row!r:.80}")
        elif name not in digests:
            out.append(f"{name}: missing")
        elif digests[name] != want:
            out.append(f"{name}: {fingerprint.mismatch(want, digests[name], by=ARCHIVE_MANIFEST)}")
    return out
