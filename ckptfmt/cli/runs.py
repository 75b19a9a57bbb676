"""Commands on runs (a directory, or a URL: a run on object storage): ls, gc, ram, pin, pivot, fork,
bisect, plot.

Library imports stay inside the commands: ``ckptfmt.run`` costs milliseconds that
``ckptfmt --help`` would otherwise pay, and ``plot`` needs matplotlib.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import click

from .app import main
from .output import EXIT_CANNOT, EXIT_DEFECT, Fail, emit, guarded, json_option, metrics_words, print_memory, size
from .policy import POLICY_FLAGS, policy_of, policy_options


# ---------------------------------------------------------------- ls / gc / pin
@main.command("ls")
@click.argument("run", type=click.Path())
@json_option
@click.option("--deep", is_flag=True, help="Verify fingerprints too.")
@policy_options
@click.option("--remote", is_flag=True, help="Check each mirror's destination (network) for the lag, "
                                             "instead of the local record only.")
@guarded
def ls_cmd(run: str, as_json: bool, deep: bool, remote: bool, **policy: Any) -> None:
    """List a run's generations with status, pins, milestones, metrics, leftovers, saves in
    progress, read leases and mirror lag. Safe while the run trains: what it lists is leased until
    it is done. A generation whose values (recorded at save) hold NaN or inf is shown as diverged,
    with the count per region. With retention flags (as gc's), which rule keeps each generation.
    A URL: the generations at the URL."""
    from ..run.ops import ls_run  # lazy: keeps `ckptfmt --help` fast
    from ..store.objects import is_url  # lazy: as above
    if is_url(run):
        from .remote import ls_url_out  # lazy: as above
        return ls_url_out(run, as_json)
    from ..tools.hfrun import hf_kind, ls_hf  # lazy: as above
    if hf_kind(run):                         # a Trainer's output or checkpoint-N directory
        return emit(ls_hf(run, deep=deep), as_json, print_ls)
    from ..tools.lightningdir import is_lightning_dir, ls_lightning_dir  # lazy: as above
    if is_lightning_dir(run):                # Lightning's ModelCheckpoint directory of checkpoints
        return emit(ls_lightning_dir(run, deep=deep), as_json, print_ls)
    data = ls_run(run, deep=deep, keep_every=policy["keep_every"], policy=policy_of(**policy))
    if not data["generations"]:              # judged as validate and inspect judge it (RUN §2.5)
        from ..tools.loose import empty_directory, own_kind  # lazy: as above
        kind = own_kind(run)
        case, said = ("files", [(run, kind)]) if kind else empty_directory(run, data["lock"])
        if case == "files":
            data["files"] = [{"path": p, "kind": k.name, "label": k.label} for p, k in said]
        else:
            data["training" if case == "training" else "problem"] = said
    if remote:
        from ..tools.remote_check import check_mirrors  # lazy: as above
        data["mirrors"] = check_mirrors(data["mirrors"], [g["step"] for g in data["generations"] if g["committed"]])
    emit(data, as_json, print_ls)
    if data.get("problem"):                  # nothing to resume from: NO CHECKPOINT, as validate says
        sys.exit(EXIT_DEFECT)


def print_ls(d: dict) -> None:
    click.echo(f"{d['run']}" + (f"  (locked by pid {d['lock'].get('pid')})" if d.get("lock") else ""))
    policy = d.get("policy") or {}
    if policy.get("from"):
        rules = ", ".join(f"{k}={v}" for k, v in (policy["retention"] or {}).items() if k != "keep_all") \
            or "keeps every generation"
        click.echo(f"  retention ({'the flags' if policy['from'] == 'given' else 'recorded in ' + policy['from']}): {rules}")
    if policy.get("problem"):
        click.echo(f"  {policy['problem']}")
    if d.get("training") or d.get("problem"):
        click.echo(f"  {d.get('training') or 'NO CHECKPOINT: ' + d['problem']}")
    if d["generations"]:
        click.echo(f"  {'step':>10}  {'size':>10}  {'age':>10}  status")
    for g in d["generations"]:
        marks = (" pinned" if g["pinned"] else "") + (" milestone" if g.get("milestone") else "")
        marks += "".join(f" {m}" for m in metrics_words(g.get("metrics"), g["step"]))
        if g.get("kept_by"):
            marks += " kept: " + ", ".join(g["kept_by"])
        if g.get("diverged"):
            marks += " (" + ", ".join(f"{r}: {k}" for r, k in g["non_finite"].items()) + " non-finite values)"
        age = "-" if g["age_s"] is None else f"{g['age_s']:.0f}s"
        step = "-" if g["step"] is None else g["step"]      # a checkpoint directory named by no step
        click.echo(f"  {step:>10}  {size(g['size']):>10}  {age:>10}  {g['status']}{marks}")
    if d.get("deep") is False and any(g["status"] == "committed" for g in d["generations"]):
        click.echo("  committed: names, sizes, headers and manifests checked; ls --deep (or validate) hashes every byte")
    print_memory((d.get("tiers") or {}).get("memory"))
    for t in d.get("in_progress", []):
        click.echo(f"  save in progress: {t}")
    for t in d["leftovers"]:
        click.echo(f"  leftover: {t}")
    if d.get("lease_problem"):
        click.echo(f"  {d['lease_problem']}")
    for r in d.get("leases", []):
        click.echo(f"  read lease: {r.get('purpose', 'reader')} pid {r.get('pid', '?')} "
                   f"holds steps {r.get('steps')}")
    for f in d["foreign"]:
        click.echo(f"  skipped: {f}")
    for f in d.get("files", []):
        click.echo(f"  {f['path']}: {f['label']}, not a generation")
    for m in d.get("mirrors", []):
        click.echo(f"  mirror {m['url']}: " + (f"{len(m['behind'])} generation{'s' * (len(m['behind']) > 1)} behind {m['behind']}"
                                                if m["behind"] else "up to date")
                   + f" (newest confirmed there: {m['newest_confirmed']})"
                   + (f"; checked there now: {m['at_destination']}" if "at_destination" in m else ""))


@main.command()
@click.argument("run", type=click.Path())
@policy_options
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted, and why each kept one is kept.")
@json_option
@guarded
def gc(run: str, dry_run: bool, as_json: bool, **policy: Any) -> None:
    """Apply retention: keep a generation if any rule keeps it (the last K, milestones, the best
    K by a metric, a time window, one per interval) or it is pinned; never the newest valid one,
    nor the newest finite one while only diverged generations (NaN/inf values) are newer, nor
    one a reader leases. At least one keep rule is needed. RUN may be a URL (a run written straight
    to object storage: removed there, under its writer lease)."""
    from ..run import gc as run_gc  # lazy: keeps `ckptfmt --help` fast
    chosen = policy_of(**policy)
    if chosen is None:
        raise click.UsageError(f"gc: Missing a keep rule: {POLICY_FLAGS} (the guards alone are no "
                               "policy). (see --help)")     # as click's own usage errors read
    data = run_gc(run, chosen, dry_run=dry_run)
    emit(data, as_json, _print_gc)


def _print_gc(d: dict) -> None:
    click.echo(("would delete" if d["dry_run"] else "deleted") + f" steps {d['deleted'] or 'none'}"
               + (f"; swept {len(d['swept_temps'])} temp files" if d["swept_temps"] else ""))
    if d["dry_run"]:
        for k in d["kept"]:
            click.echo(f"  keep {k['step']}: {', '.join(k['kept_by'])}")
    memory = (d.get("tiers") or {}).get("memory")
    if memory is not None:
        said = f"{'would delete' if d['dry_run'] else 'deleted'} steps {memory['deleted'] or 'none'}" + \
            (f" and swept {len(memory['swept_temps'])} temp files" if memory.get("swept_temps") else "")
        if memory["deleted"]:
            said += f" (the newest valid durable generation, {memory['covered_by']}, covers them)"
        if memory["kept"]:
            said += f"; keeps steps {memory['kept']}: " + (f"newer than the newest valid durable generation, "
                                                             f"{memory['covered_by']}" if memory["covered_by"] is not None
                                                             else "no valid durable generation covers them")
        click.echo(f"RAM tier {memory['dir']}: {said}")


@main.command("ram")
@click.option("--remove-orphans", is_flag=True, help="Remove the RAM tiers whose run no longer exists "
              "(or was deleted and made again) and in which nothing changed for an hour.")
@click.option("--remove", "ids", multiple=True, metavar="ID", help="Remove the RAM tier of this run ID now "
              "(one a live process saves to, or its run still uses, is refused: gc RUN cleans that one). "
              "Repeatable.")
@click.option("--dry-run", is_flag=True, help="Only say what would be removed.")
@json_option
@guarded
def ram(remove_orphans: bool, ids: tuple[str, ...], dry_run: bool, as_json: bool) -> None:
    """List this user's RAM tiers ($CKPTFMT_MEMORY_DIR, else /dev/shm/ckptfmt-UID): each one's
    run and whether that run still exists, its generations and size. A run that closes removes
    its RAM generations the durable ones cover; a tier whose run was deleted is orphaned, and
    --remove-orphans removes it once it is an hour old (a run moved while it was killed takes its
    tier back when it restarts)."""
    from ..run.ramdirs import sweep  # lazy: keeps `ckptfmt --help` fast
    emit(sweep(orphans=remove_orphans, ids=ids, dry_run=dry_run), as_json, _print_ram)


def _print_ram(d: dict) -> None:
    if not d["tiers"]:
        click.echo(f"no RAM tiers under {d['root']}")
    for t in d["tiers"]:
        click.echo(f"{t['dir']}  {size(t['bytes']):>10}  steps {t['steps'] or 'none'}  {t['status']}: {t['why']}")
    for gone in d["removed"]:
        click.echo(f"{'would remove' if d['dry_run'] else 'removed'} {gone}")
    for young in d["waiting"]:
        click.echo(f"kept {young}: changed within the last {d['grace_s'] // 60} minutes (a run moved while it "
                   "was killed may come back to it); --remove ID removes it now")


@main.command()
@click.argument("run", type=click.Path())
@click.argument("step", type=int)
@click.option("--off", is_flag=True, help="Unpin.")
@json_option
@guarded
def pin(run: str, step: int, off: bool, as_json: bool) -> None:
    """Pin a committed step so retention never deletes it (or --off to unpin). RUN may be a URL
    (a run written straight to object storage)."""
    from ..run.storerun import open_run  # lazy: keeps `ckptfmt --help` fast
    pins = open_run(run).pin(step, on=not off)
    emit({"run": run, "pins": pins}, as_json, lambda d: click.echo(f"pinned: {d['pins']}"))


# ---------------------------------------------------------------- pivot / fork / bisect
@main.command()
@click.argument("run", type=click.Path())
@click.option("--note", help="Why the pivot (recorded in the history).")
@json_option
@guarded
def pivot(run: str, note: str | None, as_json: bool) -> None:
    """Polish pivot: archive .samples.json and .state.json by step; keep weights, m, v, history.
    The next `train` may change caps, floors, sources, bandit_temperature and the lr schedule (lr,
    warmup, decay_steps, min_lr_frac) and starts a fresh bandit. RUN may be a URL (a run written
    straight to object storage: the sidecars archived there, under its writer lease)."""
    from ..run.ops import pivot as run_pivot  # lazy: keeps `ckptfmt --help` fast
    emit(run_pivot(run, note=note), as_json,
         lambda d: click.echo(f"pivot at step {d['step']}: archived {d['archived'] or 'nothing'} to {d['archive']}"))


@main.command()
@click.argument("run", type=click.Path())
@click.argument("dest", type=click.Path())
@click.option("--step", type=int, required=True, help="Generation to fork from.")
@json_option
@guarded
def fork(run: str, dest: str, step: int, as_json: bool) -> None:
    """Audit fork: start a new run DEST from generation --step, with provenance. Safe while the
    run trains: the generation is leased, so retention keeps it until the copy is done. RUN may
    be a URL (a run written straight to object storage: each part streamed here, verified), and
    so may DEST (a new run written there as the manager writes one: under its writer lease, each
    part hashed while sent and read back, the manifest last; a prefix holding anything is refused)."""
    from ..run.ops import fork as run_fork  # lazy: keeps `ckptfmt --help` fast
    emit(run_fork(run, step, dest), as_json,
         lambda d: click.echo(f"forked {run} at step {d['step']} into {d['dest']} (blake3 {d['blake3'][:16]}…)"))


@main.command()
@click.argument("run_a", type=click.Path())
@click.argument("run_b", type=click.Path())
@click.option("--ignore", "ignore", multiple=True, metavar="FIELD",
              help="Leave this field of the step records (a metric that measures time) or this state digest "
              "(rng.numpy) out of the comparison. Repeatable.")
@json_option
@guarded
def bisect(run_a: str, run_b: str, ignore: tuple[str, ...], as_json: bool) -> None:
    """First step where two runs' generations or histories differ (exit 1 if any), and why: the
    first piece of state that differs there (the histories' state digests, then the generations'
    tensors by parameter name), what is identical, and that piece's likely causes. Generations
    are compared by content (step, weights, m, v, companion): a .bin and the same generation
    sharded are identical. Either run may be a URL (a run written straight to object storage), a
    Lightning ModelCheckpoint directory (the generation in each checkpoint compared) or a Hugging
    Face Trainer's output directory (its checkpoint-N not compared: the histories say where)."""
    from ..run.ops import bisect as run_bisect  # lazy: keeps `ckptfmt --help` fast
    data = run_bisect(run_a, run_b, ignore)
    emit(data, as_json, _print_bisect)
    if not data["identical"]:
        sys.exit(EXIT_DEFECT)


def _print_bisect(d: dict) -> None:
    """Steps in words: "identical" or "first differ at step N", never "step None"; then the
    diagnosis in one line."""
    def at(step: int | None, what: str) -> str:
        return f"{what}: identical" if step is None else f"{what}: first differ at step {step}"
    gens = at(d["first_generation_difference"], "generations")
    if d.get("generations_not_compared"):
        gens = f"generations: not compared ({d['generations_not_compared']})"
    elif not d["common_generations"]:
        gens = "generations: none in common"
    elif d["last_identical_generation"] is not None and d["first_generation_difference"] is not None:
        gens += f" (last identical: step {d['last_identical_generation']})"
    click.echo(f"{gens}; {at(d['first_history_difference'], 'history')}")
    click.echo(d["diagnosis"]["message"])


# ---------------------------------------------------------------- plot
@main.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@click.option("--out", required=True, type=click.Path(),
              help="New .png (or .svg, .pdf) file to write; an existing file is never replaced.")
@json_option
@guarded
def plot(runs: tuple[str, ...], out: str, as_json: bool) -> None:
    """Draw loss (raw and EMA) of runs with generations, pivots, resumes and forks marked,
    and the curriculum's source shares below (needs matplotlib). A RUN may be a URL (a run
    written straight to object storage); the figure is a local file."""
    from ..tools.plot import plot as run_plot  # lazy: plotting needs matplotlib
    from ..run.storerun import open_run  # lazy: as above
    from .. import fsio  # lazy: as above
    fsio.refuse_url(out, "the figure", "plot writes its figure as a local file (a RUN may be a URL)")
    if os.path.splitext(out)[1].lower() not in (".png", ".svg", ".pdf"):
        raise Fail(f"{out}: --out must end in .png, .svg or .pdf", EXIT_CANNOT)
    for r in runs:
        open_run(r)                          # each one there, before matplotlib is imported
    emit(run_plot(list(runs), out), as_json, lambda d: click.echo(f"wrote {d['out']}"))
