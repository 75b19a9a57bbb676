"""Generations of a run directory: listing them and checking each (spec/RUN.md §1-§2).

A generation is ``step_NNNNNN.bin`` + ``step_NNNNNN.json`` (or a sharded generation's
``step_NNNNNN.shards/`` + manifest); it is committed when both exist and agree.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .. import facts as valfacts
from .. import format as fmt
from .. import manifest as mf
from .. import atomic, reader, shards
from ..errors import CheckpointError


@dataclass
class Generation:
    step: int
    bin: Path | None = None
    manifest: Path | None = None
    shards: Path | None = None          # step_NNNNNN.shards/ of a sharded generation
    companion: Path | None = None       # step_NNNNNN.extra.safetensors (buffers, state tensors)

    @property
    def committed(self) -> bool:
        """Both halves exist: the manifest (the commit marker) and the .bin or shards."""
        return self.manifest is not None and (self.bin is not None or self.shards is not None)

    @property
    def size(self) -> int | None:
        """Bytes on disk of the .bin and its companion (or of all shards), None for a lone
        manifest."""
        if self.bin is not None:
            return self.bin.stat().st_size + (self.companion.stat().st_size if self.companion else 0)
        if self.shards is not None:
            return sum(e.stat().st_size for e in self.shards.iterdir() if e.is_file())
        return None


@dataclass
class Listing:
    generations: list[Generation] = field(default_factory=list)
    temps: list[Path] = field(default_factory=list)
    foreign: list[tuple[Path, str]] = field(default_factory=list)   # (entry, why skipped)


def list_dir(path: "str | os.PathLike[str]") -> Listing:
    """Classify every entry without following symlinks or opening anything."""
    root = Path(path)
    gens: dict[int, Generation] = {}
    out = Listing()
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        name = entry.name
        if fmt.is_temp_name(name):
            out.temps.append(root / name)
            continue
        parsed = fmt.parse_name(name)
        if parsed is None:
            if name.startswith("step_"):
                out.foreign.append((root / name, "look-alike name, not a canonical step_NNNNNN"))
            continue
        step, kind = parsed
        if kind == "shards":
            if not entry.is_dir(follow_symlinks=False):
                out.foreign.append((root / name, "a .shards entry that is not a directory"))
                continue
        elif not entry.is_file(follow_symlinks=False):
            out.foreign.append((root / name, "not a regular file (symlink, directory or device)"))
            continue
        gen = gens.setdefault(step, Generation(step))
        setattr(gen, {"bin": "bin", "json": "manifest", "shards": "shards",
                      "companion": "companion"}[kind], root / name)
    out.generations = [gens[s] for s in sorted(gens)]
    return out


def check_generation(gen: Generation, *, deep: bool = False) -> str | None:
    """None when the generation is committed and valid, else the reason it is not."""
    if gen.bin is None and gen.shards is not None and gen.manifest is not None:
        return shards.check(gen.manifest, deep=deep)
    if gen.bin is None and gen.shards is not None:
        return "not committed: shards without a manifest"
    if gen.bin is None:
        return "manifest without its .bin"
    if gen.manifest is None:
        return "not committed: no manifest"
    return _opens(gen.bin, manifest="require", verify=deep)


def _opens(path: Path, **how: object) -> str | None:
    """None when ``reader.open`` accepts the file (its header, size, name and, as asked,
    manifest and hash), else why not: the reader's own message, so a rule has one wording."""
    try:
        with reader.open(path, **how):
            return None
    except CheckpointError as exc:
        return exc.problem
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"


def manifest_of(gen: Generation) -> dict | None:
    """The generation's manifest, None where there is none or it cannot be read (the checks
    that report why are ``check_generation``'s)."""
    if gen.manifest is None:
        return None
    try:
        return mf.read(gen.manifest)
    except (CheckpointError, OSError):
        return None


def non_finite(gen: Generation) -> dict[str, int]:
    """{region: count} of the NaN and inf values the generation's manifest recorded at save
    (spec/FORMAT.md §5.9): non-empty means the generation is *diverged*. Empty when it is
    finite, or nothing is known (no manifest, no facts, unreadable: other checks report that).
    The facts describe the bytes only while their blake3 matches; callers that act on them
    check that too (``check_generation(deep=True)``)."""
    doc = manifest_of(gen)
    try:
        return valfacts.diverged(doc) if doc is not None else {}
    except CheckpointError:
        return {}


def check_bare(gen: Generation) -> str | None:
    """``check_generation`` for a run of the original trainer, which wrote no manifests: the
    header, the size law and the name are all there is to check."""
    if gen.bin is None:
        return "manifest without its .bin"
    return _opens(gen.bin, manifest="ignore")


def remove(gen: Generation) -> None:
    """Uncommit (manifest first), then remove the data: only files of our own naming, and the
    shard directory of a sharded one (committed, or interrupted before its manifest)."""
    if gen.manifest is not None and gen.bin is None and gen.shards is not None:
        shards.remove(gen.manifest, gen.shards)
        return
    if gen.manifest is not None:
        atomic.remove(gen.manifest)
    if gen.shards is not None:
        shutil.rmtree(gen.shards, ignore_errors=True)
    for part in (gen.bin, gen.companion):
        if part is not None:
            atomic.remove(part)
