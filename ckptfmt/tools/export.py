"""Export a run as a recoverable, verified bundle (seed 001, "Mit einem tatsächlich
wiederherstellbaren Export abschließen"): copy, re-read at the destination, compare size and
blake3, then load one generation from the destination. Until every check passes, DEST holds
an ``EXPORT-INCOMPLETE`` marker, so a half export is never mistaken for a good one.
"""
from __future__ import annotations

import collections
import datetime
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


from .. import atomic, fingerprint, fsio
from .. import format as fmt
from ..errors import DestinationExistsError, ExportError
from ..generation import Generation, list_dir
from ..run import SAMPLES, STATE, Listing, Run
from ..run import history as hist
from ..run import timeline
from ..run.storerun import open_run
from ..run.lock import refuse_live, writing_into
from . import b3sums
from .archived import ARCHIVE_MANIFEST
from .convert import convert
from .validate import INCOMPLETE, validate_committed

__all__ = ["INCOMPLETE", "checks_in_words", "export", "mark_incomplete", "new_dest"]

SIDECARS = (hist.NAME, SAMPLES, STATE)


def _choose(run: Run, listing: Listing, steps: list[int] | None) -> list:
    """The generations named by ``steps``, or the newest valid one, from the leased listing."""
    gens = listing.generations
    bare = bool(gens) and all(g.manifest is None for g in gens)
    committed = {g.step: g for g in gens if g.committed or bare}
    if steps:
        missing = [s for s in steps if s not in committed]
        if missing:
            raise ExportError(run.where, f"no committed generation at step(s) {missing}")
        judge = run.judge()                   # the run's own: a generation swapped in is not exported
        for step in steps:
            if not bare and (why := judge(committed[step])):
                raise ExportError(run.name_of(committed[step]), f"cannot export step {step}: {why}")
        return [committed[s] for s in steps]
    gen = run.latest(allow_bare=True, among=list(committed.values()) or gens)
    if gen is None:
        raise ExportError(run.where, "nothing to export: the run has no generation")
    return [gen]


def new_dest(dest: Path) -> list[Path]:
    """Make DEST (missing or an empty directory); the directories it made.

    Examples:
        >>> from pathlib import Path
        >>> from ckptfmt.tools.export import new_dest
        >>> new_dest(Path("made/here"))                  # the directories it made, deepest first
        [PosixPath('made/here'), PosixPath('made')]
    """
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise DestinationExistsError(str(dest), "exists and is not empty; choose a new destination")
    made = atomic.missing_dirs(dest)
    dest.mkdir(parents=True, exist_ok=True)
    return made


def mark_incomplete(dest: Path, made: list[Path]) -> Callable[[], None]:
    """Make DEST carry the marker; return how to undo it. An export that fails leaves DEST as it
    found it; one cut short by a crash leaves the marker.

    Examples:
        >>> import os
        >>> from pathlib import Path
        >>> from ckptfmt.tools.export import mark_incomplete, new_dest
        >>> dest = Path("half-done")
        >>> undo = mark_incomplete(dest, new_dest(dest))
        >>> os.listdir(dest)
        ['EXPORT-INCOMPLETE']
        >>> undo()
        >>> dest.exists()
        False
    """
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
    before the verification. ``run_dir`` may be a URL (a run on object storage: each part
    streamed here against its recorded blake3, the history's segments joined).

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.tools.export import export
        >>> os.makedirs("source-run", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> for step in (10, 20):
        ...     _ = ckptfmt.save_generation("source-run", step, z, z, z)
        >>> record = export("source-run", "exported")                # the newest generation, verified there
        >>> record["steps"], sorted(os.listdir("exported"))
        ([20], ['B3SUMS', 'EXPORT.md', 'export.json', 'step_000020.bin', 'step_000020.json'])
    """
    fsio.refuse_url(dest, "the destination", "export writes a local directory (its RUN may be a URL; mirror RUN URL copies a run to object storage)")
    run, out = open_run(run_dir), Path(dest)
    with run.reading("export") as lease:      # retention keeps them (RUN.md §5.3)
        gens = _choose(run, lease.listing, steps)
        lease.narrow(g.step for g in gens)
        refuse_live(out)                      # a live run at DEST: name its writer, not "not empty"
        made = new_dest(out)
        with writing_into(out, "export"):     # a trainer starting on DEST meanwhile is refused (RUN.md §4)
            undo = mark_incomplete(out, made)
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
    for name in SIDECARS if with_history else SIDECARS[1:]:
        files += _copy_sidecar(run, name, out)
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


def _copy_sidecar(run: Run, name: str, out: Path) -> list[dict[str, Any]]:
    """One sidecar as it is now (``Run.copy_sidecar``: a live run's history up to its last
    complete line); its row, or none when the run has no such file."""
    digest = run.copy_sidecar(name, out / name)
    return [] if digest is None else [{"file": name, "size": (out / name).stat().st_size, "blake3": digest}]


def _export_generation(gen: Generation, out: Path, weights_only: bool, progress=None) -> list[dict[str, Any]]:
    """Every part of ``gen`` into ``out``, each against its recorded digest (a weights-only
    export: its weights as one safetensors file); a row per file for the record."""
    if weights_only:
        target = out / (fmt.stem(gen.step) + ".safetensors")
        with tempfile.TemporaryDirectory(dir=out, prefix=fmt.TEMP_PREFIX) as here:
            if not gen.local:                 # a store's: brought here whole (verified), then converted
                gen.copy_to(here)
            convert(str(gen.path if gen.local else Path(here, gen.path.name)), str(target), weights_only=True)
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
    at_dest = next(g for g in list_dir(out).generations if g.step == gens[-1].step)
    report = validate_committed(at_dest, deep=True)
    if not report.ok:
        raise ExportError(str(newest), "does not validate at the destination: "
                                       + "; ".join(f.message for f in report.findings))
    checks["validated"] = {"file": newest.name, "status": report.status}
    if check is not None and report.status == "verified":
        checks["loaded"] = check(newest)
    return checks


def _describe(run: Run, out: Path, gens: list, files: list, checks: dict, seconds: float) -> dict[str, Any]:
    newest = gens[-1]
    doc = newest.read_manifest() or {}
    copied = out / hist.NAME        # the history as exported, not as the live run has it now
    tail, steps = collections.deque(maxlen=100), 0          # the last 100 canonical records
    for rec in timeline.canonical(copied if copied.exists() else run.history.source):
        tail.append(rec)
        steps += 1
    losses = [hist.decode_float(r["loss"]) for r in tail if "loss" in r]
    return {"exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source_run": run.origin, "steps": [g.step for g in gens], "files": files,
            "config": doc.get("config"), "versions": doc.get("versions"), "data": _data_identity(doc),
            "code": doc.get("code"), "verified": checks, "seconds": round(seconds, 3),
            "final_loss": {"last": losses[-1] if losses else None,
                           "mean_last_100": sum(losses) / len(losses) if losses else None,
                           "history_steps": steps},
            "bare": not bool(doc)}


def checks_in_words(checks: dict[str, Any]) -> str:
    """What ``verified`` holds, for a person: "5 files rehashed; step_000400.bin verified;
    loaded into a fresh tiny model + AdamW at step 400".

    Examples:
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
def _data_identity(doc: dict[str, Any]) -> Any:
    """The reference trainer's data sources (``state.data``; ``data`` before it used the manager)."""
    state = doc.get("state")
    data = (state.get("data") if isinstance(state, dict) else None) or doc.get("data") or {}
    return data.get("identity") if isinstance(data, dict) else None
