"""How a generation goes back into a loop, whatever its framework: the order of a restore, with
the state side's checks and copies (``StateSide.plan``, ``load``) at their places in it.

1. Leftovers of interrupted saves are swept (rank 0). A ``source`` that is one of this run's own
   older generations is refused (going back must never delete good generations: fork instead).
2. The generation is chosen (``StateSide.choose``: the newest valid one, hashed, agreed by every
   rank, across the recovery tiers) or given (``source``: hashed when opened). A run whose only
   files are the uncommitted leftovers of an interrupted first save starts fresh; one of bare
   checkpoints no ckptfmt writer ever held is refused (a fresh start would replace them).
3. Its manifest is viewed through the loop's ``upgrade`` hook, its resume fields checked to be
   objects, and the loop's ``on_restore`` hook sees it (its own refusals).
4. The state side checks everything (``plan``): a refusal there changes nothing. Other software
   versions than the generation's are said. Then the state side copies the values (``load``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from .. import facts as valfacts
from .. import format as fmt
from .. import manifest as mf
from ..errors import NoValidGenerationError, RankDisagreementError, UnsupportedSetupError
from . import ramdirs, tiers
from .directory import Run
from .lock import first_writer, keep_unwritten
from ..version import software_versions
from .stateside import Restored, Resuming, StateSide
from ..warn import warn

__all__ = ["choose_here", "refuse_rollback", "restore", "versions_changed"]

Agree = Callable[..., tuple[bool, ...]]


def restore(at: Resuming, side: StateSide, source: Any = None, allow_nonfinite: bool = False,
            options: Mapping[str, Any] | None = None) -> Restored:
    """The newest valid generation of ``at.run`` (or ``source``) put back through ``side``; what
    was restored (its step None on a fresh run). ``options`` go to ``side.plan``."""
    if at.rank == 0:
        removed = at.run.sweep_temps()
        if removed:
            at.log(f"removed {len(removed)} leftovers of interrupted saves (temp files, uploads)", info=True)
    if source is not None:
        refuse_rollback(at.run, source)
    path, why, tier = (source, None, None) if source is not None else newest(at, side, allow_nonfinite)
    if path is None:
        return Restored()
    with at.run.open_at(path, verify=source is not None) as ck:
        bad = valfacts.diverged(ck.manifest)
        if bad:                    # asked for: a source, or allow_nonfinite
            at.log(f"{ck.path}: resuming a diverged generation ({valfacts.describe(bad)}), as asked")
        doc = dict(ck.manifest)
        if at.upgrade is not None:
            doc = at.upgrade(doc)
        mf.require_objects(mf.path_for(ck.path), doc)     # before any hook reads into them
        if at.on_restore is not None:
            at.on_restore(doc, ck.path)
        plan = side.plan(at, ck, doc, **(options or {}))
        versions_changed(at.log, doc, software_versions(side.versions()))
        fresh = side.load(at, ck, plan)
        metrics = doc.get("metrics")
        return Restored(ck.step, str(path), tuple(fresh), why, metrics if isinstance(metrics, dict) else {}, tier)


def versions_changed(log: Callable[..., None], doc: dict[str, Any], now: Mapping[str, str]) -> None:
    """Other software than the generation was saved with (``now``: ``software_versions``): the
    values resume exactly, but the next steps may not be bit-identical to an unbroken run's
    (kernels and RNG streams can change between versions). Said, never refused: a long run
    outlives its software."""
    saved = doc.get("versions")
    if not isinstance(saved, dict):
        return
    changed = [f"{k} {saved[k]} -> {now[k]}" for k in now if k in saved and saved[k] != now[k]]
    if changed:
        log(f"resuming under other versions than the checkpoint's ({', '.join(changed)}): the run "
            "goes on from the same values; bit-identity with an unbroken run is not promised")


def refuse_rollback(run: Run, source: Any) -> None:
    """Resuming this run from one of its own older generations would collide with the newer
    ones at the next save, and deleting them would lose good checkpoints: fork instead."""
    if run.path is None:             # a run on a store: one of its own by its URL
        prefix = run.where + "/"
        ours, name = str(source).startswith(prefix), str(source)[len(run.where) + 1:]
    else:
        src = Path(source).resolve()
        ours, name = src.parent == run.path.resolve(), src.name
    parsed = fmt.parse_name(name)
    if not ours or parsed is None:
        return
    later = [g.step for g in run.generations() if g.committed and g.step > parsed[0]]
    if later:
        raise UnsupportedSetupError(str(source), f"a generation of this run, which has newer ones "
                                                 f"(steps {later}); to go back, fork it: ckptfmt fork "
                                                 f"{run.where} --step STEP NEW_RUN, and resume NEW_RUN")


def newest(at: Resuming, side: StateSide, allow_nonfinite: bool = False) -> tuple[Any, str | None, str | None]:
    """(path of the newest valid finite generation across the recovery tiers, as ``side.choose``
    agrees it; why newer ones were passed over, or None; its tier, ``disk``, ``memory`` or
    ``peer``); (None, None, None) on a fresh run, and for only the uncommitted leftovers of an
    interrupted first save. Newer diverged generations (their recorded values hold NaN or inf)
    and newer RAM generations that do not verify are passed over and the log says which and why;
    ``allow_nonfinite`` resumes the newest valid one."""
    run = at.run
    try:
        answer = side.choose(run, allow_nonfinite)
        path, why = answer["path"], answer["why"]
        for note in answer["skipped"]:
            at.log(note)
        if why is not None and path is not None:
            at.log(f"{run.where}: resuming from the newest finite generation, "
                   f"{Path(path).name}, not a newer one: {why}; resuming a diverged generation "
                   "would only carry its NaN/inf on (restore(allow_nonfinite=True) or "
                   "`ckptfmt train --allow-nonfinite` resumes the newest)")
        return path, why if path is not None else None, answer["tier"]
    except (NoValidGenerationError, RankDisagreementError):
        agree = side.collective.agree
        if agree(tiers.has_manifests(run))[0]:
            raise                         # committed generations exist (on some node) and all fail: refuse
        _refuse_bare(run, agree)
        warn(f"{run.where}: only uncommitted leftovers of an interrupted first save; "
                      "starting fresh")
        return None, None, None


def choose_here(run: Run, allow_nonfinite: bool = False) -> dict[str, Any]:
    """``StateSide.choose`` as this process sees it: ``path`` of the newest valid generation (a
    ``.bin``, or a sharded generation's manifest), hashed, and finite unless ``allow_nonfinite``,
    across the recovery tiers when the run has a RAM tier (spec/RUN.md §13: ``tier`` says which,
    ``skipped`` which newer RAM generations did not verify); ``why`` says which newer diverged
    generations were passed over, None if none. Several ranks decide it once, on rank 0."""
    where = tiers.memory_dir(run)
    if where is not None:
        ramdirs.keep(where, wait=True)     # no `ckptfmt ram` removes it while it is chosen and read
    memory = tiers.memory_run(run)
    if memory is None:
        choice = run.choose(deep=True, allow_nonfinite=allow_nonfinite)
        gen, tier, skipped = run.chosen(choice), tiers.DISK, []
    else:
        choice = tiers.choose_across(run, memory, allow_nonfinite)
        gen, tier, skipped = choice.chosen(run.where), choice.tier, choice.notes(memory.path)
    path = None if gen is None else run.name_of(gen)
    return {"path": path, "why": choice.why() if choice.diverged else None,
            "tier": tier if gen is not None else None, "skipped": skipped}


def _refuse_bare(run: Run, agree: Agree) -> None:
    """A directory of manifest-less ``.bin`` files that no ckptfmt writer ever held is bare
    checkpoints (another trainer's, FORMAT §4.4), not our leftovers: a fresh start would replace
    them at its first save of the same step, so it is refused (every rank together)."""
    bare = [g.bin.name for g in run.generations() if g.bin is not None and g.manifest is None]
    if run.path is None:             # a run on a store is ckptfmt's from its first object: a leftover
        return
    if not agree(bool(bare) and first_writer(run.path))[0]:
        return
    keep_unwritten(run.path)
    raise UnsupportedSetupError(str(run.path), f"holds checkpoints without manifests ({', '.join(bare[:3])}"
                                + (", ..." if len(bare) > 3 else "") + ") and was never a ckptfmt run: "
                                "bare checkpoints (another trainer's), which a fresh start here would "
                                "replace; train in a new run directory (ckptfmt inspect, validate and "
                                "convert read them)")
