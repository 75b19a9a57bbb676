"""A Hugging Face Trainer ``checkpoint-N`` committed by its ckptfmt record, as a ``Generation``
(spec/RUN.md §12.2): the same type as a run's ``step_N`` generation, so choosing, checking,
listing and removing it go through the calls every other generation answers to.

The record ``ckptfmt-commit.json`` is written last, durably, after every file of the directory
(``tools.hfdir.commit``): each file with its size and blake3, the step, and what the Trainer
logged at that step; it is sealed as a manifest is (spec/FORMAT.md §4.7). A directory without it
is an incomplete save (or a Trainer without ``ckptfmt.hf.Checkpointing``); a file that differs
from its row (a flipped byte, a second save into the same directory) makes it stale. Torch-free.

>>> import json, tempfile, pathlib
>>> out = pathlib.Path(tempfile.mkdtemp()); d = out / "checkpoint-3"; d.mkdir()
>>> _ = (d / "trainer_state.json").write_text("{}")
>>> gen = checkpoints(out)[0]
>>> gen.step, gen.committed, gen.leftover()[1].startswith("no ckptfmt-commit.json")
(3, False, True)
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from . import atomic, fingerprint, fsio, seal
from . import format as fmt
from .errors import CheckpointError, UnsupportedSetupError
from .generation import Generation, Part
from .hfdirs import RECORD     # written last: its presence is the commit (spec/RUN.md §12.2)

__all__ = ["DELETING", "DIR_NAME", "FORMAT_ID", "RECORD", "HFCheckpoint", "checkpoints", "deleting", "files_of",
           "problems", "read_record", "step_of_dir", "sweep_deleting"]

FORMAT_ID = "ckptfmt-hf-checkpoint"
DIR_NAME = re.compile(r"checkpoint-([0-9]+)")
DELETING = ".ckptfmt-deleting."           # a checkpoint being removed: renamed first, never half there
NO_RECORD = f"no {RECORD}: an incomplete save, or a Trainer without ckptfmt.hf.Checkpointing (the record is " \
            "written last)"


def step_of_dir(path: "str | os.PathLike[str]") -> int | None:
    """N of a ``checkpoint-N`` name; None for any other name."""
    match = DIR_NAME.fullmatch(os.path.basename(os.fspath(path).rstrip("/")))
    return int(match.group(1)) if match else None


def files_of(directory: Path) -> list[str]:
    """Every regular file under ``directory`` (relative, '/'-separated, sorted), but the record,
    temp files of a durable write in progress and what ``checkpoint-N`` subdirectories hold
    (each its own checkpoint: an output directory is never one)."""
    out = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not DIR_NAME.fullmatch(d))
        for name in files:
            if name == RECORD or fmt.is_temp_name(name):
                continue
            full = Path(root) / name
            if full.is_file() and not full.is_symlink():
                out.append(full.relative_to(directory).as_posix())
    return sorted(out)


def read_record(directory: Path) -> dict[str, Any] | None:
    """The directory's record, its seal checked before any field is believed; None where there
    is none (an incomplete save, or a Trainer without the callback); ``CheckpointError`` where
    it is not one."""
    path = Path(directory) / RECORD
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointError(str(path), f"commit record unreadable: {exc}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(str(path), f"not a commit record (format {FORMAT_ID!r} with files expected)")
    seal.check(str(path), doc)                  # records written before the seal: unsealed
    if doc.get("format") != FORMAT_ID or not isinstance(doc.get("files"), dict):
        raise CheckpointError(str(path), f"not a commit record (format {FORMAT_ID!r} with files expected)")
    return doc


def problems(directory: "str | os.PathLike[str]", *, deep: bool = True) -> list[str]:
    """Why ``directory`` is not the committed checkpoint its record says (empty: verified):
    no record, a step other than the name's, a file missing, of another size or (``deep``)
    another blake3, a file the record does not name (written after it: stale)."""
    directory = Path(directory)
    try:
        record = read_record(directory)
    except CheckpointError as exc:
        return [str(exc)]
    if record is None:
        return [f"no {RECORD}: an incomplete save (the record is written last)"]
    out = []
    named = step_of_dir(directory)
    if named is not None and record.get("step") != named:
        out.append(f"{RECORD}: step {record.get('step')}, the directory is checkpoint-{named}")
    present = set(files_of(directory))
    for name, row in sorted(record["files"].items()):
        out.extend(_file_problem(directory, name, row, present, deep))
    out.extend(f"{name}: not in {RECORD}: written after the record (a second save made it stale)"
               for name in sorted(present - set(record["files"])))
    return out


def _file_problem(directory: Path, name: str, row: Any, present: set[str], deep: bool) -> list[str]:
    if name not in present:
        return [f"{name}: missing, the record names it"]
    size = (directory / name).stat().st_size
    if not isinstance(row, dict) or size != row.get("size"):
        return [f"{name}: size {size}, the record says {row.get('size') if isinstance(row, dict) else row}"]
    if deep:
        got = fingerprint.of_file(directory / name)
        if got != row.get("blake3"):
            return [f"{name}: {fingerprint.mismatch(str(row.get('blake3')), got, by='record')}"]
    return []


@dataclass
class HFCheckpoint(Generation):
    """A ``checkpoint-N`` directory as a generation: its ``directory``; ``manifest`` its record
    (None before the record is written); every file it holds is a part, the record last. Its
    step is the name's, else the record's."""
    directory: Path | None = None

    @classmethod
    def at(cls, directory: "str | os.PathLike[str]") -> "HFCheckpoint":
        """The checkpoint directory ``directory`` (read once: the record's presence and, where
        the name has none, its step)."""
        directory = Path(directory)
        record = directory / RECORD
        step = step_of_dir(directory)
        if step is None:
            try:
                step = (read_record(directory) or {}).get("step")
            except CheckpointError:
                step = None
        return cls(step if isinstance(step, int) else -1, manifest=record if os.path.lexists(record) else None,
                   directory=directory)

    @property
    def sharded(self) -> bool:
        return False

    @property
    def kind(self) -> str:
        return "hf-checkpoint"

    @property
    def payload(self) -> Path | None:
        return self.directory

    @property
    def path(self) -> Path | None:
        return self.directory

    @property
    def size(self) -> int | None:
        return fsio.tree_size(self.directory)

    def problems(self, *, deep: bool = True) -> list[str]:
        """Every way the directory differs from its record (``problems``); empty: it is the
        committed checkpoint the record says."""
        return problems(self.directory, deep=deep)

    def check(self, *, deep: bool = False, doc: dict[str, Any] | None = None) -> str | None:
        found = self.problems(deep=deep)
        return "; ".join(found) if found else None

    def leftover(self) -> tuple[Path, str] | None:
        return None if self.manifest is not None else (self.directory, NO_RECORD)

    def open(self, *, verify: bool = False):
        raise UnsupportedSetupError(str(self.directory), "a Hugging Face checkpoint is resumed by the Trainer "
                                    "(ckptfmt.hf.resume_path); ckptfmt convert makes a .bin of it")

    def read_manifest(self) -> dict[str, Any] | None:
        return read_record(self.directory)

    def parts(self, doc: dict[str, Any] | None = None, *, manifest: bool = True) -> list[Part]:
        """Every file the record names (its size and blake3 as recorded), then the record;
        names relative to the output directory (``checkpoint-N/model.safetensors``)."""
        doc = doc if doc is not None else self.read_manifest()
        if doc is None:
            raise CheckpointError(str(self.directory), NO_RECORD)
        base = self.directory.name
        rows = [Part(f"{base}/{name}", "file", row.get("size"), row.get("blake3"))
                for name, row in sorted(doc["files"].items()) if isinstance(row, dict)]
        rows += [Part(f"{base}/{RECORD}", "manifest")] if manifest else []
        return [replace(p, path=self._path(p.name)) for p in rows]

    def present(self) -> list[Path]:
        return [self.directory / name for name in files_of(self.directory)]

    def _path(self, name: str) -> Path | None:
        return self.directory.parent.joinpath(*name.split("/"))

    def copy_to(self, dest: "str | os.PathLike[str]", *, manifest: bool = True,
                progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
        for part in self.parts(manifest=False):
            atomic.make_durable_dir((Path(dest) / part.name).parent)
        return super().copy_to(dest, manifest=manifest, progress=progress)

    def remove(self) -> None:
        """The record first (durably: uncommitted from then on), then the directory renamed
        aside (the parent fsynced, so a crash never leaves half a ``checkpoint-N`` under its
        name), then deleted."""
        atomic.remove(self.directory / RECORD)
        aside = self.directory.with_name(f"{DELETING}{self.directory.name}.{os.getpid()}")
        os.rename(self.directory, aside)
        fsio.fsync_dir(str(self.directory.parent))
        shutil.rmtree(aside)


def checkpoints(output_dir: "str | os.PathLike[str]") -> list[HFCheckpoint]:
    """Every ``checkpoint-N`` directory (not a symlink) of a Trainer's output directory, newest
    first."""
    found = []
    for entry in os.scandir(output_dir):
        if step_of_dir(entry.name) is not None and entry.is_dir(follow_symlinks=False):
            found.append(HFCheckpoint.at(entry.path))
    return sorted(found, key=lambda g: g.step, reverse=True)


def deleting(output_dir: "str | os.PathLike[str]") -> list[Path]:
    """Directories a removal renamed aside and did not finish (a crash): uncommitted, to delete."""
    return sorted(p for p in Path(output_dir).glob(f"{DELETING}*") if p.is_dir() and not p.is_symlink())


def sweep_deleting(output_dir: "str | os.PathLike[str]") -> list[Path]:
    """Finish what ``deleting`` lists (their records went first); returns them."""
    found = deleting(output_dir)
    for path in found:
        shutil.rmtree(path, ignore_errors=True)     # another retention may be removing it now
    return found
