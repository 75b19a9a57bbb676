"""Operations on a whole run: ls, polish pivot, audit fork, bisect (spec/RUN.md §4-§7)."""
from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from .. import atomic, fsio, kinds
from .. import format as fmt
from .. import manifest as mf
from ..errors import (CheckpointError, DestinationExistsError, GenerationNotFoundError,
                      NoValidGenerationError, SidecarError)
from . import history as hist
from . import content, diagnosis, divergence, mirrors, ramdirs, roots, tiers, timeline
from .directory import Run
from .storefork import fork_to_store
from .storerun import open_run
from ..generation import Generation, list_dir
from .generations import check_bare, non_finite
from .lease import ReadLease, active_leases
from .lock import lock_holder, publish, refuse_live, save_in_progress, writing_into
from .retention import Policy
from .sidecars import PIVOT, POLICY, SAMPLES, STATE, recorded_policy


def ls_run(path: "str | os.PathLike[str]", *, deep: bool = False, keep_every: int | None = None,
           policy: Policy | None = None) -> dict[str, Any]:
    """Generations with status, pins, milestone marks (steps divisible by ``keep_every``), the
    metrics their manifests recorded and ``kept_by``: the rules and guards of ``policy`` (default:
    ``keep_every`` alone, or only pins) that keep each; a valid generation whose recorded facts
    count NaN or inf values has status ``diverged`` and says where (``non_finite``: region -> count).

    The listing is leased (spec/RUN.md §5.3), so a trainer's retention cannot delete a listed
    generation while it is checked; the live writer's unfinished save is "save in progress".

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.run import ls_run
        >>> os.makedirs("listed-run", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> for step in (10, 20):
        ...     _ = ckptfmt.save_generation("listed-run", step, z, z, z, manifest={"metrics": {"loss": 1.0 / step}})
        >>> [(g["step"], g["status"], g["metrics"]) for g in ls_run("listed-run")["generations"]]
        [(10, 'committed', {'loss': 0.1}), (20, 'committed', {'loss': 0.05})]
    """
    run = Run(path)
    holder = lock_holder(path)
    policy, shown = _ls_policy(path, policy or (Policy(keep_every=keep_every) if keep_every else None))
    keep_every = keep_every or (policy.keep_every if policy is not None else None)
    with ReadLease(path, purpose="ls") as lease:
        listing = lease.listing
        pins = set(run.pins())
        bare = bool(listing.generations) and all(g.manifest is None for g in listing.generations)
        judge = run.judge(deep=deep)
        rows = [_ls_row(gen, deep, pins, keep_every, holder, bare, judge) for gen in listing.generations]
        kept = _kept_by(run, listing.generations, policy, deep, pins, strict=shown["from"] == "given")
        for row in rows:
            row["kept_by"] = kept.get(row["step"], [])
        readers = active_leases(path, own=lease)
    in_progress = [t for t in listing.temps if save_in_progress(t, holder)]
    out = {"run": str(path), "deep": deep, "generations": rows,
           "leftovers": [str(t) for t in listing.temps if t not in in_progress],
           "in_progress": [str(t) for t in in_progress],
           "foreign": [skipped(p, why) for p, why in listing.foreign], "lock": holder, "leases": readers,
           "mirrors": mirrors.lag(path, [r["step"] for r in rows if r["committed"]]), "policy": shown}
    if lease.problem:
        out["lease_problem"] = lease.problem
    memory = memory_tier(run, deep)
    if memory is not None:
        out["tiers"] = {"memory": memory}
    return out


def memory_tier(run: Run, deep: bool) -> dict[str, Any] | None:
    """The run's RAM tier (spec/RUN.md §13) when it has one: its directory, the run ID, whether
    it is there (a reboot removes it) and its generations, each row marked ``tier: memory``. Not
    leased: the writer's RAM retention may remove a generation while it is listed."""
    found = tiers.listing(run)
    if found is None:
        return None
    gens: list[Generation] = []
    if found["present"]:
        with contextlib.suppress(OSError):
            gens = list_dir(found["dir"]).generations
    judge = run.judge(deep=deep, tier=tiers.MEMORY)      # the run's history names its RAM generations
    found["generations"] = [dict(_ls_row(g, deep, set(), None, None, judge=judge), tier=tiers.MEMORY) for g in gens]
    return found


def _ls_policy(path: "str | os.PathLike[str]", given: Policy | None) -> tuple[Policy | None, dict[str, Any]]:
    """The policy whose rules ``ls`` shows: the one given, else the one the run's writer
    recorded (spec/RUN.md §5.6), else none; with what ``ls`` says of it (``from``: ``given``,
    ``.policy.json`` or None; ``retention``: its rules, None where every generation is kept;
    ``problem`` for a damaged record)."""
    if given is not None:
        return given, {"from": "given", "retention": given.to_json()}
    try:
        found, recorded = recorded_policy(path)
    except SidecarError as exc:
        return given, {"from": None, "retention": None, "problem": str(exc)}
    shown = {"from": POLICY if found else None, "retention": recorded.to_json() if recorded else None}
    return recorded or given, shown


def skipped(path: Path, why: str) -> str:
    """A skipped entry of ``ls``, named by what it is where its content says so (ckptfmt's own
    ``step_000100.safetensors`` is a safetensors file, not a look-alike name, spec/FORMAT.md §8.6)."""
    if path.is_file() and not path.is_symlink():
        with contextlib.suppress(CheckpointError, OSError):
            kind = kinds.sniff(path)
            if kind.name != "bin":
                return f"{path}: a {kind.label}, not a generation (convert it into a step_N.bin to make it one)"
    return f"{path}: {why}"


def _ls_row(gen: Generation, deep: bool, pins: set[int], keep_every: int | None,
            holder: dict[str, Any] | None, bare: bool = False,
            judge: Callable[[Generation], str | None] | None = None) -> dict[str, Any]:
    """One generation's row of ``ls``; a part without its manifest is the live writer's save in
    progress when ``holder`` wrote it (``save_in_progress``). In a ``bare`` run (no manifest at
    all: the original trainer's) a ``.bin`` is checked as ``validate`` does: valid, unverified.
    ``judge``: the run's check (``Run.judge``: its history's root digests too); without it the
    generation's own."""
    bare = bare and gen.bin is not None and holder is None
    reason = check_bare(gen) if bare else judge(gen) if judge is not None else gen.check(deep=deep)
    bad = non_finite(gen) if reason is None else {}
    part = gen.payload or gen.companion
    if reason is not None and not gen.committed and part is not None and save_in_progress(part, holder):
        reason = "save in progress"
    name = gen.payload
    try:
        size, age = gen.size, round(time.time() - gen.any_part.stat().st_mtime, 1)
    except FileNotFoundError:       # not leased (uncommitted, or no lease possible): it went
        size, age, reason = None, None, reason or "removed while listing"
    return {"step": gen.step, "file": name.name if name else None, "size": size, "age_s": age,
            "committed": gen.committed, "valid": reason is None,
            "status": _damaged(reason, gen.manifest is not None or bare) or reason or (
                "bare (unverified)" if bare else "diverged" if bad else "verified" if deep else "committed"),
            "diverged": bool(bad), "non_finite": bad,
            "pinned": gen.step in pins, "milestone": bool(keep_every) and gen.step % keep_every == 0,
            "metrics": _metrics(gen) if reason is None else {}}


def _damaged(reason: str | None, made: bool) -> str | None:
    """``damaged: REASON`` for a generation that was made (a manifest commits it, or a bare
    run's ``.bin`` is all there is) and fails its check; None otherwise (valid, a save in
    progress, or never committed: the reason says so)."""
    if reason is None or not made or reason in ("save in progress", "removed while listing"):
        return None
    return f"damaged: {reason}"


def _metrics(gen: Generation) -> dict[str, Any]:
    """The metrics the generation's manifest recorded (spec/FORMAT.md §4), as recorded."""
    with contextlib.suppress(CheckpointError, OSError):
        metrics = mf.read(gen.manifest).get("metrics") if gen.manifest is not None else None
        return metrics if isinstance(metrics, dict) else {}
    return {}


def _kept_by(run: Run, gens: list[Generation], policy: Policy | None, deep: bool, pins: set[int],
             strict: bool) -> dict[int, list[str]]:
    """step -> what keeps it under ``policy`` (the plan ``gc`` would make, guards included);
    without a policy, only the pins. ``strict``: a metric no generation records is refused
    (flags given to ``ls``); the run's recorded policy may name one not reported yet."""
    if policy is None:
        return {s: ["pinned"] for s in pins}
    committed = [g for g in gens if g.committed]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # the rows say why a generation is invalid
        choice = run.choose(deep=deep, among=committed)
    return run.retention_plan(policy, committed, choice, strict_metric=strict).kept


def gc(path: "str | os.PathLike[str]", policy: Policy | None = None, *, keep_last: int | None = None,
       keep_every: int | None = None, dry_run: bool = False) -> dict[str, Any]:
    """Under the run lock: sweep temp files of killed saves (unless ``dry_run``), then delete
    what the retention policy allows (``policy``, or ``keep_last``/``keep_every``; verify-before-
    delete of the newest, spec/RUN.md §5); ``kept``: each generation left and why it is kept.
    The run's RAM tier loses what the newest valid finite durable generation covers (spec/RUN.md
    §13.10): ``memory``, where the run has a tier.

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.run import gc
        >>> os.makedirs("to-clean", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> for step in (10, 20, 30):
        ...     _ = ckptfmt.save_generation("to-clean", step, z, z, z)
        >>> done = gc("to-clean", keep_last=2)
        >>> done["deleted"], done["kept"]
        ([10], [{'step': 20, 'kept_by': ['last']}, {'step': 30, 'kept_by': ['last', 'newest valid']}])
    """
    run = open_run(path)           # a URL: a run on object storage (spec/RUN.md §2.0.2), its writer lease
    policy = policy or Policy.by_count(keep_last, keep_every)
    lock = run.writer_lock("gc", writes_generations=False)
    try:
        swept = [] if dry_run else [str(p) for p in run.sweep_temps()]
        deleted, kept, resumable = run.collect(policy, dry_run=dry_run, strict_metric=True)
        memory = ramdirs.collect(run, resumable.step if resumable else None, dry_run=dry_run)
    finally:
        lock.release()
    out = {"run": run.where, "dry_run": dry_run, "deleted": deleted,
           "kept": [{"step": s, "kept_by": why} for s, why in kept.items()], "swept_temps": swept}
    return out if memory is None else {**out, "tiers": {"memory": memory}}


def pivot(path: "str | os.PathLike[str]", *, note: str | None = None) -> dict[str, Any]:
    """Polish pivot: archive samples and bandit state by step, keep weights, m, v and the loss
    history, record the pivot. Refused while a writer holds the run (a URL: its writer lease).
    The step is the one the trainer resumes from (deep: a newest generation damaged after its
    commit is skipped).

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.run import pivot
        >>> os.makedirs("pivoted", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save_generation("pivoted", 30, z, z, z)
        >>> done = pivot("pivoted", note="new caps")
        >>> done["step"], done["note"], done["archive"]
        (30, 'new caps', 'archive/step_000030')
    """
    run = open_run(path)
    lock = run.writer_lock("pivot", writes_generations=False)
    try:
        gen = run.latest(deep=True)
        if gen is None:
            raise GenerationNotFoundError(run.where, "cannot pivot: the run has no committed generation")
        archive, moved = run.archive_sidecars(gen.step, (SAMPLES, STATE))
        record = {"step": gen.step, "note": note, "time": time.time(), "archived": moved, "archive": archive}
        run.write_sidecar(PIVOT, record)
        run.history.event("pivot", gen.step, note=note)
        run.history.sync()
        run.history.close()
    finally:
        lock.release()
    return record


def fork(path: "str | os.PathLike[str]", step: int, dest: "str | os.PathLike[str]") -> dict[str, Any]:
    """Audit fork: a new run from generation ``step`` (copy verified by fingerprint), the loss
    history up to ``step``, and provenance (parent run, step, fingerprint) in the new manifest.
    The generation is leased while it is copied, so a live trainer's retention keeps it. Either
    may be a URL: a run on object storage is read through its store, and a new run there is
    written through it (``storefork``).

    Examples:
        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.run import fork
        >>> os.makedirs("main-run", exist_ok=True)
        >>> z = np.zeros(2, np.float32)
        >>> for step in (10, 20):
        ...     _ = ckptfmt.save_generation("main-run", step, z, z, z)
        >>> fork("main-run", 10, "audit")["step"]
        10
        >>> sorted(os.listdir("audit"))                  # the history records the fork and its parent
        ['.loss.json', 'step_000010.bin', 'step_000010.json']
    """
    run = open_run(path)
    with run.reading("fork") as lease:
        gen = next((g for g in lease.listing.generations if g.step == step), None)
        if gen is None or not gen.committed:
            raise GenerationNotFoundError(run.where, f"no committed generation at step {step}")
        lease.narrow([step])
        reason = run.judge(deep=True)(gen)
        if reason:
            raise NoValidGenerationError(run.name_of(gen), f"cannot fork from it: {reason}")
        if fsio.is_url(dest):
            return fork_to_store(run, gen, os.fspath(dest))
        return _fork_from(run, gen, Path(dest))


def _fork_from(run: Run, gen: Generation, dest: Path) -> dict[str, Any]:
    """Build the fork in a sibling staging directory and rename it to ``dest`` (missing or
    empty) once complete: a fork that fails leaves nothing at ``dest`` (spec/RUN.md §6)."""
    refuse_live(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise DestinationExistsError(str(dest), "exists and is not empty; refusing to fork into it")
    made = atomic.missing_dirs(dest.parent)
    staging = dest.parent / f"{fmt.TEMP_PREFIX}fork.{dest.name}.{os.getpid()}"
    try:
        staging.mkdir(parents=True)
        with writing_into(staging, "fork") as lock:     # held through the rename: DEST's lock
            out = _fork_into(run, gen, staging)
            publish(staging, dest, lock)
        atomic.sync_dir_of(str(dest))
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        atomic.remove_dirs(made)      # only the ones this fork created
        _name_dest(exc, staging, dest)
        raise
    return {**out, "dest": str(dest)}


def _name_dest(exc: BaseException, staging: Path, dest: Path) -> None:
    """An error about a file in the staging directory names it at DEST, the path the user chose
    (a full disk: "DEST/step_000100.bin: ..." rather than ".ckptfmt-tmp.fork.DEST.PID/...")."""
    def moved(path: Any) -> Any:
        return str(dest) + path[len(str(staging)):] if isinstance(path, str) and path.startswith(str(staging)) else path
    if isinstance(exc, CheckpointError) and exc.path:
        exc.path = moved(exc.path)
        exc.args = (f"{exc.path}: {exc.problem}",)
    elif isinstance(exc, OSError):
        exc.filename = moved(exc.filename)


def _fork_into(run: Run, gen: Generation, dest: Path) -> dict[str, Any]:
    step = gen.step
    doc = gen.read_manifest()
    gen.copy_to(dest, manifest=False)          # every part against its recorded digest
    doc["provenance"] = {"parent_run": run.origin, "parent_step": step,
                         "parent_blake3": doc["blake3"], "forked_at": time.time()}
    mf.write(dest / gen.manifest.name, doc)
    upto = 0                                                # the canonical records of steps <= step
    child = hist.History(dest / hist.NAME)
    for rec in timeline.canonical(run.history.source):
        if rec["step"] > step:
            break
        child.append(hist.strict(rec))     # a NaN literal read back is written as "nan"
        upto += 1
    child.event("fork", step, parent_run=run.origin, root=roots.of_step(dest, step))
    child.sync()
    child.close()
    return {"dest": str(dest), "step": step, "blake3": doc["blake3"], "history_records": upto}


def bisect(path_a: "str | os.PathLike[str]", path_b: "str | os.PathLike[str]",
           ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """First step at which two runs' common generations differ in content (step, weights, m, v,
    companion; ``content.same``: a ``.bin`` and the same generation sharded are identical), the
    first step at which their histories' step records differ (loss, metrics, state digests), and
    ``diagnosis``: which piece of state differs first there and its likely causes
    (``diagnosis.diagnose``, spec/RUN.md §6.5); the record fields and digests in ``ignore`` (a
    metric that measures time) are not compared. Either may be a URL (a run on object storage: its
    manifests read there, its history's segments joined), a Lightning ModelCheckpoint directory (the
    generation of each checkpoint directory in it) or a Trainer's output directory (no generation
    compared, ``generations_not_compared`` says why: the histories alone say where; ``content.of_run``).

    Examples:
        Two runs whose generation 20 differs:

        >>> import os, numpy as np, ckptfmt
        >>> from ckptfmt.run import bisect
        >>> z = np.zeros(2, np.float32)
        >>> for run, moved in (("straight", 0.0), ("resumed", 0.5)):
        ...     os.makedirs(run, exist_ok=True)
        ...     _ = ckptfmt.save_generation(run, 10, z, z, z)
        ...     _ = ckptfmt.save_generation(run, 20, z + moved, z, z)
        >>> found = bisect("straight", "resumed")
        >>> found["identical"], found["last_identical_generation"], found["first_generation_difference"]
        (False, 10, 20)
        >>> found["diagnosis"]["component"]
        'weights'
    """
    runs = [open_run(path) for path in (path_a, path_b)]
    found, unlike = zip(*(content.of_run(run) for run in runs))
    common = sorted(set(found[0]) & set(found[1]))
    first_gen = next((s for s in common if not content.same(found[0][s], found[1][s])), None)
    last_same = max((s for s in common if first_gen is None or s < first_gen), default=None)
    plans = [timeline.plan(run.history.source, events=("resume",)) for run in runs]
    records = divergence.Records(ignore)
    parted = divergence.walk(plans[0].records(), plans[1].records(), records.same, watch=first_gen)
    found_gens = ({s: r.gen for s, r in found[0].items()}, {s: r.gen for s, r in found[1].items()})
    resumes = tuple([s for _, s in p.events if s > 0] for p in plans)     # a fresh start resumes at 0
    return {"a": str(path_a), "b": str(path_b), "common_generations": common,
            "generations_not_compared": _not_compared(unlike),
            "first_generation_difference": first_gen, "last_identical_generation": last_same,
            "first_history_difference": parted.step, "history_steps": parted.lengths,
            "identical": first_gen is None and parted.step is None,
            "diagnosis": diagnosis.diagnose(parted, found_gens, first_gen, resumes, records, compared=not any(unlike))}


def _not_compared(why: tuple[str | None, str | None]) -> str | None:
    """``A: WHY`` (or ``A and B: WHY``) where a run's generations are not compared, else None."""
    named = [run for run, said in zip("AB", why) if said]
    return f"{' and '.join(named)}: {next(s for s in why if s)}" if named else None
