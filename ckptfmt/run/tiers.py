"""Recovery tiers (spec/RUN.md §13): the run directory (durable) and a RAM tier beside it.

The RAM tier is a second run directory in node-local shared memory, ``/dev/shm/ckptfmt-<uid>/<run
id>/`` (``CKPTFMT_MEMORY_DIR`` instead of ``/dev/shm/ckptfmt-<uid>``), whose generations are written
the same way as the durable ones (``.bin`` + manifest + companion, blake3, the atomic commit).
It is keyed by the run's ID, not its path: ``.run-id.json``, written once (atomically) by the
first writer that uses the tier, so a run directory deleted and recreated gets a new ID and never
finds the old run's RAM generations. No copy of a run (fork, export, mirror) carries the ID.

A restore takes the newest generation that verifies (blake3) across both tiers, the durable one
first at the same step; a RAM generation that is damaged, incomplete or diverged is passed over
with its reason (``choose_across``). RAM generations newer than the step a run resumed from
belong to a lost timeline and are removed (``forget_after``).

>>> import tempfile
>>> run = Run(tempfile.mkdtemp())
>>> memory_dir(run) is None, run_id(run, create=True) == run_id(run), memory_dir(run).parent == memory_root()
(True, True, True)
"""
from __future__ import annotations

import os
import re
import stat
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import atomic
from ..errors import CheckpointError, NoValidGenerationError
from ..facts import describe
from .directory import Run
from ..generation import Generation, list_dir
from .generations import non_finite
from .retention import Candidate, Policy, guarded
from ..warn import warn

RUN_ID = ".run-id.json"
MEMORY_ENV = "CKPTFMT_MEMORY_DIR"
SHARED_MEMORY = Path("/dev/shm")
LEGACY_MEMORY_ROOT = SHARED_MEMORY / "ckptfmt"   # one root shared by every user: what earlier versions wrote
MEMORY_KEEP = 2                        # the newest two RAM generations (one may be damaged)
DISK, MEMORY, PEER = "disk", "memory", "peer"   # PEER: from RAM, fetched from another node
NOTE = {MEMORY: " (RAM tier)", PEER: " (RAM tier, fetched from a peer node)"}   # after "resumed from X"
ID = re.compile(r"[0-9a-f]{32}")      # never a path of the sidecar's choosing


def in_ram(tier: str | None) -> bool:
    """A generation restored from RAM (this node's, or a peer's copy), not a durable one."""
    return tier in (MEMORY, PEER)


def memory_root() -> Path:
    """Where this user's RAM tiers live: ``$CKPTFMT_MEMORY_DIR``, else ``/dev/shm/ckptfmt-<uid>``
    (one root per user, made mode 0700: a second user's runs are never refused by the first
    user's directory, and never read its RAM generations)."""
    return Path(os.environ.get(MEMORY_ENV) or SHARED_MEMORY / f"ckptfmt-{os.getuid()}")


def legacy_root() -> Path | None:
    """The one shared root of older versions (``/dev/shm/ckptfmt``), still looked in where no
    ``$CKPTFMT_MEMORY_DIR`` is set, so an upgrade between a kill and its restart loses no RAM
    generation; None where the variable is set."""
    return None if os.environ.get(MEMORY_ENV) else LEGACY_MEMORY_ROOT


def owned(path: Path) -> bool:
    """``path`` is a directory of this user's, not a symbolic link to one (``lstat``)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def root_problem() -> str | None:
    """Why the default root (``/dev/shm/ckptfmt-<uid>``, no ``$CKPTFMT_MEMORY_DIR``) that exists
    is not to be used: a symbolic link, not a directory, another user's, or writable by others
    (anyone else could plant or remove generations there); None when it is fine or not there
    yet. A root named by ``$CKPTFMT_MEMORY_DIR`` is the user's own choice and not judged."""
    if os.environ.get(MEMORY_ENV):
        return None
    root = memory_root()
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be looked at ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is a symbolic link or not a directory"
    if st.st_uid != os.getuid():
        return f"belongs to user {st.st_uid}, not to this one ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"is writable by other users (mode {st.st_mode & 0o777:o}; ckptfmt makes it 700)"
    return None


def tier_dir(found: str) -> Path:
    """The RAM tier directory of run ID ``found``: under ``memory_root()``, or the legacy root's
    where only that one exists and is this user's (the run then goes on there)."""
    where = memory_root() / found
    legacy = legacy_root()
    if legacy is not None and not os.path.lexists(where) and owned(legacy / found):
        return legacy / found
    return where


def as_run(run: "Run | str | os.PathLike[str]") -> Run:
    """The run the tier serves: a ``Run`` (local or on a store), or a local run directory's path."""
    return run if isinstance(run, Run) else Run(run)


def run_id(run: "Run | str | os.PathLike[str]", *, create: bool = False) -> str | None:
    """The run's ID from its ``.run-id.json`` (a file, or an object of a run on a store); None
    when it has none (or a damaged one). ``create`` (the writer, holding the run lock): a new ID
    is written once, atomically, if there is none."""
    run = as_run(run)
    try:
        doc = run.read_sidecar(RUN_ID, default=None)
    except CheckpointError:
        doc = None                       # damaged: a new ID orphans the old RAM generations (safe)
    found = doc.get("id") if isinstance(doc, dict) else None
    if isinstance(found, str) and ID.fullmatch(found):
        return found
    if not create:
        return None
    new = uuid.uuid4().hex
    run.write_sidecar(RUN_ID, {"id": new, "created": round(time.time(), 3), "path": run.origin})
    return new


def memory_dir(run: "Run | str | os.PathLike[str]", *, create: bool = False) -> Path | None:
    """The run's RAM tier directory (made or not), None when the run has no ID or the tier would
    be under a default root not to be used (``root_problem``: nothing is read, written or
    removed there)."""
    found = run_id(run, create=create)
    if found is None:
        return None
    where = tier_dir(found)
    return None if where.parent == memory_root() and root_problem() is not None else where


def memory_run(run: "Run | str | os.PathLike[str]") -> Run | None:
    """The RAM tier as a ``Run`` when its directory exists (a reboot removes it), else None."""
    where = memory_dir(run)
    return Run(where) if where is not None and where.is_dir() else None


@dataclass
class TierChoice:
    """What a restore across tiers found, newest first: ``gen`` in ``tier`` (None: nothing
    valid), the newer diverged generations passed over and the newer invalid ones, each with its
    tier (``skipped``: (tier, step, reason))."""

    gen: Generation | None = None
    tier: str | None = None
    diverged: list[tuple[str, Generation, dict[str, int]]] = field(default_factory=list)
    skipped: list[tuple[str, int, str]] = field(default_factory=list)

    def why(self) -> str:
        """One line: why the newer diverged generations were passed over (as ``Choice.why``)."""
        passed = "; ".join(f"{g.step}{' (RAM)' if t == MEMORY else ''} ({describe(bad)})" for t, g, bad in self.diverged)
        return f"generation(s) {passed} diverged: their values, recorded at save, are not finite"

    def notes(self, memory: Path) -> list[str]:
        """One log line per RAM generation passed over because it did not verify."""
        return [f"{memory}: skipping RAM generation {step}: {reason}" for tier, step, reason in self.skipped
                if tier == MEMORY]

    def chosen(self, run: str) -> Generation | None:
        """``gen``, or the error of a run whose generations, in every tier, are all invalid or diverged."""
        if self.gen is not None or not (self.skipped or self.diverged):
            return self.gen
        if self.diverged:
            raise NoValidGenerationError(str(run), "no finite generation to resume from: " + self.why()
                                         + " (allow_nonfinite / --allow-nonfinite resumes the newest, "
                                         f"{self.diverged[0][1].step})")
        raise NoValidGenerationError(str(run), "no valid generation in any tier: " + "; ".join(
            f"{'RAM ' if t == MEMORY else ''}step {s}: {why}" for t, s, why in self.skipped))


def choose_across(run: Run, memory: Run | None, allow_nonfinite: bool = False) -> TierChoice:
    """The newest committed generation that verifies (deep: blake3) and is finite (unless
    ``allow_nonfinite``) in the run or its RAM tier; at the same step the durable one."""
    gens = [(g, DISK) for g in run.generations()] + [(g, MEMORY) for g in (memory.generations() if memory else [])]
    gens.sort(key=lambda pair: (pair[0].step, pair[1] == DISK))
    out = TierChoice()
    judges = {t: run.judge(deep=True, tier=t) for t in (DISK, MEMORY)}    # the history's root digests of each
    for gen, tier in reversed(gens):
        reason = judges[tier](gen)
        if reason is not None:
            out.skipped.append((tier, gen.step, reason))
            if tier == DISK:             # as Run.choose says it
                warn(f"{run.path}: skipping generation {gen.step}: {reason}")
            continue
        bad = {} if allow_nonfinite else non_finite(gen)
        if not bad:
            out.gen, out.tier = gen, tier
            return out
        out.diverged.append((tier, gen, bad))
    return out


def has_manifests(run: Run) -> bool:
    """Committed (or half-committed) generations exist in the run or its RAM tier: a resume
    that finds none valid is refused, never a fresh start."""
    memory = memory_run(run)
    return any(g.manifest is not None for r in (run, memory) if r is not None for g in r.generations())


def forget_after(run: "Run | str | os.PathLike[str]", step: int) -> list[int]:
    """Remove the RAM tier's generations newer than ``step`` (where the run resumed: they belong
    to a lost timeline) and its temp files of interrupted saves; the steps removed."""
    where = memory_dir(run)
    if where is None or not where.is_dir():
        return []
    return remove_generations(where, lambda s: s > step)


def remove_generations(where: Path, which: Callable[[int], bool]) -> list[int]:
    """In the tier ``where``: its temp files of interrupted saves and the generations whose
    step ``which`` takes (manifest first); the steps removed."""
    listing = list_dir(where)
    for temp in listing.temps:
        if temp.is_file() and not temp.is_symlink():
            atomic.remove(temp)
    gone = [g for g in listing.generations if which(g.step)]
    for gen in gone:
        gen.remove()
    return [g.step for g in gone]


def prune(where: Path, keep: int = MEMORY_KEEP) -> list[int]:
    """The RAM tier's retention: the run layer's one plan (``retention.guarded``) with the policy
    ``keep_last=keep`` over its committed steps, and no verified guards (nothing is hashed: a
    restore checks what it takes, and on more than one node a tier may hold only some shards of
    a generation); uncommitted ones older than the oldest kept go too. The steps removed."""
    gens = list_dir(where).generations
    chosen = guarded(Policy(keep_last=keep), [Candidate(g.step) for g in gens if g.manifest is not None], None)
    oldest = min(chosen.kept, default=None)
    gone = [g for g in gens if g.step in chosen.doomed or (oldest is not None and g.step < oldest)]
    for gen in gone:
        gen.remove()
    return [g.step for g in gone]


def listing(run: "Run | str | os.PathLike[str]") -> dict[str, Any] | None:
    """What ``ls`` says of the RAM tier: its directory, the run ID and whether it exists
    (generations: the caller's rows); None when the run has no ID."""
    found = run_id(run)
    if found is None:
        return None
    where = tier_dir(found)
    return {"dir": str(where), "run_id": found, "present": where.is_dir()}
