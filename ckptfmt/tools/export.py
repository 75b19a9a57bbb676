"""Export a run as a recoverable, verified bundle (seed 001, "Mit einem tatsächlich
wiederherstellbaren Export abschließen"): copy, re-read at the destination, compare size and
blake3, then load one generation from the destination. Until every check passes, DEST holds
an ``EXPORT-INCOMPLETE`` marker, so a half export is never mistaken for a good one.
"""
from __future__ import annotations

import collections
import datetime
import errno
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import zstandard

from .. import atomic, fingerprint, fsio
from .. import format as fmt
from .. import manifest as mf
from ..errors import DestinationExistsError, ExportError
from ..generation import Generation, list_dir
from ..run import SAMPLES, STATE, Listing, ReadLease, Run, lock_holder
from ..run import history as hist
from ..run import timeline
from ..run.lock import publish, refuse_live, writing_into
from . import b3sums
from .convert import convert
from .validate import INCOMPLETE, validate_generation_file

__all__ = ["INCOMPLETE", "archive", "checks_in_words", "export", "import_archive"]

SIDECARS = (hist.NAME, SAMPLES, STATE)
ARCHIVE_MANIFEST = "export.json"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"     # RFC 8878: every zstd frame starts with these bytes


def _choose(run: Run, listing: Listing, steps: list[int] | None) -> list:
    """The generations named by ``steps``, or the newest valid one, from the leased listing."""
    gens = listing.generations
    bare = bool(gens) and all(g.manifest is None for g in gens)
    committed = {g.step: g for g in gens if g.committed or bare}
    if steps:
        missing = [s for s in steps if s not in committed]
        if missing:
            raise ExportError(str(run.path), f"no committed generation at step(s) {missing}")
        return [committed[s] for s in steps]
    gen = run.latest(allow_bare=True, among=list(committed.values()) or gens)
    if gen is None:
        raise ExportError(str(run.path), "nothing to export: the run has no generation")
    return [gen]


def _new_dest(dest: Path) -> list[Path]:
    """Make DEST (missing or an empty directory); the directories it made."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise DestinationExistsError(str(dest), "exists and is not empty; choose a new destination")
    made = atomic.missing_dirs(dest)
    dest.mkdir(parents=True, exist_ok=True)
    return made


def _mark(dest: Path, made: list[Path]) -> Callable[[], None]:
    """Make DEST carry the marker; return how to undo it. An export that fails leaves DEST as it
    found it; one cut short by a crash leaves the marker."""
    def undo() -> None:
        for entry in dest.iterdir():          # DEST was empty: everything in it is this export's
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        atomic.remove_dirs(made)
    atomic.write_bytes(dest / INCOMPLETE, b"export in progress or failed; do not use\n")
    return undo


def export(run_dir: str, dest: str, *, steps: list[int] | None = None,
           with_history: bool = True, weights_only: bool = False,
           check: Callable[[Path], str] | None = None,
           tamper: Callable[[Path], None] | None = None, progress=None) -> dict[str, Any]:
    """Copy the chosen generations and sidecars to DEST and prove them there.

    Every file is re-read and hashed at DEST and the newest generation is validated fully.
    ``check``, when given, is then called with that generation's path at DEST and returns one
    line for the export's record, for example "loaded into a fresh model + AdamW at step 40"
    (``ckptfmt.trainer.export_check`` does that for the reference trainer); it raises a
    ``CheckpointError`` if the generation cannot be used. The library knows no model, so a
    caller that has one supplies the check. ``tamper`` is a test hook run after the copy and
    before the verification.
    """
    fsio.refuse_url(dest, "the destination")
    run, out = Run(run_dir), Path(dest)
    with ReadLease(run.path, purpose="export") as lease:    # retention keeps them (RUN.md §5.3)
        gens = _choose(run, lease.listing, steps)
        lease.narrow(g.step for g in gens)
        refuse_live(out)                      # a live run at DEST: name its writer, not "not empty"
        made = _new_dest(out)
        with writing_into(out, "export"):     # a trainer starting on DEST meanwhile is refused (RUN.md §4)
            undo = _mark(out, made)
            try:
                doc, files = _export_into(run, out, gens, with_history, weights_only, check, tamper, progress)
                atomic.write_json(out / ARCHIVE_MANIFEST, doc)
                (out / "EXPORT.md").write_text(_export_md(doc))
                _write_b3sums(out, files)
            except BaseException:
                undo()
                raise
            atomic.remove(out / INCOMPLETE)
    return doc


def _export_into(run: Run, out: Path, gens: list, with_history: bool, weights_only: bool,
                 check: Callable[[Path], str] | None, tamper: Callable[[Path], None] | None,
                 progress: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Copy the generations and sidecars to ``out`` and verify them there: (record, files)."""
    started = time.perf_counter()
    files = []
    for gen in gens:
        files += _export_generation(gen, out, weights_only, progress)
    live = lock_holder(run.path) is not None
    for name in SIDECARS if with_history else SIDECARS[1:]:
        files += _copy_sidecar(run.path / name, out / name, live)
    if tamper:
        tamper(out)
    checks = _verify_at_dest(out, files, gens, weights_only, check)
    return _describe(run, out, gens, files, checks, time.perf_counter() - started), files


def _write_b3sums(out: Path, files: list[dict[str, Any]]) -> None:
    """DEST/B3SUMS for ``cd DEST && b3sum --check B3SUMS``: every exported file with the digest
    it was verified with at DEST, then the export's own record files, hashed now."""
    rows = [(row["blake3"], row["file"]) for row in files]
    rows += [(fingerprint.of_file(out / name), name) for name in (ARCHIVE_MANIFEST, "EXPORT.md")]
    b3sums.write(out / b3sums.NAME, rows)


def _copy_sidecar(src: Path, dst: Path, live: bool) -> list[dict[str, Any]]:
    """Copy one sidecar as it is now; its row, or none when the run has no such file.

    A live trainer appends to the history while we copy: the copy is the history up to its last
    complete line at the start (every step up to the leased generations is in it: it is synced
    before each commit). The other sidecars are replaced atomically: one open file is one version.
    """
    try:
        length = hist.complete_length(src) if live and src.name == hist.NAME else None
        digest = atomic.copy_verified(src, dst, None, length=length)
    except FileNotFoundError as exc:
        if exc.filename != str(src):
            raise
        return []
    return [{"file": dst.name, "size": dst.stat().st_size, "blake3": digest}]


def _export_generation(gen: Generation, out: Path, weights_only: bool, progress=None) -> list[dict[str, Any]]:
    """Every part of ``gen`` into ``out``, each against its recorded digest (a weights-only
    export: its weights as one safetensors file); a row per file for the record."""
    if weights_only:
        target = out / (fmt.stem(gen.step) + ".safetensors")
        convert(str(gen.path), str(target), weights_only=True)
        return [{"file": target.name, "size": target.stat().st_size, "blake3": fingerprint.of_file(target),
                 "step": gen.step, "kind": "weights-only"}]
    against = "manifest" if gen.manifest else "unverified (bare file)"
    rows = []
    for row in gen.copy_to(out, progress=progress):
        role = row.pop("role")
        if role != "manifest":
            row["step"] = gen.step
        if role in ("generation", "shard"):
            row["verified_against"] = against
        rows.append({**row, "kind": role})
    return rows


def _verify_at_dest(out: Path, files: list[dict[str, Any]], gens: list, weights_only: bool,
                    check: Callable[[Path], str] | None) -> dict[str, Any]:
    """Re-read every copied file from DEST; then validate and load one generation from DEST."""
    for row in files:
        path = out / row["file"]
        size = path.stat().st_size if path.exists() else -1
        if size != row["size"]:
            raise ExportError(str(path), f"size at destination {size}, expected {row['size']}")
        got = fingerprint.of_file(path)
        if got != row["blake3"]:
            raise ExportError(str(path), f"blake3 at destination {got}, expected {row['blake3']}")
    checks: dict[str, Any] = {"files_rehashed": len(files)}
    if weights_only:
        return checks
    newest = out / gens[-1].path.name
    report = validate_generation_file(newest, deep=True)
    if not report.ok:
        raise ExportError(str(newest), "does not validate at the destination: "
                                       + "; ".join(f.message for f in report.findings))
    checks["validated"] = {"file": newest.name, "status": report.status}
    if check is not None and report.status == "verified":
        checks["loaded"] = check(newest)
    return checks


def _describe(run: Run, out: Path, gens: list, files: list, checks: dict, seconds: float) -> dict[str, Any]:
    newest = gens[-1]
    doc = mf.read(newest.manifest) if newest.manifest else {}
    copied = out / hist.NAME        # the history as exported, not as the live run has it now
    tail, steps = collections.deque(maxlen=100), 0          # the last 100 canonical records
    for rec in timeline.canonical(copied if copied.exists() else run.path / hist.NAME):
        tail.append(rec)
        steps += 1
    losses = [hist.decode_float(r["loss"]) for r in tail if "loss" in r]
    return {"exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source_run": str(run.path.resolve()), "steps": [g.step for g in gens], "files": files,
            "config": doc.get("config"), "versions": doc.get("versions"), "data": _data_identity(doc),
            "code": doc.get("code"), "verified": checks, "seconds": round(seconds, 3),
            "final_loss": {"last": losses[-1] if losses else None,
                           "mean_last_100": sum(losses) / len(losses) if losses else None,
                           "history_steps": steps},
            "bare": not bool(doc)}


def checks_in_words(checks: dict[str, Any]) -> str:
    """What ``verified`` holds, for a person: "5 files rehashed; step_000400.bin verified;
    loaded into a fresh tiny model + AdamW at step 400".

    >>> checks_in_words({"files_rehashed": 2, "validated": {"file": "step_000010.bin", "status": "verified"}})
    '2 files rehashed; step_000010.bin verified'
    """
    parts = [f"{checks.get('files_rehashed', 0)} files rehashed"]
    validated = checks.get("validated")
    if validated:
        parts.append(f"{validated.get('file')} {validated.get('status')}")
    parts += [v if isinstance(v, str) else f"{k}: {json.dumps(v)}" for k, v in checks.items()
              if k not in ("files_rehashed", "validated")]
    return "; ".join(parts)


def _export_md(doc: dict[str, Any]) -> str:
    step = doc["steps"][-1]
    name = (doc["verified"].get("validated") or {}).get("file") or fmt.checkpoint_name(step)
    lines = [f"# ckptfmt export of {doc['source_run']}", "",
             f"Exported {doc['exported_at']}: steps {doc['steps']}; verified at this destination: "
             f"{checks_in_words(doc['verified'])}.", ""]
    if doc["bare"]:
        lines += ["These are bare .bin files without manifests: their contents are UNVERIFIED.", ""]
    lines += ["| file | size | blake3 |", "|---|---|---|"]
    lines += [f"| {f['file']} | {f['size']} | {f['blake3']} |" for f in doc["files"]]
    loss = doc["final_loss"]
    lines += ["", f"Final loss: last {loss['last']}, mean of the last 100 steps {loss['mean_last_100']}.", "",
              "Commands:", "", "```",
              f"ckptfmt inspect {name}", "ckptfmt validate .",
              f"b3sum {name}    # must print the blake3 above",
              "b3sum --check B3SUMS    # every file of this export",
              f"ckptfmt train --run . --config {(doc.get('config') or {}).get('name', 'tiny')} --steps N   # resumes at {step}",
              f"ckptfmt convert {name} step.safetensors", "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- archives
def archive(run_dir: str, archive_path: str, **options: Any) -> dict[str, Any]:
    """Export into a temp dir, then pack it into one .tar.zst with an embedded manifest,
    verified by reading the archive back."""
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
    unpacked = _read_archive(target, None)
    for row in doc["files"]:
        if unpacked.get(row["file"]) != row["blake3"]:
            atomic.remove(target)
            raise ExportError(str(target), f"{row['file']} does not read back from the archive intact")
    doc["archive"] = {"path": str(target), "size": target.stat().st_size}
    return doc


def _safe_member(name: str) -> bool:
    """A bare file name, or a shard of a sharded generation (``step_N.shards/KKKKK-of-WWWWW.bin``):
    nothing an archive holds can land outside DEST."""
    if os.path.basename(name) == name:
        return name not in ("", ".", "..")
    directory, _, file = name.partition("/")
    parsed = fmt.parse_name(directory)
    return parsed is not None and parsed[1] == "shards" and re.fullmatch(r"\d{5}-of-\d{5}\.bin", file) is not None


def _read_archive(path: Path, dest: Path | None) -> dict[str, str]:
    """blake3 of every member (extracting into ``dest`` when given); refuses unsafe members."""
    digests = {}
    with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as z, \
            tarfile.open(fileobj=z, mode="r|") as tar:
        for member in tar:
            if not member.isfile() or not _safe_member(member.name):
                raise ExportError(str(path), f"unsafe archive member {member.name!r}")
            data = tar.extractfile(member)
            h = fingerprint.hasher(0)
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
                if writer:
                    writer.commit()
            finally:
                if writer:
                    writer.__exit__(None, None, None)
            digests[member.name] = h.hexdigest()
    return digests


def import_archive(archive_path: str, dest: str) -> dict[str, Any]:
    """Unpack a .tar.zst export into DEST and verify every file against its embedded manifest.

    The archive is unpacked into a sibling staging directory (``.ckptfmt-tmp.`` + DEST's name,
    carrying the ``EXPORT-INCOMPLETE`` marker until every check passed) that is then renamed
    to DEST: a failed import leaves nothing at DEST, and DEST never holds a partial import.
    """
    fsio.refuse_url(dest, "the destination")
    source, out = Path(archive_path), Path(dest)
    _check_archive_path(source)
    refuse_live(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DestinationExistsError(str(out), "exists and is not empty; choose a new destination")
    staging = out.parent / f"{fmt.TEMP_PREFIX}import.{out.name}.{os.getpid()}"
    try:
        _mark(staging, _new_dest(staging))
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
        digests = _read_archive(source, staging)
    except ExportError:
        raise
    except (tarfile.TarError, ValueError, zstandard.ZstdError, EOFError) as exc:
        raise ExportError(str(source), f"not an export archive, or a damaged one: {exc}") from None
    try:
        doc = json.loads((staging / ARCHIVE_MANIFEST).read_text())
        rows, steps = list(doc["files"]), [int(s) for s in doc["steps"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise ExportError(str(source), f"archive has no readable {ARCHIVE_MANIFEST}") from None
    for row in rows:
        if not isinstance(row, dict) or digests.get(row.get("file")) != row.get("blake3"):
            raise ExportError(str(source), f"{row.get('file') if isinstance(row, dict) else row}: blake3 "
                                           "after unpacking differs from the export manifest")
    for gen in list_dir(staging).generations:
        if gen.step in steps and gen.path is not None and gen.path.exists():
            report = validate_generation_file(gen.path, deep=True)
            if not report.ok:
                raise ExportError(str(source), "; ".join(f.message for f in report.findings))
    return doc


def _data_identity(doc: dict[str, Any]) -> Any:
    """The reference trainer's data sources (``state.data``; ``data`` before it used the manager)."""
    state = doc.get("state")
    data = (state.get("data") if isinstance(state, dict) else None) or doc.get("data") or {}
    return data.get("identity") if isinstance(data, dict) else None
