"""Writing a Hugging Face Trainer checkpoint directory's (``checkpoint-N``) ckptfmt commit record
(spec/RUN.md §12.2), and reading the weights it holds: torch-free, so ``ckptfmt.hf`` (the Trainer
callback) commits with it and ``validate``, ``ls`` and ``inspect`` read without transformers.
Reading and checking the record is ``ckptfmt.hfcheckpoint``'s (the checkpoint as a generation).

The record ``ckptfmt-commit.json`` is written last, durably, after every file of the directory
and the directory itself were fsynced: each file with its size and blake3, the step, the
metrics of ``trainer_state.json`` at that step, the parameter names of each optimizer group and
the value facts of the saved weights. A directory without it is an incomplete save; a file that
differs from its row (a flipped byte, a second save into the same directory) makes it stale.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp()) / "checkpoint-3"; d.mkdir()
>>> _ = (d / "trainer_state.json").write_text('{"global_step": 3, "log_history": [{"loss": 0.5, "step": 3}]}')
>>> record = commit(d, 3)
>>> record["step"], sorted(record["files"]), record["metrics"]
(3, ['trainer_state.json'], {'loss': {'value': 0.5, 'step': 3}})
>>> from ckptfmt.hfcheckpoint import problems
>>> problems(d)
[]
>>> _ = (d / "trainer_state.json").write_text("{}")
>>> problems(d)[0].startswith("trainer_state.json: size 2, the record says")
True
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from .. import atomic, fingerprint, fsio
from .. import manifest as mf
from ..errors import CheckpointError, TensorFileError
from ..facts import PASS
from ..hfcheckpoint import DIR_NAME, FORMAT_ID, RECORD, files_of
from ..tensorfile import TensorFile

__all__ = ["commit", "durable", "metrics_at", "non_finite", "weight_files", "weight_map"]

VERSION = 1
INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
TORCH_WEIGHTS = "pytorch_model.bin"          # save_pretrained(safe_serialization=False)
FLOATS = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}


def durable(directory: Path) -> None:
    """fsync every file and every directory under ``directory``, then its parent (transformers
    writes ``checkpoint-N`` in place, without a temp directory or an fsync)."""
    for root, dirs, files in os.walk(directory, topdown=False):
        if any(DIR_NAME.fullmatch(part) for part in Path(root).relative_to(directory).parts):
            continue                           # another checkpoint's: not ours to make durable
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                fsio.fsync(fd, os.path.join(root, name))
            finally:
                os.close(fd)
        fsio.fsync_dir(root)
    fsio.fsync_dir(str(directory.parent))


def commit(directory: "str | os.PathLike[str]", step: int, param_names: list[list[str]] | None = None,
           **fields: Any) -> dict[str, Any]:
    """Make ``directory`` durable and write its record last (durably); returns the record.
    ``param_names``: each optimizer group's parameter names; ``fields``: more record fields."""
    directory = Path(directory)
    durable(directory)
    files = {name: {"size": (directory / name).stat().st_size, "blake3": fingerprint.of_file(directory / name)}
             for name in files_of(directory)}
    state = _trainer_state(directory)
    record: dict[str, Any] = {"format": FORMAT_ID, "version": VERSION, "step": step, "created": time.time(),
                              "files": files, "metrics": metrics_at(state, step),
                              "trainer_state": {k: _json_number(state.get(k)) for k in
                                                ("global_step", "epoch", "best_metric", "best_model_checkpoint",
                                                 "best_global_step")}}
    if param_names is not None:
        record["param_groups"] = param_names
    facts = weight_facts(directory)
    if facts is not None:
        record["facts"] = facts
    record.update(fields)
    record = mf.sealed(record)                     # sealed as a manifest is (§4.7)
    atomic.write_bytes(directory / RECORD, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    return record


def _trainer_state(directory: Path) -> dict[str, Any]:
    try:
        doc = json.loads((directory / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def metrics_at(state: dict[str, Any], step: int) -> dict[str, dict[str, Any]]:
    """Each number ``trainer_state.json``'s ``log_history`` logged at or before ``step`` (loss,
    eval_loss, learning_rate, ...) with its newest value, in the run manifest's shape
    ``{name: {"value", "step"}}`` (spec/FORMAT.md §4); NaN and inf as ``{"__float__": "nan"}``."""
    out: dict[str, dict[str, Any]] = {}
    entries = [e for e in state.get("log_history") or [] if isinstance(e, dict)]
    for entry in sorted(entries, key=lambda e: e.get("step") if _is_int(e.get("step")) else step + 1):
        at = entry.get("step")
        if not _is_int(at) or at > step:
            continue
        out.update({k: {"value": _json_number(v), "step": at} for k, v in entry.items()
                    if k not in ("step", "epoch") and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": str(value)}
    return value


# ---------------------------------------------------------------- weights
def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of the model: ``model.safetensors``, or every shard the index
    names; empty where there are none."""
    index = directory / INDEX
    if index.is_file():
        return [directory / name for name in sorted(set(weight_map(index).values()))]
    return [directory / WEIGHTS] if (directory / WEIGHTS).is_file() else []


def weight_map(index: Path, error: type[CheckpointError] = TensorFileError) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json``: tensor name -> shard file beside
    it (a shard name with a directory part, ``../x``, is refused); ``error`` otherwise."""
    try:
        doc = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise error(str(index), f"not a safetensors index: {exc}") from None
    found = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(found, dict) or not found or \
            not all(isinstance(v, str) and v not in ("", ".", "..") and os.path.basename(v) == v
                    for v in found.values()):
        raise error(str(index), "not a safetensors index: weight_map is not a map of tensor names to "
                                "shard files beside it")
    return found


def weight_facts(directory: Path) -> dict[str, Any] | None:
    """``{"weights": {"finite", "non_finite"}, "tensors": {name: count}}`` over every float
    tensor of the model's safetensors files; None where there are none."""
    files = weight_files(directory)
    if not files:
        return None
    counts: dict[str, int] = {}
    for path in files:
        tf = TensorFile(str(path))
        for name in tf.names():
            bad = _non_finite_count(tf.header[name]["dtype"], tf.tensor(name))
            if bad:
                counts[name] = bad
    total = sum(counts.values())
    return {"weights": {"finite": total == 0, "non_finite": total}, "tensors": counts}


def _non_finite_count(dtype: str, values: np.ndarray) -> int:
    flat = values.reshape(-1)
    total = 0
    for start in range(0, flat.size, PASS):
        chunk = flat[start:start + PASS]
        if dtype == "BF16":                    # uint16 bits: exponent all ones is NaN or inf
            total += int(np.count_nonzero((chunk & 0x7F80) == 0x7F80))
        elif dtype in FLOATS:
            total += int(chunk.size - np.count_nonzero(np.isfinite(chunk)))
    return total


def non_finite(record: dict[str, Any]) -> int:
    """How many non-finite weights the record's facts count (0 where none were recorded)."""
    facts = record.get("facts")
    weights = facts.get("weights") if isinstance(facts, dict) else None
    count = weights.get("non_finite") if isinstance(weights, dict) else 0
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0
