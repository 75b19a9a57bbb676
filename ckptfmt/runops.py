"""Operations on a whole run: validate, ls, polish pivot, audit fork, bisect (spec/RUN.md §4-§7)."""
from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from . import format as fmt
from . import history as hist
from . import manifest as mf
from .errors import CheckpointError, DestinationExistsError
from .run import (ARCHIVE, PIVOT, SAMPLES, STATE, Run, RunLock, check_generation, copy_verified,
                  lock_holder, read_json, write_json)
from .validation import Report, error_code, validate_file


def zombie_arms(run: Run) -> list[str]:
    """Bandit arms in .state.json whose data source the run's config no longer has (seed: the
    step-112,619 lesson). Empty when there is no state or no config to compare with."""
    state = run.read_sidecar(STATE, default=None)
    if not isinstance(state, dict) or not isinstance(state.get("arms"), dict):
        return []
    gen = next((g for g in reversed(run.generations()) if g.committed), None)
    if gen is None:
        return []
    try:
        sources = mf.read(gen.manifest).get("config", {}).get("sources")
    except CheckpointError:
        return []
    if not sources:
        return []
    return sorted(set(state["arms"]) - set(sources))


def validate_run(path: "str | os.PathLike[str]", *, deep: bool = True, progress=None) -> Report:
    run = Run(path)
    report = Report(str(path), kind="run")
    listing = run.listing()
    bare = run.is_bare()
    gens_out = []
    for gen in listing.generations:
        gens_out.append(_validate_generation(report, gen, deep, bare, progress))
    report.details["generations"] = gens_out
    for temp in listing.temps:
        report.warn("leftover_temp", f"{temp}: temp file of an interrupted save (ckptfmt gc sweeps it)")
    for entry, why in listing.foreign:
        report.warn("foreign_entry", f"{entry}: skipped: {why}")
    _validate_sidecars(report, run)
    committed_ok = [g for g in gens_out if g["status"] in ("verified", "committed")]
    if not listing.generations:
        report.defect("no_generation", f"{path}: no generation to resume from")
    elif not committed_ok and not bare:
        report.defect("no_valid_generation", f"{path}: no committed generation is valid")
    elif bare:
        report.warn("bare_run", f"{path}: bare .bin files without manifests: structure only, unverified")
    report.status = "damaged" if not report.ok else ("verified" if deep and not bare else "committed")
    return report


def _validate_generation(report: Report, gen, deep: bool, bare: bool, progress=None) -> dict[str, Any]:
    row = {"step": gen.step, "status": "unverified"}
    if gen.bin is None and gen.shards is not None:
        reason = check_generation(gen, deep=deep)
        if reason is None:
            row["status"] = "verified" if deep else "committed"
        elif gen.manifest is None:
            report.warn("uncommitted", f"{gen.shards}: shards without a manifest (an interrupted sharded save)")
            row["status"] = "uncommitted"
        else:
            report.defect("shard_defect", f"{gen.manifest}: {reason}")
            row["status"] = "damaged"
        return row
    if gen.bin is None:
        report.warn("orphan_manifest", f"{gen.manifest}: manifest without its .bin (uncommitted)")
        row["status"] = "orphan manifest"
        return row
    if gen.manifest is None and not bare:
        report.warn("uncommitted", f"{gen.bin}: no manifest: an uncommitted leftover of a crash")
        row["status"] = "uncommitted"
        return row
    sub = validate_file(gen.bin, deep=deep, progress=progress)
    report.findings.extend(f for f in sub.findings if not (bare and f.code == "unverified"))
    row["status"] = sub.status
    return row


def _validate_sidecars(report: Report, run: Run) -> None:
    loss = hist.read(run.path / hist.NAME)
    for w in loss.warnings:
        report.warn("history_torn", w)
    for p in loss.problems:
        report.defect("history_corrupt", p)
    report.details["history_records"] = len(loss.records)
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


def ls_run(path: "str | os.PathLike[str]", *, deep: bool = False, keep_every: int | None = None) -> dict[str, Any]:
    """Generations with status, pins and milestone marks (steps divisible by ``keep_every``)."""
    run = Run(path)
    listing = run.listing()
    pins = set(run.pins())
    now = time.time()
    rows = []
    for gen in listing.generations:
        reason = check_generation(gen, deep=deep)
        target = gen.bin or gen.manifest or gen.shards
        name = gen.bin or gen.shards
        rows.append({"step": gen.step, "file": name.name if name else None,
                     "size": gen.size,
                     "age_s": round(now - target.stat().st_mtime, 1),
                     "committed": gen.committed, "valid": reason is None,
                     "status": ("verified" if deep else "committed") if reason is None else reason,
                     "pinned": gen.step in pins,
                     "milestone": bool(keep_every) and gen.step % keep_every == 0})
    return {"run": str(path), "generations": rows, "leftovers": [str(t) for t in listing.temps],
            "foreign": [f"{p}: {why}" for p, why in listing.foreign], "lock": lock_holder(path)}


def pivot(path: "str | os.PathLike[str]", *, note: str | None = None) -> dict[str, Any]:
    """Polish pivot: archive samples and bandit state by step, keep weights, m, v and the loss
    history, record the pivot. Refused while a writer holds the run."""
    run = Run(path)
    with RunLock(path, purpose="pivot"):
        gen = run.latest()
        if gen is None:
            raise CheckpointError(str(path), "cannot pivot: the run has no committed generation")
        dest = _archive_dir(run, gen.step)
        moved = []
        for name in (SAMPLES, STATE):
            src = run.path / name
            if src.exists():
                os.replace(src, dest / name.lstrip("."))
                moved.append(name)
        _fsync_dirs(dest, run.path)
        record = {"step": gen.step, "note": note, "time": time.time(), "archived": moved,
                  "archive": str(dest.relative_to(run.path))}
        write_json(run.path / PIVOT, record)
        run.history.event("pivot", gen.step, note=note)
        run.history.sync()
        run.history.close()
    return record


def _archive_dir(run: Run, step: int) -> Path:
    base = run.path / ARCHIVE / fmt.stem(step)
    dest, i = base, 1
    while dest.exists():
        i += 1
        dest = base.with_name(f"{base.name}.{i}")
    dest.mkdir(parents=True)
    return dest


def _fsync_dirs(*dirs: Path) -> None:
    from .fsio import fsync_dir
    for d in dirs:
        fsync_dir(str(d))


def fork(path: "str | os.PathLike[str]", step: int, dest: "str | os.PathLike[str]") -> dict[str, Any]:
    """Audit fork: a new run from generation ``step`` (copy verified by fingerprint), the loss
    history up to ``step``, and provenance (parent run, step, fingerprint) in the new manifest."""
    run, dest = Run(path), Path(dest)
    gen = next((g for g in run.generations() if g.step == step), None)
    if gen is None or not gen.committed:
        raise CheckpointError(str(path), f"no committed generation at step {step}")
    reason = check_generation(gen, deep=True)
    if reason:
        raise CheckpointError(str(gen.bin), f"cannot fork from it: {reason}")
    if dest.exists() and any(dest.iterdir()):
        raise DestinationExistsError(str(dest), "exists and is not empty; refusing to fork into it")
    dest.mkdir(parents=True, exist_ok=True)
    doc = mf.read(gen.manifest)
    copy_verified(gen.bin, dest / gen.bin.name, doc["blake3"])
    doc["provenance"] = {"parent_run": str(run.path.resolve()), "parent_step": step,
                         "parent_blake3": doc["blake3"], "forked_at": time.time()}
    mf.write(dest / gen.manifest.name, doc)
    canonical = [r for r in hist.read(run.history.path).canonical() if r["step"] <= step]
    child = hist.History(dest / hist.NAME)
    for rec in canonical:
        child.append(rec)
    child.event("fork", step, parent_run=str(run.path.resolve()))
    child.sync()
    child.close()
    return {"dest": str(dest), "step": step, "blake3": doc["blake3"], "history_records": len(canonical)}


def bisect(path_a: "str | os.PathLike[str]", path_b: "str | os.PathLike[str]") -> dict[str, Any]:
    """First step at which two runs' generations (by fingerprint) and loss histories differ."""
    digests = []
    for path in (path_a, path_b):
        out = {}
        for gen in Run(path).generations():
            if gen.committed:
                try:
                    out[gen.step] = mf.read(gen.manifest)["blake3"]
                except CheckpointError:
                    continue
        digests.append(out)
    common = sorted(set(digests[0]) & set(digests[1]))
    first_gen = next((s for s in common if digests[0][s] != digests[1][s]), None)
    last_same = max((s for s in common if first_gen is None or s < first_gen), default=None)
    losses = [{r["step"]: r.get("loss") for r in hist.read(Path(p) / hist.NAME).canonical()}
              for p in (path_a, path_b)]
    steps = sorted(set(losses[0]) | set(losses[1]))
    first_hist = next((s for s in steps if losses[0].get(s, "missing") != losses[1].get(s, "missing")), None)
    return {"a": str(path_a), "b": str(path_b), "common_generations": common,
            "first_generation_difference": first_gen, "last_identical_generation": last_same,
            "first_history_difference": first_hist, "history_steps": [len(losses[0]), len(losses[1])],
            "identical": first_gen is None and first_hist is None}
