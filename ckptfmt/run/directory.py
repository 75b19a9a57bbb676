"""The run directory (spec/RUN.md): generations, latest-valid, commit, pins, retention, sidecars.

"Latest" is found by checking, newest first, never by the highest number alone.
"""
from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import atomic, companion, fsio, shards, writer
from ..errors import (GenerationNotFoundError, NoValidGenerationError, SaveError,
                      SidecarError, UnsupportedSetupError)
from ..facts import describe
from ..generation import Generation, Listing, at, list_dir
from .generations import check_bare, manifest_of, non_finite
from .history import NAME, History, complete_length
from .lease import ReadLease, honoured
from .lock import RunLock, lock_holder, sidecar_in_progress
from .roots import mismatch, of_step, recorded
from .retention import Candidate, Guards, Plan, Policy, candidate_for, find_guards, guarded
from .sidecars import PINS, archive, read_json, write_json
from ..warn import warn


@dataclass
class Choice:
    """What latest-valid found, newest first: the walk's ``guards`` (``retention.find_guards``,
    what retention protects), and from them ``gen`` the generation to resume (None when there is
    none), ``diverged`` the newer valid generations it passed because their recorded facts count
    NaN or inf values (``non_finite[step]`` says where); ``reasons`` why others were invalid."""

    guards: Guards = field(default_factory=Guards)
    reasons: list[str] = field(default_factory=list)

    @property
    def gen(self) -> Generation | None:
        return self.guards.finite

    @property
    def diverged(self) -> list[Generation]:
        return self.guards.diverged

    @property
    def non_finite(self) -> dict[int, dict[str, int]]:
        return self.guards.non_finite

    @property
    def newest_valid(self) -> Generation | None:
        """The newest committed valid generation, diverged or not (never to be deleted)."""
        return self.guards.valid

    def why(self) -> str:
        """One line: why the newer diverged generations were passed over."""
        passed = "; ".join(f"{g.step} ({describe(self.non_finite[g.step])})" for g in self.diverged)
        return f"generation(s) {passed} diverged: their values, recorded at save, are not finite"


class Run:
    """A run directory. ``Run(path).latest()`` is the newest committed, valid generation.
    (A run on a store, object storage, is ``storerun.StoreRun``: the same calls.)

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.run import Run
        >>> os.makedirs("run-dir", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> for step in (10, 20):
        ...     _ = ckptfmt.save_generation("run-dir", step, z, z, z)
        >>> run = Run("run-dir")
        >>> run.latest().step, [g.step for g in run.generations()]
        (20, [10, 20])
    """

    retention_deep = True      # retention verifies the newest by its blake3 before deleting

    def __init__(self, path: "str | os.PathLike[str]", *, create: bool = False):
        fsio.refuse_url(path, "a run directory")       # never the local directory s3:/bucket/...
        self.path = Path(path)
        if create and not self.path.is_dir():
            atomic.make_durable_dir(self.path)
        if not self.path.exists():
            raise FileNotFoundError(errno.ENOENT, "no such run directory", str(self.path))
        if not self.path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a run directory", str(self.path))
        self.where = str(self.path)             # the run as messages name it
        self.history: Any = History(self.path / ".loss.json")
        self._vouched: dict[int, str] = {}    # roots this writer committed, before its events say so

    def __fspath__(self) -> str:
        """A ``Run`` is a path-like of its directory: what takes a run directory's path (the
        sidecar rules, ``os`` and ``pathlib``) takes the ``Run``."""
        return str(self.path)

    @property
    def origin(self) -> str:
        """The run as provenance names it (a fork's parent, an export's source): its absolute path."""
        return str(self.path.resolve())

    def reading(self, purpose: str) -> Any:
        """A reader's lease (spec/RUN.md §5.3), as a context: ``listing`` the run as it was
        listed, its committed generations kept by retention until the end, or fewer (``narrow``)."""
        return ReadLease(self.path, purpose=purpose)

    def listing(self) -> Listing:
        """Every entry classified: generations, temp files of interrupted saves, foreign names."""
        return list_dir(self.path)

    def generations(self) -> list[Generation]:
        """Generations in step order, committed or not (see ``Generation.committed``)."""
        return self.listing().generations

    def is_bare(self) -> bool:
        """A run of the original trainer: .bin files and no manifest at all."""
        gens = self.generations()
        return bool(gens) and all(g.manifest is None for g in gens)

    def latest(self, *, deep: bool = False, allow_bare: bool = False,
               allow_nonfinite: bool = False, among: list[Generation] | None = None) -> Generation | None:
        """Newest valid *finite* generation; skips invalid ones with a warning saying why, and
        diverged ones (facts recorded at save count NaN or inf: spec/RUN.md §2.1) unless
        ``allow_nonfinite``.

        None when the run has no generation at all; ``NoValidGenerationError`` when it has some
        but none is valid (or every valid one diverged), so a resume never silently starts afresh.
        ``among``: choose from these (a reader's leased listing) instead of listing the directory now.
        """
        choice = self.choose(deep=deep, allow_bare=allow_bare, allow_nonfinite=allow_nonfinite, among=among)
        if choice.diverged and choice.gen is not None:
            warn(f"{self.where}: latest finite generation is {choice.gen.step}: {choice.why()} "
                          "(allow_nonfinite=True picks the newest)")
        return self.chosen(choice)

    def chosen(self, choice: Choice) -> Generation | None:
        """``choice.gen``, or the error of a run whose generations are all invalid or diverged."""
        if choice.gen is not None or not (choice.reasons or choice.diverged):
            return choice.gen
        if choice.diverged:
            raise NoValidGenerationError(self.where, "no finite generation to resume from: "
                                         + choice.why() + " (allow_nonfinite / --allow-nonfinite "
                                         f"resumes the newest, {choice.diverged[0].step})")
        raise NoValidGenerationError(self.where, "no valid generation: " + "; ".join(choice.reasons))

    def judge(self, *, deep: bool = False, tier: str = "disk") -> Callable[[Generation], str | None]:
        """The check latest-valid makes of each generation: ``Generation.check`` (``deep``: the
        blake3 too), then that it is the generation the run committed at its step (its root
        digest is the one the history records, ``roots.mismatch``; the history is read once, at
        the first generation that gets that far). ``tier="memory"``: the run's RAM-tier
        generations, by the history's RAM checkpoint events. None, or why not. A mismatch
        reads the history once more: a live writer records a root before it commits the
        manifest (§3.7), so a generation committed since the first reading is not called
        another's."""
        roots: dict[int, str] | None = None
        fresh = False

        def reason(gen: Generation) -> str | None:
            nonlocal roots, fresh
            why = gen.check(deep=deep)
            if why is not None or gen.manifest is None:
                return why
            if roots is None:
                roots = self._recorded(tier)
            why = mismatch(gen, roots)
            if why is not None and not fresh:
                roots, fresh = self._recorded(tier), True
                why = mismatch(gen, roots)
            return why
        return reason

    def _recorded(self, tier: str) -> dict[int, str]:
        """The root digest the history records for each step of ``tier`` (``roots.recorded``),
        the disk's with what this writer vouches for."""
        roots = self._history_roots(tier)
        if tier == "disk":
            roots.update(self._vouched)
        return roots

    def name_of(self, gen: Generation) -> str:
        """The generation as a file names it (``generation_at`` takes it back): its path."""
        return str(gen.path)

    def generation_at(self, path: "str | os.PathLike[str]") -> Generation:
        """The generation a file of it names (``generation.at``)."""
        return at(path)

    def open_at(self, path: "str | os.PathLike[str]", *, verify: bool = False) -> Any:
        """The checkpoint of the generation a file of it names (``Generation.open``)."""
        return self.generation_at(path).open(verify=verify)

    def _history_roots(self, tier: str) -> dict[int, str]:
        return recorded(self.history.path, tier=tier)

    def writer_lock(self, purpose: str, **how: Any) -> Any:
        """The run's writer lock, held (``release()`` gives it back; spec/RUN.md §4); ``how``:
        ``RunLock``'s options."""
        return RunLock(self.path, purpose=purpose, **how).acquire()

    def manifest_root(self, step: int) -> str | None:
        """The root digest generation ``step``'s manifest records (None: none readable)."""
        return of_step(self.path, step)

    def vouch(self, step: int) -> None:
        """This writer has just committed generation ``step``: until its ``checkpoint`` event
        names it (written after the commit, and after retention), ``judge`` takes its manifest's
        root as recorded, so an older record of the step (a timeline the run fell back from)
        does not make retention delete it."""
        root = self.manifest_root(step)
        if root is not None:
            self._vouched[step] = root

    def committed_root(self, step: int) -> str | None:
        """The root digest of generation ``step`` as this writer committed it (``vouch``), read
        from its manifest otherwise: what its ``checkpoint`` event records."""
        return self._vouched.get(step) or self.manifest_root(step)

    def choose(self, *, deep: bool = False, allow_bare: bool = False, allow_nonfinite: bool = False,
               among: list[Generation] | None = None) -> Choice:
        """Latest-valid as data (``latest`` without raising): walks generations newest first."""
        gens = self.generations() if among is None else among
        bare = allow_bare and bool(gens) and all(g.manifest is None for g in gens)     # is_bare() of these
        judge = check_bare if bare else self.judge(deep=deep)

        def check(gen: Generation) -> str | None:
            reason = judge(gen)
            if reason is not None:
                warn(f"{self.where}: skipping generation {gen.step}: {reason}")
            return reason
        found = find_guards(reversed(gens), check=check,
                            non_finite=lambda g: {} if bare or allow_nonfinite else non_finite(g))
        return Choice(found, [f"step {gen.step}: {why}" for gen, why in found.invalid])

    def commit(self, step: int, weights: Any, m: Any, v: Any, *, manifest: dict[str, Any],
               n_params: int | None = None, extra_tensors: dict[str, Any] | None = None,
               before_commit: Callable[[dict[str, Any]], None] | None = None) -> writer.SaveResult:
        """Durably write and commit generation ``step``; a valid committed one is never
        overwritten. A damaged one (it fails the deep check, e.g. a bit flip after a resume fell
        back past it, or it is not the generation the history records for the step) is
        replaced, or the run could never pass that step again. ``before_commit``: as
        ``writer.save`` (the writer records the root it commits, §3.7)."""
        gen = next((g for g in self.generations() if g.step == step), None)
        if gen is not None and gen.committed and self.judge(deep=True)(gen) is None:
            bad = non_finite(gen)
            if not bad:
                raise SaveError(self.where + "/" + gen.path.name, "generation is committed already; refusing to overwrite")
            warn(f"{self.where}/{gen.path.name}: replacing diverged generation {step} ({describe(bad)}): the "
                          "run resumed from an earlier finite one and reached its step again")
        result = self._write(gen, step, weights, m, v, manifest=manifest, n_params=n_params,
                             extra_tensors=extra_tensors, before_commit=before_commit)
        self.vouch(step)
        return result

    def _write(self, gen: Generation | None, step: int, *regions: Any, **how: Any) -> writer.SaveResult:
        """The durable write of generation ``step`` over ``gen``, what is there of it (uncommitted
        first, then replaced)."""
        result = writer.save_generation(self.path, step, *regions, overwrite=gen is not None, **how)
        if gen is not None and gen.shards is not None:     # a damaged sharded one replaced by a .bin
            shutil.rmtree(gen.shards, ignore_errors=True)
        return result

    def write_shard(self, step: int, rank: int, world: int, start: int, stop: int, *regions: Any) -> dict[str, Any]:
        """This rank's shard of sharded generation ``step``, durable; its manifest row."""
        return shards.save_shard(self.path, step, rank, world, start, stop, *regions)

    def commit_shards(self, step: int, rows: list[dict[str, Any]], manifest: dict[str, Any] | None,
                      before_commit: Callable[[dict[str, Any]], None] | None = None,
                      extra_tensors: dict[str, Any] | None = None) -> None:
        """Rank 0, every shard durable: the companion (``extra_tensors``), then the manifest."""
        if extra_tensors:
            where = shards.shards_dir(self.path, step)
            manifest = {**(manifest or {}), companion.FIELD: companion.write(where, step, extra_tensors)}
        shards.commit(self.path, step, rows, manifest, before_commit)
        self.vouch(step)          # as commit does: retention after it must not take it for another's

    # ------------------------------------------------------------ retention
    def pins(self) -> list[int]:
        """Pinned steps: retention never deletes them. A pins file that is not a list of steps is
        a ``SidecarError`` (retention must not guess what it protects)."""
        pins = self.read_sidecar(PINS, default=[])
        if not isinstance(pins, list) or not all(type(s) is int for s in pins):
            raise SidecarError(f"{self.where}/{PINS}", f"expected a list of steps, got {pins!r:.60}")
        return pins

    def pin(self, step: int, on: bool = True) -> list[int]:
        """Pin (or with ``on=False`` unpin) ``step``; returns the pins after the change. Only a
        committed generation can be pinned (a pin on nothing would protect nothing, silently);
        unpinning works for any step, so a pin outliving its generation can be removed."""
        if on and not any(g.step == step and g.committed for g in self.generations()):
            raise GenerationNotFoundError(self.where, f"no committed generation at step {step} "
                                                          "to pin (see ckptfmt ls)")
        pins = set(self.pins())
        pins = pins | {step} if on else pins - {step}
        self.write_sidecar(PINS, sorted(pins))
        return sorted(pins)

    def plan_gc(self, policy: Policy | None = None, *, keep_last: int | None = None, keep_every: int | None = None,
                strict_metric: bool = False) -> tuple[list[Generation], Generation | None, Plan]:
        """(generations to delete, the newest valid finite one: what a restore takes, the plan
        with why each kept one is kept) after verify-before-delete of the newest. ``policy``, or
        one of ``keep_last``/``keep_every``.

        Protected whatever the rules say (the guards, spec/RUN.md §5.2): pins, the newest valid
        generation and the newest valid *finite* one, so generations that diverged (non-finite
        values) never push out the last good one (§5.4)."""
        policy = policy or Policy.by_count(keep_last, keep_every)
        committed = [g for g in self.generations() if g.committed]
        choice = self.choose(deep=self.retention_deep) if committed else Choice()
        if committed and choice.newest_valid is None:
            self.chosen(choice)            # raises: no valid generation
        chosen = self.retention_plan(policy, committed, choice, strict_metric)
        return [g for g in committed if g.step in set(chosen.doomed)], choice.gen, chosen

    def retention_plan(self, policy: Policy, committed: list[Generation], choice: Choice,
                       strict_metric: bool = False) -> Plan:
        """``policy`` over the ``committed`` generations with the guards of ``choice`` (what
        latest-valid found among them): pins, the newest valid and the newest finite one.
        ``strict_metric``: a best-K metric no generation records is refused (``gc``'s flags: a
        typo); without it, it is a metric not reported yet (a training loop's own policy)."""
        candidates = [candidate_for(policy, g.step, lambda g=g: manifest_of(g)) for g in committed]
        if strict_metric:
            self._check_metric(policy, candidates)
        return guarded(policy, candidates, choice.guards, pinned=self.pins())

    def _check_metric(self, policy: Policy, candidates: list[Candidate]) -> None:
        """A best-K by a metric no generation records is a mistake (a typo), refused before
        anything is deleted."""
        if policy.metric is not None and candidates and not any(policy.metric in c.metrics for c in candidates):
            known = sorted({m for c in candidates for m in c.metrics})
            raise UnsupportedSetupError(self.where, f"no generation records metric {policy.metric!r} "
                                        f"(recorded: {', '.join(known) or 'none'})")

    def gc(self, policy: Policy | None = None, *, keep_last: int | None = None,
           keep_every: int | None = None, dry_run: bool = False) -> list[int]:
        """Delete what the policy allows, less what live readers lease (spec/RUN.md §5.3: they
        are kept until the lease ends); the manifest goes first, so a crash leaves uncommitted."""
        return self.collect(policy or Policy.by_count(keep_last, keep_every),
                            dry_run=dry_run)[0]

    def collect(self, policy: Policy, *, dry_run: bool = False,
                strict_metric: bool = False) -> tuple[list[int], dict[int, list[str]], Generation | None]:
        """``gc`` that also says why each generation left is kept: (deleted steps, step -> reasons,
        a leased one with the reason ``leased``; the newest valid finite generation)."""
        doomed, resumable, chosen = self.plan_gc(policy, strict_metric=strict_metric)
        kept = dict(chosen.kept)
        with self.leases(sweep=not dry_run) as leased:
            for gen in doomed:
                if gen.step in leased:
                    kept[gen.step] = ["leased"]
            doomed = [g for g in doomed if g.step not in leased]
            if not dry_run:
                for gen in doomed:
                    gen.remove()
        return [g.step for g in doomed], dict(sorted(kept.items())), resumable

    def leases(self, *, sweep: bool) -> Any:
        """For retention: a context whose value is the steps live readers hold (§5.3)."""
        return honoured(self.path, sweep=sweep)

    def sweep_temps(self) -> list[Path]:
        """Remove orphan temp files of our own pattern (killed saves); nothing else: not a
        sidecar's temp file of a process still alive (``mirror --watch`` replacing
        ``.mirrors.json`` while the trainer restarts)."""
        removed = []
        for temp in self.listing().temps:
            if temp.is_file() and not temp.is_symlink() and not sidecar_in_progress(temp):
                atomic.remove(temp)
                removed.append(temp)
        return removed

    # ------------------------------------------------------------ sidecars
    def copy_sidecar(self, name: str, dst: Path) -> str | None:
        """Sidecar ``name`` (the history, samples, bandit state) as it is now, copied durably to
        ``dst``: its blake3, None where the run has none. A live run's history is copied up to
        its last complete line (every step up to a leased generation: it is synced before each
        commit); the others are replaced atomically, so one open file is one version."""
        src = self.path / name
        live = name == NAME and lock_holder(self.path) is not None
        try:
            return atomic.copy_verified(src, dst, None, length=complete_length(src) if live else None)
        except FileNotFoundError as exc:
            if exc.filename != str(src):
                raise
            return None

    def archive_sidecars(self, step: int, names: tuple[str, ...]) -> tuple[str, list[str]]:
        """A pivot's: the sidecars ``names`` that are there moved into the archive of ``step``
        (``sidecars.archive``): (its name in the run, the names moved)."""
        return archive(self.path, step, names)

    def read_sidecar(self, name: str, default: Any = None) -> Any:
        """The JSON of a sidecar (``SAMPLES``, ``STATE``, ...), or ``default`` if absent."""
        return read_json(self.path / name, default=default)

    def write_sidecar(self, name: str, value: Any) -> None:
        """Replace a sidecar atomically (temp, fsync, rename, fsync the directory)."""
        write_json(self.path / name, value)
