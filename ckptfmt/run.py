"""The run directory (spec/RUN.md): generations, latest-valid, one writer, retention, sidecars.

A generation is ``step_NNNNNN.bin`` + ``step_NNNNNN.json``; it is committed when both exist and
agree. "Latest" is found by checking, newest first, never by the highest number alone.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from . import atomic, fingerprint, fsio
from . import format as fmt
from . import manifest as mf
from . import reader, writer
from .errors import CheckpointError, NoValidGenerationError, RunLockedError, SaveError
from .history import History

LOCK = ".lock"
PINS = ".pins.json"
SAMPLES = ".samples.json"
STATE = ".state.json"
PIVOT = ".pivot.json"
ARCHIVE = "archive"


@dataclass
class Generation:
    step: int
    bin: Path | None = None
    manifest: Path | None = None
    shards: Path | None = None          # step_NNNNNN.shards/ of a sharded generation

    @property
    def committed(self) -> bool:
        return self.manifest is not None and (self.bin is not None or self.shards is not None)

    @property
    def size(self) -> int | None:
        if self.bin is not None:
            return self.bin.stat().st_size
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
        setattr(gen, {"bin": "bin", "json": "manifest", "shards": "shards"}[kind], root / name)
    out.generations = [gens[s] for s in sorted(gens)]
    return out


def check_generation(gen: Generation, *, deep: bool = False) -> str | None:
    """None when the generation is committed and valid, else the reason it is not."""
    if gen.bin is None and gen.shards is not None and gen.manifest is not None:
        from . import shards
        return shards.check(gen.manifest, deep=deep)
    if gen.bin is None and gen.shards is not None:
        return "not committed: shards without a manifest"
    if gen.bin is None:
        return "manifest without its .bin"
    if gen.manifest is None:
        return "not committed: no manifest"
    try:
        with reader.open(gen.bin, manifest="require", verify=deep) as ck:
            if ck.step != gen.step:
                return f"header step {ck.step} is not the name's step {gen.step}"
    except CheckpointError as exc:
        return exc.problem
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    return None


class RunLock:
    """An flock on ``RUN/.lock`` for the life of a writer; it dies with its process, so a lock
    left by a dead process is stale by construction and is taken over (and reported)."""

    def __init__(self, run: "str | os.PathLike[str]", purpose: str = "writer"):
        self.path = Path(run) / LOCK
        self.purpose = purpose
        self.fd: int | None = None
        self.stale: dict[str, Any] | None = None

    def acquire(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLockedError(str(self.path.parent), f"locked by {holder.get('purpose', 'a writer')} "
                                 f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}",
                                 got=holder) from None
        previous = _read_holder(fd)
        if previous.get("pid") and previous.get("pid") != os.getpid():
            self.stale = previous
        info = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}


def lock_holder(run: "str | os.PathLike[str]") -> dict[str, Any] | None:
    """Who holds the writer lock now, or None (used by ls and pivot)."""
    path = Path(run) / LOCK
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _read_holder(fd)
    finally:
        os.close(fd)


def plan_retention(steps: Iterable[int], *, keep_last: int, keep_every: int | None = None,
                   pinned: Iterable[int] = (), protect: Iterable[int] = ()) -> list[int]:
    """Pure policy: which of ``steps`` to delete. Keeps the last ``keep_last``, every multiple
    of ``keep_every`` (milestones), pinned steps and protected steps (the newest valid).

    >>> plan_retention([100, 200, 300, 400, 500], keep_last=2, keep_every=200)
    [100, 300]
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    ordered = sorted(set(steps))
    keep = set(ordered[-keep_last:]) | set(pinned) | set(protect)
    if keep_every:
        keep |= {s for s in ordered if s % keep_every == 0}
    return [s for s in ordered if s not in keep]


class Run:
    """A run directory. ``Run(path).latest()`` is the newest committed, valid generation."""

    def __init__(self, path: "str | os.PathLike[str]", *, create: bool = False):
        self.path = Path(path)
        if create and not self.path.is_dir():
            make_durable_dir(self.path)
        if not self.path.exists():
            raise FileNotFoundError(errno.ENOENT, "no such run directory", str(self.path))
        if not self.path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a run directory", str(self.path))
        self.history = History(self.path / ".loss.json")

    def listing(self) -> Listing:
        return list_dir(self.path)

    def generations(self) -> list[Generation]:
        return self.listing().generations

    def is_bare(self) -> bool:
        """A run of the original trainer: .bin files and no manifest at all."""
        gens = self.generations()
        return bool(gens) and all(g.manifest is None for g in gens)

    def latest(self, *, deep: bool = False, allow_bare: bool = False) -> Generation | None:
        """Newest valid generation; skips invalid ones with a warning saying why.

        None when the run has no generation at all; ``NoValidGenerationError`` when it has some
        but none is valid, so a resume never silently starts afresh.
        """
        gens = self.generations()
        if not gens:
            return None
        bare = allow_bare and self.is_bare()
        reasons = []
        for gen in reversed(gens):
            reason = _check_bare(gen) if bare else check_generation(gen, deep=deep)
            if reason is None:
                return gen
            reasons.append(f"step {gen.step}: {reason}")
            warnings.warn(f"{self.path}: skipping generation {gen.step}: {reason}", stacklevel=2)
        raise NoValidGenerationError(str(self.path), "no valid generation: " + "; ".join(reasons))

    def commit(self, step: int, weights: Any, m: Any, v: Any, *, manifest: dict[str, Any],
               n_params: int | None = None) -> writer.SaveResult:
        """Durably write and commit generation ``step``; a valid committed one is never
        overwritten. A damaged one (it fails the deep check, e.g. a bit flip after a resume
        fell back past it) is replaced, or the run could never pass that step again."""
        gen = next((g for g in self.generations() if g.step == step), None)
        if gen is not None and gen.committed and check_generation(gen, deep=True) is None:
            raise SaveError(str(gen.bin), "generation is committed already; refusing to overwrite")
        return writer.save_generation(self.path, step, weights, m, v, manifest=manifest,
                                      n_params=n_params, overwrite=gen is not None)

    # ------------------------------------------------------------ retention
    def pins(self) -> list[int]:
        return read_json(self.path / PINS, default=[])

    def pin(self, step: int, on: bool = True) -> list[int]:
        pins = set(self.pins())
        pins = pins | {step} if on else pins - {step}
        write_json(self.path / PINS, sorted(pins))
        return sorted(pins)

    def plan_gc(self, *, keep_last: int, keep_every: int | None = None) -> tuple[list[Generation], Generation | None]:
        """(generations to delete, newest valid) after verify-before-delete of the newest."""
        committed = [g for g in self.generations() if g.committed]
        newest = self.latest(deep=True) if committed else None
        doomed = plan_retention([g.step for g in committed], keep_last=keep_last, keep_every=keep_every,
                                pinned=self.pins(), protect=[newest.step] if newest else [])
        return [g for g in committed if g.step in doomed], newest

    def gc(self, *, keep_last: int, keep_every: int | None = None, dry_run: bool = False) -> list[int]:
        """Delete what the policy allows; the manifest goes first, so a crash leaves uncommitted."""
        doomed, _ = self.plan_gc(keep_last=keep_last, keep_every=keep_every)
        if not dry_run:
            for gen in doomed:
                if gen.bin is None and gen.shards is not None:
                    from . import shards
                    shards.remove(gen.manifest, gen.shards)
                    continue
                atomic.remove(gen.manifest)
                atomic.remove(gen.bin)
        return [g.step for g in doomed]

    def sweep_temps(self) -> list[Path]:
        """Remove orphan temp files of our own pattern (killed saves); nothing else."""
        removed = []
        for temp in self.listing().temps:
            if temp.is_file() and not temp.is_symlink():
                atomic.remove(temp)
                removed.append(temp)
        return removed

    # ------------------------------------------------------------ sidecars
    def read_sidecar(self, name: str, default: Any = None) -> Any:
        return read_json(self.path / name, default=default)

    def write_sidecar(self, name: str, value: Any) -> None:
        write_json(self.path / name, value)


def _check_bare(gen: Generation) -> str | None:
    if gen.bin is None:
        return "manifest without its .bin"
    try:
        step, _, _ = reader.read_header(gen.bin)
    except CheckpointError as exc:
        return exc.problem
    return None if step == gen.step else f"header step {step} is not the name's step {gen.step}"


def make_durable_dir(path: Path) -> None:
    """mkdir -p, fsyncing each parent whose entry was created, so a new run directory survives
    a power cut together with the first generation committed into it."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        fsio.fsync_dir(str(d.parent))


def read_json(path: "str | os.PathLike[str]", default: Any = None) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return default
    except ValueError as exc:
        raise CheckpointError(str(path), f"not valid JSON: {exc}") from None


def write_json(path: "str | os.PathLike[str]", value: Any) -> None:
    atomic.write_bytes(path, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


def copy_verified(src: Path, dst: Path, expected: str | None, progress=None) -> str:
    """Copy through the durable write, hashing as it goes; refuse a copy whose hash differs."""
    size = src.stat().st_size
    with open(src, "rb") as f, atomic.AtomicWriter(dst) as out:
        h = fingerprint.hasher(0)
        while True:
            chunk = f.read(writer.CHUNK)
            if not chunk:
                break
            h.update(chunk)
            out.write(chunk)
            if progress is not None:
                progress(len(chunk))
        digest = h.hexdigest()
        if expected is not None and digest != expected:
            raise SaveError(str(dst), f"copy of {src} hashes to {digest}, expected {expected}")
        if out.offset != size:
            raise SaveError(str(dst), f"copied {out.offset} bytes, source has {size}")
        out.commit()
    return digest
