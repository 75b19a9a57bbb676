"""What a Hugging Face directory is, by its entries (spec/RUN.md §12): a Trainer's output
directory of ``checkpoint-N`` directories, one ``checkpoint-N``, or a ``save_pretrained`` model.
The kinds registry (``ckptfmt.kinds``) asks these; nothing here opens a file."""
from __future__ import annotations

import os

from . import format as fmt

__all__ = ["RECORD", "MARKERS", "WEIGHTS", "MODEL", "ENTRIES", "is_checkpoint", "is_model", "is_output", "checkpoint_dirs"]

RECORD = "ckptfmt-commit.json"      # ckptfmt's commit record in a checkpoint-N (RUN.md §12.2)
MARKERS = (RECORD, "trainer_state.json")                   # a Trainer checkpoint-N (RUN.md §12)
WEIGHTS = ("model.safetensors.index.json", "model.safetensors")   # a save_pretrained model
MODEL = WEIGHTS + ("pytorch_model.bin",)                          # ... or one without safetensors
ENTRIES = 4096             # entries of a directory looked at for checkpoint-N directories


def is_checkpoint(path: str) -> bool:
    """A Trainer ``checkpoint-N`` directory: ckptfmt's commit record or the Trainer's
    ``trainer_state.json`` in it, and no ``checkpoint-N`` directory (an output directory after
    ``save_model``/``save_state`` has the markers too: an output directory)."""
    return any(os.path.isfile(os.path.join(path, n)) for n in MARKERS) and not checkpoint_dirs(path)


def is_model(path: str) -> bool:
    """A ``save_pretrained`` directory: ``model.safetensors``, its sharded index or (written with
    ``safe_serialization=False``) ``pytorch_model.bin`` in it, and no ``step_N`` generation (a run
    directory may hold a ``pytorch_model.bin`` beside its generations)."""
    return any(os.path.isfile(os.path.join(path, n)) for n in MODEL) and \
        not any(fmt.parse_name(name) is not None for name, _ in _entries(path))


def is_output(path: str) -> bool:
    """A Trainer's output directory: ``checkpoint-N`` directories holding a marker or the
    Trainer's weights (the first ``ENTRIES`` entries looked at), whatever the top level holds
    (``save_model`` writes the model there too), and no ``step_N`` generation."""
    entries = _entries(path)
    if any(fmt.parse_name(name) is not None for name, _ in entries):
        return False
    return any(os.path.isfile(os.path.join(path, name, m))
               for name, is_checkpoint_dir in entries if is_checkpoint_dir for m in MARKERS + WEIGHTS)


def checkpoint_dirs(path: str) -> list[str]:
    """The ``checkpoint-N`` directories among the first ``ENTRIES`` entries of ``path``."""
    return [name for name, is_checkpoint_dir in _entries(path) if is_checkpoint_dir]


def _entries(path: str) -> list[tuple[str, bool]]:
    """(name, is a ``checkpoint-N`` directory) of the first ``ENTRIES`` entries of ``path``."""
    try:
        with os.scandir(path) as entries:
            return [(e.name, e.name.startswith("checkpoint-") and e.name[11:].isdigit() and
                     e.is_dir(follow_symlinks=False)) for _, e in zip(range(ENTRIES), entries)]
    except OSError:
        return []
