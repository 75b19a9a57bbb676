"""Restore a run from its mirror (spec/RUN.md §10): the newest valid generation at the URL (or
one step), the loss history and every sidecar, into a new local run directory, verified.

Everything lands in a sibling temp directory first (payload hashed while received, the manifest
written last, the generation then checked fully) and the directory is renamed to DEST only when
complete, so DEST is never half a run. A generation whose bytes do not match its manifest at the
destination is skipped with a warning, and the one before it is tried (latest-valid, RUN §2); a diverged one is
passed over while a finite one is valid (RUN §2.1).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from .. import atomic, fingerprint, fsio
from .. import facts as valfacts
from .. import format as fmt
from ..errors import (DestinationExistsError, FingerprintMismatchError, GenerationNotFoundError, ManifestError,
                      NoValidGenerationError, RemoteError)
from ..generation import by_step, list_dir, recorded_parts
from ..run.segments import SegmentedHistory
from ..run.storelock import StoreReadLease
from ..run import RunLock, roots
from ..run import history as hist
from ..run.lock import refuse_live, writing_into
from ..run.mirror import INDEX, SIDECARS
from ..store.objects import Progress, ObjectStore
from ..warn import warn

__all__ = ["restore"]


def restore(url: str, dest: "str | os.PathLike[str]", *, step: int | None = None,
            progress: Progress = None) -> dict[str, Any]:
    """Bring generation ``step`` (default: the newest valid one at ``url``), the history and the
    sidecars to the new run directory ``dest``; returns what was restored and how it was checked."""
    fsio.refuse_url(dest, "the destination", "import URL DEST brings a run at a URL into the local run directory DEST")
    remote, out = ObjectStore(url), Path(dest)
    refuse_live(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DestinationExistsError(str(out), "exists and is not empty; choose a new destination")
    # a manifest is a commit: one whose payload is gone is a damaged generation, tried and named
    committed = sorted((s for s, g in by_step(remote).items() if g.manifest), reverse=True)
    if step is not None and step not in committed:
        raise GenerationNotFoundError(remote.url, f"no committed generation at step {step}")
    if not committed:
        raise GenerationNotFoundError(remote.url, "no committed generation at this URL")
    staging = Path(atomic.temp_path_for(out))
    atomic.make_durable_dir(staging)
    try:
        with writing_into(staging, "restore") as lock, \
                StoreReadLease(remote, committed, purpose=f"import into {out}") as claim:   # kept by its retention
            if claim.problem is not None:
                warn(f"{remote.url}: {claim.problem}; a retention there may delete what is read")
            sidecars = _restore_sidecars(remote, staging)     # first: its history names each generation's root
            chosen, skipped = _first_valid(remote, [step] if step is not None else committed, staging, progress,
                                           finite_first=step is None)
            roots.record(staging, "import", chosen, source=remote.url)
            _publish(staging, out, lock)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"url": remote.url, "dest": str(out), "step": chosen, "skipped": skipped,
            "sidecars": sidecars, "verified": "blake3 of every file while received; generation checked fully"}


def _first_valid(remote: ObjectStore, steps: list[int], staging: Path, progress: Progress,
                 finite_first: bool = False) -> tuple[int, list[dict]]:
    """Download candidates newest first until one verifies; damaged ones are warned about.
    ``finite_first``: pass over diverged generations (their manifest's facts count NaN or inf)
    while a finite one is valid, as latest-valid resume does (RUN §2.1); the newest valid
    diverged one is taken only when none is finite."""
    skipped: list[dict] = []
    diverged = []
    for step in steps:
        try:
            manifest = remote.read_manifest(step)        # read once: the check below and the download
            if finite_first and (bad := valfacts.diverged(manifest[0])):
                diverged.append(step)
                warn(f"{remote.url}: passing over diverged generation {step} ({valfacts.describe(bad)}); "
                              f"--step {step} restores it")
                continue
            _download_generation(remote, step, staging, progress, manifest)
            return step, skipped
        except (FingerprintMismatchError, ManifestError, RemoteError) as exc:
            if isinstance(exc, RemoteError) and not exc.problem.endswith("not found"):
                raise                          # the network, not this generation: no fallback
            reason = exc.problem if exc.path is None else f"{os.path.basename(exc.path)}: {exc.problem}"
            skipped.append({"step": step, "reason": reason})
            warn(f"{remote.url}: skipping generation {step}: {reason}")
            _discard(staging, step)
    if diverged:                               # none finite is valid: the newest valid diverged one
        chosen, more = _first_valid(remote, diverged, staging, progress)
        return chosen, skipped + more
    raise NoValidGenerationError(remote.url, "no valid generation: "
                                 + "; ".join(f"step {s['step']}: {s['reason']}" for s in skipped))


def _discard(staging: Path, step: int) -> None:
    """Remove what a generation that did not verify left in ``staging``: its parts and temp
    files; the lock stays held and the sidecars stay."""
    for entry in staging.iterdir():
        parsed = fmt.parse_name(entry.name)
        if (parsed is not None and parsed[0] == step) or fmt.is_temp_name(entry.name):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def _download_generation(remote: ObjectStore, step: int, staging: Path, progress: Progress,
                         manifest: tuple[dict[str, Any], bytes]) -> None:
    """Payload (hashed while received), then the manifest (``remote.read_manifest``'s document
    and bytes) last, then the full local check."""
    doc, data = manifest
    if doc["step"] != step:
        raise ManifestError(remote.where(fmt.manifest_name(step)), f"says step {doc['step']}, expected {step}")
    for part in recorded_parts(doc, step):
        target = staging.joinpath(*part.name.split("/"))
        if target.parent != staging:
            atomic.make_durable_dir(target.parent)
        remote.download(part.name, target, part.blake3, progress)
    atomic.write_bytes(staging / fmt.manifest_name(step), data)   # the very bytes, last
    gen = next(g for g in list_dir(staging).generations if g.step == step)
    reason = gen.check(deep=True) or roots.mismatch(gen, roots.recorded(staging / hist.NAME))
    if reason is not None:
        raise FingerprintMismatchError(str(staging / fmt.manifest_name(step)), reason)


def _restore_sidecars(remote: ObjectStore, staging: Path) -> dict[str, dict[str, Any]]:
    """Every sidecar the mirror's index lists, verified against it; of a run written straight
    to the store (no index: spec/RUN.md §2.0.2), its history's segments joined and each sidecar
    there; nothing of a store that has neither."""
    if not remote.exists(INDEX) and (history := SegmentedHistory(remote)).numbers():
        return _store_run_sidecars(remote, history, staging)
    if not remote.exists(INDEX):
        warn(f"{remote.where(INDEX)}: missing; the history and sidecars were not restored")
        return {}
    try:
        index = json.loads(remote.read_bytes(INDEX))["sidecars"]
    except (ValueError, KeyError, TypeError) as exc:
        raise RemoteError(remote.where(INDEX), f"not a mirror index: {exc}") from None
    for name, row in sorted(index.items()):
        if name not in SIDECARS:          # never a path of the index's choosing ("..", "../x")
            raise RemoteError(remote.where(INDEX), f"names an unexpected file {name!r}")
        remote.download(name, staging / name, row["blake3"])
    return index


def _store_run_sidecars(remote: ObjectStore, history: SegmentedHistory, staging: Path) -> dict[str, dict[str, Any]]:
    """A store run's history (its segments in order, as one ``.loss.json``) and its sidecars,
    each as read (they have no index to check against: each object was written whole)."""
    rows = {}
    for name in SIDECARS:
        if name == hist.NAME:
            data = history.read_all()
            atomic.write_bytes(staging / name, data)
            digest = fingerprint.of_bytes(data)
        elif remote.size(name) is not None:
            digest = remote.download(name, staging / name, None)
        else:
            continue
        rows[name] = {"size": (staging / name).stat().st_size, "blake3": digest}
    return rows


def _publish(staging: Path, out: Path, lock: RunLock) -> None:
    """Rename the complete staging directory to DEST (an empty DEST is replaced); a writer that
    started on DEST meanwhile is named (``run.lock.publish``)."""
    try:
        if out.exists():
            out.rmdir()
        fsio.replace(str(staging), str(out))
    except OSError:
        refuse_live(out)
        raise
    lock.moved(out)
    fsio.fsync_dir(str(out.parent.resolve()))
