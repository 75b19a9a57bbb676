"""Validation (spec §8.4): every check the library has, returned as data, never printed.

Deep mode of a committed file whose manifest records value facts (spec §5.9) is one hash: when
the blake3 matches, the bytes are the ones the facts were computed over, so the facts are the
values' check. Otherwise (a bare file, a manifest without facts, ``scan=True``) it hashes the
file on a second thread while this thread scans the values, about one pass over the bytes.
A bare file is valid but 'unverified'; a generation holding NaN or inf is 'diverged'.
"""
from __future__ import annotations

import os
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import companion, fingerprint, kinds
from .. import facts as valfacts
from .. import format as fmt
from .. import manifest as mf
from .. import reader
from ..errors import CheckpointError, FingerprintMismatchError
from ..run import (STATE, SAMPLES, ReadLease, Run, lock_holder, save_in_progress,
                   zombie_arms)
from ..run import history as hist
from ..run import roots
from ..run.ops import memory_tier
from ..shards import check as shards_check
from .anyfile import manifest_of, open_source
from .loose import empty_directory
from .convert import check
from .report import DEFECT, INCOMPLETE, LOST_PAYLOAD, Finding, Report, error_code
from .values import (check_shard_values as _check_shard_values, check_values as _check_values,
                     report_facts as _report_facts, settle_diverged as _settle_diverged, values_plausible)

__all__ = ["INCOMPLETE", "Finding", "Report", "error_code", "validate_committed", "validate_file", "validate_other", "validate_path",
           "validate_run", "values_plausible"]

UNVERIFIED = "unverified: no digest of its own"

def validate_file(path: "str | os.PathLike[str]", *, deep: bool = True, progress=None,
                  scan: bool = False) -> Report:
    """Check one ``.bin``: structure, name, manifest, and with ``deep`` the blake3 and the values
    (finite, v >= 0): from the manifest's recorded facts when the blake3 matches, by scanning
    them otherwise or with ``scan``. The library never prints or exits: it returns a ``Report``.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.validate import validate_file
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save("step_000010.bin", 10, z, z, z)
        >>> report = validate_file("step_000010.bin", scan=True)     # scan the values, facts or not
        >>> report.status, report.details["values"]
        ('verified', 'scanned')
    """
    path = os.fspath(path)
    report = Report(path)
    try:
        ckpt = reader.open(path, manifest="ignore")
    except CheckpointError as exc:
        report.failed(exc)
        return report
    with ckpt:
        report.step, report.n_params = ckpt.step, ckpt.n_params
        doc = _check_manifest(report, ckpt)
        if report.ok:
            _check_contents(report, ckpt, doc, deep, progress, scan)
    _settle_diverged(report)
    return report


def _check_manifest(report: Report, ckpt: reader.Checkpoint) -> dict[str, Any] | None:
    mpath = str(mf.path_for(ckpt.path))
    parsed = fmt.parse_name(os.path.basename(ckpt.path))
    if parsed is not None and parsed[0] != ckpt.step:
        report.defect("bad_name", f"{ckpt.path}: name says step {parsed[0]}, header says {ckpt.step}")
    try:
        doc = mf.beside(ckpt.path, size=ckpt.size, step=ckpt.step, n_params=ckpt.n_params)
    except CheckpointError as exc:
        report.failed(exc)
        return None
    except OSError as exc:
        report.defect("manifest_unreadable", f"{mpath}: {exc.strerror or exc}")
        return None
    if doc is None:
        report.warn("unverified", f"{ckpt.path}: no manifest, contents cannot be verified")
        return None
    _note_unsealed(report, mpath, doc)
    if report.ok:
        report.status = "committed"
    return doc


def _note_unsealed(report: Report, path: str, doc: dict[str, Any]) -> None:
    """A manifest whose seal does not cover all of it (an older writer made it or added to it)
    is valid, and the report says what was not self-checked."""
    note = mf.self_checked(path, doc)
    if note is not None:
        report.warn("manifest_unchecked", f"{path}: {note}")


def _check_incomplete(report: Report, directory: str) -> None:
    """An export or import that has not finished (or failed) leaves its marker: never valid."""
    marker = os.path.join(directory, INCOMPLETE)
    if os.path.lexists(marker):
        report.defect("incomplete_export", f"{marker}: the export or import into {directory} did not "
                                           "finish (or failed): its files are incomplete; export again")


def _check_contents(report: Report, ckpt: reader.Checkpoint, doc: dict | None, deep: bool,
                    progress=None, scan: bool = False) -> None:
    if not deep:
        return
    recorded = None if scan else valfacts.recorded(doc)
    if recorded is not None:            # one hash: the facts hold for exactly these bytes
        if _check_digest(report, ckpt, doc, ckpt.fingerprint(progress)):
            report.details["values"] = "recorded"
            _report_facts(report, ckpt.path, recorded)
        else:                           # other bytes than the facts describe: look at them
            behind = reader.ReleaseBehind(ckpt)
            lane = behind.lane()
            try:
                _check_values(report, ckpt, lambda offset: behind.advance(lane, offset))
            finally:
                behind.advance(lane, ckpt.size)
            report.details["values"] = "scanned"
        if report.ok:
            report.status = "verified"
        return
    behind = reader.ReleaseBehind(ckpt)      # pages go once the scan and the hash have passed
    lane = behind.lane()
    hashing = behind.lane() if doc is not None else None
    with ThreadPoolExecutor(1, "ckptfmt-validate") as pool:
        digest = pool.submit(ckpt.fingerprint, progress, behind, hashing) if doc is not None else None
        try:
            _check_values(report, ckpt, lambda offset: behind.advance(lane, offset))
        finally:
            behind.advance(lane, ckpt.size)     # never leave the hashing thread waiting
        report.details["values"] = "scanned"
        if digest is not None:
            _check_digest(report, ckpt, doc, digest.result())
            if report.ok:
                report.status = "verified"


def _check_digest(report: Report, ckpt: reader.Checkpoint, doc: dict, got: str) -> bool:
    """The file's blake3 (and its companion's) against the manifest; True when the .bin matches."""
    report.details["blake3"] = got
    if got != doc["blake3"]:
        report.defect("fingerprint_mismatch", f"{ckpt.path}: {fingerprint.mismatch(doc['blake3'], got)}")
    reason = companion.check(ckpt.path, doc[companion.FIELD], deep=True) \
        if companion.FIELD in doc else None
    if reason is not None:
        report.defect("companion_defect", f"{companion.path_for(ckpt.path)}: {reason}")
    return got == doc["blake3"]


def validate_path(path: "str | os.PathLike[str]", *, deep: bool = True, progress=None,
                  scan: bool = False) -> Report:
    """A file or a run directory; ``scan`` scans the values even where facts are recorded. A
    directory (or a file's directory) that still carries the ``EXPORT-INCOMPLETE`` marker of an
    export or import is never valid, whatever its files say.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.tools.validate import validate_path
        >>> os.makedirs("either", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("either", 10, z, z, z)
        >>> validate_path("either").kind, validate_path("either/step_000010.bin").kind
        ('run', 'file')
    """
    kind = kinds.require(kinds.sniff(path), "validate", path)
    if kind.name in ("run", "lightning"):        # a Lightning checkpoint is a run of one generation
        report = validate_run(path, deep=deep, progress=progress, scan=scan)
        _check_incomplete(report, os.fspath(path))
        return report
    if kind.name in ("hf-run", "hf-checkpoint"):     # a Trainer's checkpoint-N against its record
        from .hfrun import validate_hf  # lazy: one more kind, read only when given
        return validate_hf(path, deep=deep)
    if kind.name == "archive":                       # an export archive: every member against its record
        from .archived import validate_archive  # lazy: as above
        return validate_archive(path)
    if kind.name == "lightning-dir":                 # ModelCheckpoint's directory: each checkpoint as alone
        from .lightningdir import validate_lightning_dir  # lazy: as above
        return validate_lightning_dir(path, validate_run, deep=deep)
    report = validate_generation_file(path, kind, deep=deep, progress=progress, scan=scan)
    _check_incomplete(report, os.path.dirname(os.path.abspath(path)))
    return report


def validate_generation_file(path: "str | os.PathLike[str]", kind: kinds.Kind | None = None, *,
                             deep: bool = True, progress=None, scan: bool = False) -> Report:
    """A file of any kind on its own (a ``Generation.path``: a seed ``.bin``, a sharded
    generation's manifest), without the export marker's rule (export checks its copy before it
    removes the marker).

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.validate import validate_generation_file
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save("step_000012.bin", 12, z, z, z)
        >>> validate_generation_file("step_000012.bin").ok
        True
    """
    kind = kind or kinds.require(kinds.sniff(path), "validate", path)
    if kind.name == "bin":
        return validate_file(path, deep=deep, progress=progress, scan=scan)
    return validate_other(os.fspath(path), kind, deep=deep, scan=scan)


def validate_committed(gen: Any, *, deep: bool = True, progress=None, scan: bool = False) -> Report:
    """A generation's file as its shape says (a seed ``.bin``, or a sharded generation's
    manifest), never as its content would suggest: a ``.bin`` replaced by a file of another kind
    is damage, not a foreign file.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.run import Run
        >>> from ckptfmt.tools.validate import validate_committed
        >>> os.makedirs("committed", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("committed", 10, z, z, z)
        >>> validate_committed(Run("committed").latest()).status
        'verified'
    """
    return validate_generation_file(gen.path, kinds.get(gen.kind), deep=deep, progress=progress, scan=scan)


def validate_other(path: str, kind: kinds.Kind, *, deep: bool = True, scan: bool = False) -> Report:
    """A file of another kind than the seed ``.bin``: ckptfmt's own forms (a DCP directory it
    wrote: its arrays as a ``.bin``) against the blake3 they record (convert's source check, which
    also says why one that records none is unverified), a sharded generation shard by shard, a foreign file by its
    structure and values ("unverified: no digest of its own"). Not ``deep``: readable is enough.

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt import kinds
        >>> from ckptfmt.tools.convert import convert
        >>> from ckptfmt.tools.validate import validate_other
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save("step_000011.bin", 11, z, z, z)
        >>> _ = convert("step_000011.bin", "eleven.safetensors")
        >>> validate_other("eleven.safetensors", kinds.sniff("eleven.safetensors")).status   # against the blake3 it records
        'verified'
    """
    report = Report(path)
    report.details["kind"] = kind.name
    if kind.name == "shards":
        return _validate_sharded(report, path, deep, scan)
    try:
        src = open_source(path, kind)
    except CheckpointError as exc:
        report.failed(exc)
        return report
    report.step, report.n_params = src.step, src.n_params
    if src.extra.get("origin") == "foreign":
        report.warn("unverified", f"{path}: {kind.label}: {UNVERIFIED}")
    elif deep:
        _check_recorded(report, src, kind)
    if deep:
        _check_values(report, src)
    _settle_diverged(report)
    return report


def _check_recorded(report: Report, src, kind: kinds.Kind) -> None:
    """ckptfmt's own form against the digest it records (``convert.check.source``)."""
    try:
        digest, how = check.source(src, kind.convert, None)
    except FingerprintMismatchError as exc:
        report.failed(exc)
        return
    report.details["blake3"] = digest
    if how == check.VERIFIED:
        report.status = "verified"
    else:
        report.warn("unverified", f"{src.path}: {how}")


def _validate_sharded(report: Report, path: str, deep: bool, scan: bool = False) -> Report:
    """Every shard against its manifest row (``Generation.check``'s check of a run's shards),
    then (``deep``) the values, from the recorded facts or (``scan``) every shard."""
    manifest = manifest_of(path)
    reason = shards_check(Path(manifest), deep=deep)
    if reason is not None:
        report.defect("shard_defect", f"{manifest}: {reason}")
        return report
    _note_unsealed(report, str(manifest), mf.read(manifest))
    row: dict[str, Any] = {"status": "verified" if deep else "committed"}
    if deep:
        _check_shard_values(report, row, manifest, scan)
    report.status = row["status"]
    if "non_finite" in row:
        report.details["non_finite"] = row["non_finite"]
    return report


def validate_run(path: "str | os.PathLike[str]", *, deep: bool = True, progress=None,
                 scan: bool = False) -> Report:
    """Check a run directory: every generation, leftovers, the history and the sidecars, and that
    a committed valid generation exists to resume from. Diverged generations (non-finite values)
    are defects, and listed in ``details["diverged"]``.

    Safe while a trainer commits and prunes: the generations listed at the start are leased
    (spec/RUN.md §5.3), and the live writer's unfinished save is reported as "save in progress"
    (a note, not a leftover).

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.tools.validate import validate_run
        >>> os.makedirs("diverging", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("diverging", 10, z, z, z)
        >>> _ = ckptfmt.save_generation("diverging", 20, np.float32([np.nan, 0]), z, z)
        >>> report = validate_run("diverging")
        >>> report.ok, report.details["diverged"]
        (False, [20])
    """
    run = Run(path)
    report = Report(str(path), kind="run")
    holder = lock_holder(path)
    with ReadLease(path, purpose="validate") as lease:
        listing = lease.listing
        live = [g for g in listing.generations if _saving(g, holder)]
        rest = [g for g in listing.generations if g not in live]
        bare = bool(rest) and all(g.manifest is None for g in rest)
        gens_out = [_in_progress(report, g) if g in live else
                    _validate_generation(report, g, deep, bare, progress, scan) for g in listing.generations]
        _check_roots(report, run, listing.generations, gens_out)
        report.details["generations"] = gens_out
        report.details["diverged"] = [g["step"] for g in gens_out if g["status"] == "diverged"]
        _report_entries(report, listing, holder)
        _validate_sidecars(report, run, live=holder is not None)
    memory = memory_tier(run, deep=deep) or {}           # a cache, but one a restore reads (RUN §13)
    for row in memory.get("generations", []):
        if row["status"].startswith("damaged"):
            part = row["file"] or fmt.manifest_name(row["step"])      # a lost payload: its manifest
            report.defect("ram_tier_damaged", f"{memory['dir']}/{part} (the RAM tier): {row['status']}")
    if lease.problem and holder is not None:
        report.warn("no_read_lease", lease.problem)
    committed_ok = [g for g in gens_out if g["status"] in ("verified", "committed")]
    if not listing.generations or (live and not any(g.committed for g in listing.generations)):
        _no_generation(report, path, holder, deep)      # nothing, or a live writer's first save
        return report
    if not committed_ok and not bare and not live:
        report.defect("no_valid_generation", f"{path}: no committed generation is valid"
                      + (" and finite" if report.details["diverged"] else ""))
    elif bare:
        report.warn("bare_run", f"{path}: bare .bin files without manifests: structure only, unverified")
    report.status = ("damaged" if not report.ok else "unverified" if bare   # no manifest: not committed
                     else "verified" if deep else "committed")
    _settle_diverged(report)
    return report


def _check_roots(report: Report, run: Run, gens: list, rows: list[dict[str, Any]]) -> None:
    """A valid generation that is not the one the run committed at its step (its root digest is
    not the one the history records: ``roots.mismatch``) is damaged."""
    recorded = roots.recorded(run.history.path)
    for gen, row in zip(gens, rows):
        if row["status"] in ("verified", "committed", "diverged") and (why := roots.mismatch(gen, recorded)):
            report.defect("not_committed_here", f"{gen.manifest}: {why}")
            row["status"] = "damaged"


def _no_generation(report: Report, path: "str | os.PathLike[str]", holder: dict[str, Any] | None,
                   deep: bool) -> None:
    """A directory without any generation, as every command judges it (``loose.empty_directory``):
    training is no defect, files of other kinds are checked each by its kind."""
    case, said = empty_directory(path, holder)
    if case == "files":
        for file, kind in said:
            checked = validate_generation_file(file, kind, deep=deep)
            if checked.could_not_run:            # not a checkpoint this reader can judge: named, not fatal
                report.warn("not_checked", f"{file}: not checked: " + "; ".join(f.message for f in checked.findings))
                continue
            report.findings += checked.findings
            report.details.setdefault("files", []).append({"path": file, "kind": kind.name, "status": checked.status})
        statuses = {f["status"] for f in report.details.get("files", [])}
        report.status = "damaged" if not report.ok else "verified" if statuses == {"verified"} else "unverified"
    elif case == "training":
        report.note("training", said)
        report.status = "training" if report.ok else "damaged"
    else:
        report.findings.append(Finding(DEFECT, "no_checkpoint_yet" if case == "stopped" else "no_generation", said))
        report.status = "no checkpoint"


def _saving(gen, holder: dict[str, Any] | None) -> bool:
    """An uncommitted generation that the live writer is saving now (not a crash leftover)."""
    part = gen.payload or gen.companion
    return not gen.committed and part is not None and save_in_progress(part, holder)


def _in_progress(report: Report, gen) -> dict[str, Any]:
    part = gen.payload or gen.companion
    report.note("save_in_progress", f"{part}: save in progress (the writer holding the run lock is "
                                    "committing this generation)")
    return {"step": gen.step, "status": "save in progress"}


def _report_entries(report: Report, listing, holder: dict[str, Any] | None) -> None:
    """Temp files (the live writer's, or leftovers of an interrupted save) and foreign entries."""
    for temp in listing.temps:
        if save_in_progress(temp, holder):
            report.note("save_in_progress", f"{temp}: save in progress (temp file of the writer "
                                            f"pid {holder.get('pid', '?')}, which holds the run lock)")
        else:
            report.warn("leftover_temp", f"{temp}: temp file of an interrupted save (ckptfmt gc sweeps it)")
    for entry, why in listing.foreign:
        report.warn("foreign_entry", f"{entry}: skipped: {why}")


def _validate_generation(report: Report, gen, deep: bool, bare: bool, progress=None,
                         scan: bool = False) -> dict[str, Any]:
    """One generation of a run, of either shape: a leftover of an interrupted save is a warning
    (``Generation.leftover``), a manifest without its payload a defect, a committed one (or a
    bare run's ``.bin``) is validated as a file is (``validate_generation_file``)."""
    row = {"step": gen.step, "status": "unverified"}
    leftover = None if bare and gen.bin is not None else gen.leftover()
    if leftover is not None:
        report.warn("uncommitted", f"{leftover[0]}: {leftover[1]}")
        row["status"] = "uncommitted"
        return row
    if gen.payload is None:
        report.defect("orphan_manifest", f"{gen.manifest}: {LOST_PAYLOAD}")
        row["status"] = "damaged"
        return row
    sub = validate_committed(gen, deep=deep, progress=progress, scan=scan)
    report.findings.extend(f for f in sub.findings if not (bare and f.code == "unverified"))
    row["status"] = sub.status
    if "non_finite" in sub.details:
        row["non_finite"] = sub.details["non_finite"]
    return row


def _validate_sidecars(report: Report, run: Run, live: bool = False) -> None:
    """The history (``live``: up to its last complete line; the writer may be appending the
    next), the samples and bandit sidecars, and zombie arms."""
    path = run.path / hist.NAME
    loss = hist.survey(path, hist.complete_length(path) if live and path.exists() else None)
    for w in loss.warnings:
        report.warn("history_torn", w)
    for p in loss.problems:
        report.defect("history_corrupt", p)
    report.details["history_records"] = loss.record_count
    for name in (SAMPLES, STATE):
        try:
            run.read_sidecar(name)
        except CheckpointError as exc:
            report.defect("sidecar_corrupt", str(exc))
    try:
        zombies = zombie_arms(run)
    except CheckpointError:
        zombies = []
    for arm in zombies:
        report.warn("zombie_arm", f"{run.path / STATE}: bandit arm {arm!r} has no data source in the "
                                  "run's config (zombie arm; the trainer drops it)")
