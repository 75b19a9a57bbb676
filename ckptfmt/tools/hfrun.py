"""A Hugging Face Trainer's output directory (``checkpoint-N`` directories, each committed by
its ckptfmt record, spec/RUN.md §12): which one to resume, retention with the run layer's
``Policy``, and what ``validate``, ``ls`` and ``inspect`` say of it. Torch-free.

>>> import tempfile, pathlib
>>> out = pathlib.Path(tempfile.mkdtemp())
>>> for n in (5, 10):
...     d = out / f"checkpoint-{n}"; d.mkdir(); _ = (d / "trainer_state.json").write_text("{}")
...     _ = hfdir.commit(d, n)
>>> _ = (out / "checkpoint-10" / "trainer_state.json").write_text("[1]")
>>> path, skipped = choose(out)
>>> path.endswith("checkpoint-5"), skipped[0][1]
(True, 'trainer_state.json: size 3, the record says 2')
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from .. import fsio, kinds
from ..errors import CheckpointError, NoValidGenerationError, UnsupportedSetupError
from ..hfcheckpoint import HFCheckpoint, checkpoints, deleting, read_record, step_of_dir, sweep_deleting
from ..run.lease import honoured
from ..run.retention import Policy, candidate, find_guards, guarded
from ..tensorfile import TensorFile
from . import hfdir
from .report import Report
from .stats import CHUNK, RegionStats
from ..warn import warn

__all__ = ["choose", "hf_kind", "inspect_hf", "ls_hf", "resume_path", "retain", "validate_hf"]


def hf_kind(path: "str | os.PathLike[str]") -> str | None:
    """'hf-run' or 'hf-checkpoint' when ``path`` is a Trainer's output or checkpoint directory."""
    try:
        name = kinds.sniff(path).name
    except (OSError, CheckpointError):
        return None
    return name if name in ("hf-run", "hf-checkpoint") else None


def choose(output_dir: "str | os.PathLike[str]", *, allow_nonfinite: bool = False,
           deep: bool = True) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest checkpoint directory that verifies, and is finite unless ``allow_nonfinite``;
    [(each newer one skipped, why)]). None when there is none."""
    skipped = []
    for gen in checkpoints(output_dir):
        why = gen.check(deep=deep)
        if why is None:
            bad = hfdir.non_finite(gen.read_manifest() or {})
            if not bad or allow_nonfinite:
                return str(gen.directory), skipped
            why = f"diverged: its weights hold {bad} non-finite values"
        skipped.append((str(gen.directory), why))
    return None, skipped


def resume_path(output_dir: "str | os.PathLike[str]", *, allow_nonfinite: bool = False) -> str | None:
    """The newest verified (blake3 of every file against its record) and finite checkpoint
    directory, for ``trainer.train(resume_from_checkpoint=...)``; a warning names each newer
    one skipped and why. None when the directory holds no checkpoint at all (a fresh start);
    ``NoValidGenerationError`` when it holds some and none verifies.

    Examples:
        What ``trainer.train(resume_from_checkpoint=...)`` takes (the tutorial's script does this):

        >>> import os
        >>> from ckptfmt.hf import resume_path
        >>> os.makedirs("out", exist_ok=True)
        >>> resume_path("out") is None              # no checkpoint yet: a fresh start
        True
    """
    if not os.path.isdir(output_dir):
        return None
    path, skipped = choose(output_dir, allow_nonfinite=allow_nonfinite)
    for where, why in skipped:
        warn(f"{where}: skipped for resume: {why}")
    if path is None and skipped:
        raise NoValidGenerationError(os.fspath(output_dir), "no checkpoint-N verifies: "
                                     + "; ".join(f"{os.path.basename(p)}: {w}" for p, w in skipped))
    return path


# ---------------------------------------------------------------- retention
def retain(output_dir: "str | os.PathLike[str]", policy: Policy, *, best: str | None = None,
           protect: "dict[int, str] | None" = None) -> list[int]:
    """Delete the committed checkpoints ``policy`` does not keep; never the newest valid one,
    the newest finite one, ``best`` (the Trainer's ``best_model_checkpoint``), one of ``protect``
    (step -> why) or one a reader leases (spec/RUN.md §5.3). The checkpoints the guards keep are
    verified first (blake3 of every file, newest first until one verifies): nothing is deleted
    while none does. Directories that do not verify are never candidates (nothing is deleted on
    a guess). Returns the steps deleted.

    Examples:
        A Trainer's output directory, keeping the last three committed checkpoints and its best:

        ```python
        from ckptfmt.hf import retain
        from ckptfmt.run import Policy

        deleted = retain("out", Policy(keep_last=3), best=trainer.state.best_model_checkpoint)
        ```
    """
    sweep_deleting(output_dir)
    if policy.keep_all:                    # nothing to delete: nothing to hash
        return []
    valid = [(gen, record) for gen in checkpoints(output_dir)
             if gen.check() is None and (record := _record_or_none(gen.directory)) is not None]
    records = {gen.step: record for gen, record in valid}
    guards = find_guards((gen for gen, _ in valid), check=lambda gen: gen.check(deep=True),   # verify before delete
                         non_finite=lambda gen: hfdir.non_finite(records[gen.step]))
    if guards.newest_valid is None:
        return []                           # no checkpoint verifies: no guard holds, nothing is deleted
    failed = {gen.step for gen, _ in guards.invalid}
    valid = [v for v in valid if v[0].step not in failed]
    also = dict(protect or {})
    if best is not None and step_of_dir(best) is not None:
        also.setdefault(step_of_dir(best), "best_model_checkpoint")
    doomed = guarded(policy, [candidate(g.step, r) for g, r in valid], guards, also=also).doomed
    with honoured(output_dir) as leased:
        doomed = [s for s in doomed if s not in leased]
        for gen, _ in valid:
            if gen.step in doomed:
                gen.remove()
    return doomed


# ---------------------------------------------------------------- validate / ls / inspect
def validate_hf(path: "str | os.PathLike[str]", *, deep: bool = True) -> Report:
    """``validate`` of an output directory (every ``checkpoint-N``) or of one checkpoint: a
    file that differs from its record, a stale record, unreadable weights or non-finite weights
    are defects (exit 1); a directory without a record is reported (an incomplete save, or a
    Trainer without the callback: unverified), not a defect."""
    path = Path(path)
    kind, dirs = _dirs(path)
    report = Report(str(path), kind=kind)
    rows = [_validate_one(report, gen, deep) for gen in dirs]
    report.details["checkpoints"] = rows
    if dirs:
        report.step = _step(dirs[0])
    if report.ok and rows and all(r["status"] == "verified" for r in rows):
        report.status = "verified"
    elif not rows:
        report.status = "no checkpoint"
    return report


def _dirs(path: Path) -> tuple[str, list[HFCheckpoint]]:
    """(kind, its checkpoint directories newest first): an output directory's, or the one."""
    if kinds.sniff(path).name == "hf-checkpoint":
        return "hf-checkpoint", [HFCheckpoint.at(path)]
    return "hf-run", checkpoints(path)


def _step(gen: HFCheckpoint) -> int | None:
    """A checkpoint's step: its name's, else its record's (None: neither says)."""
    return gen.step if gen.step >= 0 else None


def _validate_one(report: Report, gen: HFCheckpoint, deep: bool) -> dict[str, Any]:
    path = gen.directory
    row: dict[str, Any] = {"step": _step(gen), "path": str(path)}
    try:
        record = gen.read_manifest()
        for f in hfdir.weight_files(path):
            TensorFile(str(f))
    except (CheckpointError, OSError) as exc:
        report.defect("hf_checkpoint_defect", f"{path}: {exc}")
        return {**row, "status": "damaged"}
    if record is None:
        report.warn("unverified", f"{path}: {gen.leftover()[1]} (unverified)")
        return {**row, "status": "unverified"}
    found = gen.problems(deep=deep)
    for problem in found:
        report.defect("hf_checkpoint_defect", f"{path}/{problem}")
    bad = hfdir.non_finite(record)
    if bad and not found:
        report.defect("diverged", f"{path}: diverged: its weights hold {bad} non-finite values "
                                  f"({', '.join(sorted(record['facts']['tensors'])[:3])})")
    status = "damaged" if found else "diverged" if bad else "verified" if deep else "committed"
    return {**row, "status": status}


def ls_hf(path: "str | os.PathLike[str]", *, deep: bool = False) -> dict[str, Any]:
    """``ls`` of an output directory in the run listing's shape: each ``checkpoint-N`` with its
    status (verified/committed, damaged, incomplete, diverged), size, age and metrics."""
    now = time.time()
    rows = []
    for gen in reversed(_dirs(Path(path))[1]):
        p = gen.directory
        record = _record_or_none(p)
        found = gen.problems(deep=deep)
        status = "incomplete" if gen.manifest is None else f"damaged: {found[0]}" if found else \
            "diverged" if hfdir.non_finite(record) else "verified" if deep else "committed"
        metrics = (record or {}).get("metrics")
        rows.append({"step": _step(gen), "path": str(p), "size": gen.size, "status": status, "pinned": False,
                     "committed": record is not None and not found,
                     "metrics": metrics if isinstance(metrics, dict) else {},
                     "age_s": None if record is None else _age(record, now),
                     **({"problems": found} if gen.manifest is not None and found else {})})
    leftovers = [f"{p}: a removal that did not finish (uncommitted; the next retention deletes it)"
                 for p in deleting(path)] if Path(path).is_dir() else []
    return {"run": str(path), "kind": "hf-run", "generations": rows, "leftovers": leftovers, "in_progress": [],
            "foreign": [], "lock": None, "leases": [], "mirrors": [], "policy": {}}


def _age(record: dict[str, Any], now: float) -> float | None:
    created = candidate(0, record).committed_at
    return None if created is None else max(0.0, now - created)


def _record_or_none(path: Path) -> dict[str, Any] | None:
    try:
        return read_record(path)
    except CheckpointError:
        return None


def inspect_hf(path: "str | os.PathLike[str]", read_other=None) -> dict[str, Any]:
    """``inspect`` of a checkpoint directory (step, files, record, weight statistics) or of an
    output directory (its listing and the newest verified checkpoint, as for a run).
    ``read_other(path, kind)``: inspect's reading of a checkpoint saved without safetensors
    (``pytorch_model.bin``, through torch, which this module never imports)."""
    path = Path(path)
    if _dirs(path)[0] == "hf-run":
        out = ls_hf(path)
        newest, skipped = choose(path)
        for where, why in skipped:          # as a run's latest-valid says what it passed over
            warn(f"{where}: skipping it: {why}")
        if newest is None:     # a Trainer without the callback writes no record: unverified, as validate says
            newest = next((str(g.directory) for g in checkpoints(path) if g.manifest is None), None)
        out["latest"] = inspect_hf(newest, read_other) if newest else None
        if newest is None and out["generations"]:
            out["latest_problem"] = f"{path}: no checkpoint-N verifies"
        return out
    return _inspect_checkpoint(path, read_other)


def _inspect_checkpoint(path: Path, read_other=None) -> dict[str, Any]:
    record = _record_or_none(path)
    files = hfdir.weight_files(path)
    head = {"path": str(path), "kind": "hf-checkpoint", "label": kinds.get("hf-checkpoint").label,
            "origin": "ckptfmt" if record else "foreign", "step": _step(HFCheckpoint.at(path)), "size": fsio.tree_size(path),
            "record": record}
    if not files and (path / hfdir.TORCH_WEIGHTS).is_file() and read_other is not None:   # without safetensors
        return {**read_other(str(path), kinds.get("hf-checkpoint")), **head}
    if not files:
        raise UnsupportedSetupError(str(path), "no model.safetensors (nor its index): nothing to inspect")
    stats, dtypes, count, tensors = RegionStats(), set(), 0, 0
    for f in files:
        tf = TensorFile(str(f))
        for name in tf.names():
            dtype = tf.header[name]["dtype"]
            values = tf.tensor(name)
            tensors, count = tensors + 1, count + values.size
            dtypes.add(dtype)
            if dtype in hfdir.FLOATS or dtype == "BF16":
                flat = values.reshape(-1)
                for start in range(0, flat.size, CHUNK):     # one tensor, one chunk at a time
                    stats.add(_widened(dtype, flat[start:start + CHUNK]))
    return {**head, "n_params": count, "n_tensors": tensors, "dtypes": sorted(dtypes),
            "recorded_blake3": (record or {}).get("files", {}).get(os.path.relpath(files[0], path), {}).get("blake3"),
            "regions": {"weights": stats.to_dict()}}


def _widened(dtype: str, chunk: np.ndarray) -> np.ndarray:
    """A chunk of float values as float32 (bf16's bits, read as uint16, shifted into float32's
    high half; fp16 widened); float64 as it is."""
    if dtype == "BF16":
        return (chunk.astype("<u4") << 16).view("<f4")
    return chunk if dtype == "F64" else chunk.astype("<f4")
