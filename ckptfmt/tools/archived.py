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

import zstandard

from .. import atomic, fingerprint
from .. import format as fmt
from ..errors import ExportError
from .report import Report

__all__ = ["read_members", "validate_archive"]

RECORD = "export.json"             # the export's own record of every file (export.ARCHIVE_MANIFEST)


def _safe_member(name: str) -> bool:
    """A bare file name, or a shard of a sharded generation (``step_N.shards/KKKKK-of-WWWWW.bin``):
    nothing an archive holds can land outside DEST."""
    if os.path.basename(name) == name:
        return name not in ("", ".", "..")
    directory, _, file = name.partition("/")
    parsed = fmt.parse_name(directory)
    return parsed is not None and parsed[1] == "shards" and re.fullmatch(r"\d{5}-of-\d{5}\.bin", file) is not None


def read_members(path: Path, dest: Path | None, keep: str | None = None) -> dict[str, str]:
    """blake3 of every member (extracting into ``dest`` when given); refuses unsafe members.
    ``keep``: a member whose bytes are returned too, under the key ``keep + ":bytes"``."""
    digests: dict = {}
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
                digests[f"{keep}:bytes"] = b"".join(kept)
    return digests


def validate_archive(path: "str | os.PathLike[str]") -> Report:
    """Every file the archive's ``export.json`` records against it: one missing or of another
    blake3, a torn stream, an unsafe member name or no readable record is a defect (exit 1)."""
    report = Report(os.fspath(path), kind="archive")
    try:
        found = read_members(Path(path), None, keep=RECORD)
        record = json.loads(found.pop(f"{RECORD}:bytes"))
        rows = {row["file"]: row["blake3"] for row in record["files"]}
        report.step = max(int(s) for s in record["steps"]) if record["steps"] else None
    except ExportError as exc:
        report.defect("archive_defect", str(exc))
        return report
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        report.defect("archive_defect", f"{path}: a torn or damaged archive: {exc}")
        return report
    except (KeyError, ValueError, TypeError):
        report.defect("archive_defect", f"{path}: no readable {RECORD} in the archive")
        return report
    for name, want in sorted(rows.items()):      # what import checks; its B3SUMS and EXPORT.md derive from these
        if found.get(name) != want:
            why = "missing" if name not in found else fingerprint.mismatch(want, found[name], by=RECORD)
            report.defect("archive_defect", f"{path}: {name}: {why}")
    if report.ok:
        report.status = "verified"
    return report
