"""The ``ckptfmt`` command line: thin commands over library functions that return data.

Exit codes everywhere: 0 ok / valid / identical; 1 the check ran and found a defect or a
difference; 2 the check could not run (unreadable input, usage error). Errors are one line.
"""
from __future__ import annotations

import functools
import json
import warnings
import math
import os
import sys
from typing import Any, Callable

import click

from ..errors import CheckpointError, NotACheckpointError, NoValidGenerationError

EXIT_OK, EXIT_DEFECT, EXIT_CANNOT = 0, 1, 2


class Fail(click.ClickException):
    """One line on stderr and a chosen exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.exit_code = code

    def show(self, file: Any = None) -> None:
        click.echo(f"ckptfmt: {self.format_message()}", err=True)


def guarded(fn: Callable) -> Callable:
    """Turn library errors into one-line messages with the right exit code, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NotACheckpointError as exc:
            code = EXIT_CANNOT if exc.path and os.path.isdir(exc.path) else EXIT_DEFECT
            raise Fail(str(exc), code) from None
        except CheckpointError as exc:
            raise Fail(str(exc), EXIT_CANNOT if exc.could_not_run else EXIT_DEFECT) from None
        except OSError as exc:
            where = exc.filename or ""
            raise Fail(f"{where}: {exc.strerror or exc}" if where else str(exc), EXIT_CANNOT) from None
    return wrapper


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=1, default=_jsonable, allow_nan=True))
    else:
        human(data)


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return str(obj)


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.6g}" if math.isfinite(x) else str(x)
    return str(x)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Library warnings (a skipped generation, a zombie arm) as one line on stderr."""
    return f"ckptfmt: warning: {message}\n"


warnings.formatwarning = _one_line_warning


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptfmt")
def main() -> None:
    """ckptfmt: durable, fingerprinted step_NNNNNN.bin checkpoints.

    Exit codes: 0 ok/valid/identical, 1 a defect or difference was found,
    2 the check could not run (unreadable input, usage error).
    """


# ---------------------------------------------------------------- inspect
@main.command()
@click.argument("path", type=click.Path())
@json_option
@click.option("--tensors", is_flag=True, help="Statistics per parameter (needs a layout).")
@guarded
def inspect(path: str, as_json: bool, tensors: bool) -> None:
    """Show step, size, fingerprint status and per-region statistics of a file or run."""
    from ..tools.inspect import inspect_file
    if os.path.isdir(path):
        from ..run import Run
        from ..run.ops import ls_run
        data = ls_run(path)
        try:
            gen = Run(path).latest(allow_bare=True)
        except NoValidGenerationError as exc:
            gen, data["latest_problem"] = None, str(exc)
        data["latest"] = inspect_file(gen.bin, tensors=tensors) if gen else None
        emit(data, as_json, _print_run_inspect)
        if gen is None and "latest_problem" in data:
            sys.exit(EXIT_DEFECT)
        return
    emit(inspect_file(path, tensors=tensors), as_json, _print_inspect)


def _print_inspect(d: dict) -> None:
    click.echo(f"{d['path']}\n  step {d['step']}  n_params {d['n_params']:,}  size {d['size']:,} bytes")
    click.echo(f"  fingerprint {d['fingerprint']}  blake3 {d['blake3']}")
    if d.get("manifest_problem"):
        click.echo(f"  manifest problem: {d['manifest_problem']}")
    if d.get("manifest"):
        man = d["manifest"]
        click.echo(f"  manifest: {man.get('layout_tensors', 0)} tensors in layout"
                   + (f", config {man['config'].get('name')}" if isinstance(man.get("config"), dict) else ""))
    _print_stats_table(d["regions"])
    for name, regions in (d.get("tensors") or {}).items():
        click.echo(f"  {name}")
        _print_stats_table(regions, indent="    ")


def _print_stats_table(regions: dict, indent: str = "  ") -> None:
    cols = ("min", "max", "mean", "std", "max_abs", "nan", "inf", "zeros")
    click.echo(indent + f"{'region':8}" + "".join(f"{c:>13}" for c in cols))
    for name, s in regions.items():
        click.echo(indent + f"{name:8}" + "".join(f"{_fmt(s[c]):>13}" for c in cols))


def _print_run_inspect(d: dict) -> None:
    _print_ls(d)
    if d.get("latest_problem"):
        click.echo(f"no valid generation: {d['latest_problem']}")
    if d.get("latest"):
        click.echo("latest valid generation:")
        _print_inspect(d["latest"])


# ---------------------------------------------------------------- validate
@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@json_option
@click.option("--fast", is_flag=True, help="Skip hashing and value scans (structure and manifest only).")
@guarded
def validate(paths: tuple[str, ...], as_json: bool, fast: bool) -> None:
    """Check files or run directories: structure, fingerprint, manifest, values, sidecars."""
    from ..tools.validate import validate_path
    for p in paths:
        if not os.path.exists(p):
            raise Fail(f"{p}: no such file or directory", EXIT_CANNOT)
    from .progress import terminal_bar
    reports = []
    for p in paths:
        with terminal_bar(f"validating {p}", _bytes_in(p) if not fast else 0, quiet=as_json) as bar:
            reports.append(validate_path(p, deep=not fast, progress=bar))
    emit([r.to_dict() for r in reports] if len(reports) > 1 else reports[0].to_dict(), as_json,
         lambda _: [_print_report(r) for r in reports])
    if not all(r.ok for r in reports):
        sys.exit(EXIT_DEFECT)


def _bytes_in(path: str) -> int:
    """Bytes a deep validation of PATH will hash (the .bin files in a run)."""
    if os.path.isdir(path):
        return sum(e.stat().st_size for e in os.scandir(path) if e.name.endswith(".bin") and e.is_file())
    return os.path.getsize(path)


def _print_report(r) -> None:
    verdict = "OK" if r.ok else "DAMAGED"
    click.echo(f"{r.path}: {verdict} ({r.status})")
    for f in r.findings:
        click.echo(f"  {f.level}: {f.message}")


# ---------------------------------------------------------------- diff
@main.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@json_option
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance.")
@click.option("--tensors", is_flag=True, help="List every differing parameter (needs a layout).")
@guarded
def diff(a: str, b: str, as_json: bool, atol: float, rtol: float, tensors: bool) -> None:
    """Compare two checkpoints: header and weights, m, v. Exit 0 only when bit-identical
    (or within --atol/--rtol)."""
    from ..tools.diff import diff as run_diff, per_tensor
    from .progress import terminal_bar
    total = os.path.getsize(a) + os.path.getsize(b) if os.path.isfile(a) and os.path.isfile(b) else 0
    with terminal_bar("comparing", total, quiet=as_json) as bar:
        result = run_diff(a, b, atol=atol, rtol=rtol, progress=bar)
    data = result.to_dict()
    if tensors:
        data["tensors"] = per_tensor(a, b)
    emit(data, as_json, _print_diff)
    if not (result.identical or (result.within_tolerance and (atol or rtol))):
        sys.exit(EXIT_DEFECT)


def _print_diff(d: dict) -> None:
    click.echo(f"{d['a']} vs {d['b']}: {d['verdict']}")
    steps, ns = d["header"]["step"], d["header"]["n_params"]
    click.echo(f"  step {steps[0]} vs {steps[1]}; n_params {ns[0]:,} vs {ns[1]:,}")
    if not d["comparable"]:
        click.echo("  n_params differ: regions are not comparable")
        return
    for name, r in d["regions"].items():
        if r["identical"]:
            click.echo(f"  {name:8} identical")
            continue
        where = f"index {r['first_index']}"
        if r["first_param"]:
            where += f" ({r['first_param']}[{r['first_param_index']}])"
        click.echo(f"  {name:8} {r['n_diff']:,} differ; max|d| {_fmt(r['max_abs'])} max rel "
                   f"{_fmt(r['max_rel'])} max ulp {r['max_ulp']} rel L2 {_fmt(r['rel_l2'])} cos "
                   f"{_fmt(r['cosine'])}; first at {where}")
    for name, regions in (d.get("tensors") or {}).items():
        click.echo(f"  {name}: " + ", ".join(f"{r} {n:,}" for r, n in regions.items()))


# ---------------------------------------------------------------- convert
@main.command()
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--to", "to", type=click.Choice(["bin", "safetensors", "pt", "npz", "zst", "shards", "dcp"]),
              help="Target format (default: from DST's extension). shards: DST is a run directory that "
                   "receives a sharded generation; dcp: DST is a torch.distributed.checkpoint directory.")
@click.option("--shards", "n_shards", type=click.IntRange(min=1), default=2, show_default=True,
              help="With --to shards: how many shards (ranks).")
@click.option("--weights-only", is_flag=True, help="Inference export: weights only, per parameter.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), help="With --weights-only.")
@click.option("--no-verify", is_flag=True, help="Skip the round-trip verification.")
@json_option
@guarded
def convert(src: str, dst: str, to: str | None, n_shards: int, weights_only: bool, dtype: str | None,
            no_verify: bool, as_json: bool) -> None:
    """Convert between .bin, .safetensors, .pt, .npz, .zst, sharded generations (a
    step_NNNNNN.json of one; consolidate with DST .bin, split with --to shards) and DCP
    directories; every conversion is verified by converting back."""
    from ..tools.convert import convert as run_convert
    if dtype and not weights_only:
        raise click.UsageError("--dtype needs --weights-only (a resumable checkpoint stays float32)")
    from .progress import terminal_bar
    total = os.path.getsize(src) * (1 if no_verify else 2) if os.path.isfile(src) else 0
    with terminal_bar(f"converting {src}", total, quiet=as_json) as bar:
        report = run_convert(src, dst, to=to, weights_only=weights_only, dtype=dtype, verify=not no_verify,
                             progress=bar, shards=n_shards)
    emit(report.to_dict(), as_json, lambda r: click.echo(
        f"{r['src']} -> {r['dst']} ({r['dst_format']}, {_size(r['dst_bytes'])}, "
        f"ratio {r['src_bytes'] / max(r['dst_bytes'], 1):.3f}); verified: {r['verified']}"))


# ---------------------------------------------------------------- ls / gc / pin
@main.command("ls")
@click.argument("run", type=click.Path())
@json_option
@click.option("--deep", is_flag=True, help="Verify fingerprints too.")
@click.option("--keep-every", type=click.IntRange(min=1), help="Mark milestones (steps divisible by N).")
@guarded
def ls_cmd(run: str, as_json: bool, deep: bool, keep_every: int | None) -> None:
    """List a run's generations with status, pins, milestones and leftovers."""
    from ..run.ops import ls_run
    emit(ls_run(run, deep=deep, keep_every=keep_every), as_json, _print_ls)


def _print_ls(d: dict) -> None:
    click.echo(f"{d['run']}" + (f"  (locked by pid {d['lock'].get('pid')})" if d.get("lock") else ""))
    for g in d["generations"]:
        marks = (" pinned" if g["pinned"] else "") + (" milestone" if g.get("milestone") else "")
        click.echo(f"  {g['step']:>10}  {_size(g['size']):>10}  {g['age_s']:>9.0f}s  {g['status']}{marks}")
    for t in d["leftovers"]:
        click.echo(f"  leftover: {t}")
    for f in d["foreign"]:
        click.echo(f"  skipped: {f}")


@main.command()
@click.argument("run", type=click.Path())
@click.option("--keep-last", type=click.IntRange(min=1), required=True, help="Newest generations to keep.")
@click.option("--keep-every", type=click.IntRange(min=1), help="Also keep steps divisible by this (milestones).")
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted.")
@json_option
@guarded
def gc(run: str, keep_last: int, keep_every: int | None, dry_run: bool, as_json: bool) -> None:
    """Apply retention: keep the last K, milestones and pins; never the newest valid one."""
    from ..run import Run, RunLock
    r = Run(run)
    with RunLock(run, purpose="gc"):
        swept = [] if dry_run else [str(p) for p in r.sweep_temps()]
        deleted = r.gc(keep_last=keep_last, keep_every=keep_every, dry_run=dry_run)
    data = {"run": run, "dry_run": dry_run, "deleted": deleted, "swept_temps": swept}
    emit(data, as_json, lambda d: click.echo(
        ("would delete" if dry_run else "deleted") + f" steps {deleted or 'none'}"
        + (f"; swept {len(swept)} temp files" if swept else "")))


@main.command()
@click.argument("run", type=click.Path())
@click.argument("step", type=int)
@click.option("--off", is_flag=True, help="Unpin.")
@guarded
def pin(run: str, step: int, off: bool) -> None:
    """Pin a step so retention never deletes it (or --off to unpin)."""
    from ..run import Run
    click.echo(f"pinned: {Run(run).pin(step, on=not off)}")


# ---------------------------------------------------------------- pivot / fork / bisect
@main.command()
@click.argument("run", type=click.Path())
@click.option("--note", help="Why the pivot (recorded in the history).")
@json_option
@guarded
def pivot(run: str, note: str | None, as_json: bool) -> None:
    """Polish pivot: archive .samples.json and .state.json by step; keep weights, m, v, history.
    The next `train` may change caps, floors and the lr schedule and starts a fresh bandit."""
    from ..run.ops import pivot as run_pivot
    emit(run_pivot(run, note=note), as_json,
         lambda d: click.echo(f"pivot at step {d['step']}: archived {d['archived'] or 'nothing'} to {d['archive']}"))


@main.command()
@click.argument("run", type=click.Path())
@click.argument("dest", type=click.Path())
@click.option("--step", type=int, required=True, help="Generation to fork from.")
@json_option
@guarded
def fork(run: str, dest: str, step: int, as_json: bool) -> None:
    """Audit fork: start a new run DEST from generation --step, with provenance."""
    from ..run.ops import fork as run_fork
    emit(run_fork(run, step, dest), as_json,
         lambda d: click.echo(f"forked {run} at step {d['step']} into {d['dest']} (blake3 {d['blake3'][:16]}…)"))


@main.command()
@click.argument("run_a", type=click.Path())
@click.argument("run_b", type=click.Path())
@json_option
@guarded
def bisect(run_a: str, run_b: str, as_json: bool) -> None:
    """First step where two runs' generations or loss histories differ (exit 1 if any)."""
    from ..run.ops import bisect as run_bisect
    data = run_bisect(run_a, run_b)
    emit(data, as_json, lambda d: click.echo(
        f"generations: first difference at step {d['first_generation_difference']} "
        f"(last identical {d['last_identical_generation']}); history: first difference at step "
        f"{d['first_history_difference']}"))
    if not data["identical"]:
        sys.exit(EXIT_DEFECT)


@main.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="PNG file to write.")
@guarded
def plot(runs: tuple[str, ...], out: str) -> None:
    """Draw loss (raw and EMA) of runs with generations, pivots, resumes and forks marked,
    and the curriculum's source shares below (needs matplotlib)."""
    from ..tools.plot import plot as run_plot
    for r in runs:
        if not os.path.isdir(r):
            raise Fail(f"{r}: not a run directory", EXIT_CANNOT)
    run_plot(list(runs), out)
    click.echo(f"wrote {out}")


# ---------------------------------------------------------------- export / import
@main.command("export")
@click.argument("run", type=click.Path())
@click.argument("dest", type=click.Path())
@click.option("--latest", "latest", is_flag=True, help="Export the newest valid generation (the default).")
@click.option("--steps", "steps", help="Comma-separated steps to export instead of the latest.")
@click.option("--with-history/--without-history", default=True, show_default=True, help="Copy .loss.json (whole).")
@click.option("--weights-only", is_flag=True, help="Inference export: weights as safetensors.")
@click.option("--archive", is_flag=True, help="Write DEST as one verified .tar.zst.")
@json_option
@guarded
def export_cmd(run: str, dest: str, latest: bool, steps: str | None, with_history: bool,
               weights_only: bool, archive: bool, as_json: bool) -> None:
    """Export generations, history and sidecars to DEST, verified at DEST (and loaded there)."""
    from ..tools.export import archive as run_archive, export as run_export
    chosen = None
    if steps:
        try:
            chosen = [int(s) for s in steps.split(",") if s.strip()]
        except ValueError:
            raise click.UsageError(f"--steps takes comma-separated integers, got {steps!r}") from None
    if latest and chosen:
        raise click.UsageError("--latest and --steps exclude each other")
    from .progress import terminal_bar
    fn = run_archive if archive else run_export
    with terminal_bar(f"exporting {run}", _bytes_in(run) if os.path.isdir(run) else 0, quiet=as_json) as bar:
        doc = fn(run, dest, steps=chosen, with_history=with_history, weights_only=weights_only, progress=bar)
    emit(doc, as_json, lambda d: click.echo(
        f"exported steps {d['steps']} to {dest}: {len(d['files'])} files, verified at the destination: "
        f"{json.dumps(d['verified'])}" + (" (UNVERIFIED bare files)" if d["bare"] else "")))


@main.command("import")
@click.argument("archive", type=click.Path())
@click.argument("dest", type=click.Path())
@json_option
@guarded
def import_cmd(archive: str, dest: str, as_json: bool) -> None:
    """Unpack an exported .tar.zst into DEST and verify every file."""
    from ..tools.export import import_archive
    doc = import_archive(archive, dest)
    emit(doc, as_json, lambda d: click.echo(f"imported {d['files']} files into {d['dest']}: verified"))


# ---------------------------------------------------------------- verify-resume
@main.command("verify-resume")
@click.option("--output", required=True, type=click.Path(), help="New directory for the four runs and verification.json.")
@click.option("--trainer", type=click.Choice(["mini", "andrea", "command"]), default="mini", show_default=True)
@click.option("--steps", type=click.IntRange(min=2), default=10, show_default=True)
@click.option("--cut", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--atol", type=float, default=1e-12, show_default=True)
@click.option("--rtol", type=float, default=0.0, show_default=True)
@click.option("--command", "command", help="With --trainer command: template with {steps} {output} {resume} {omit_rng}.")
@click.option("--fault", type=click.Choice(["optimizer", "scheduler", "cursor", "rng-python", "rng-numpy", "rng-torch"]),
              hidden=True, help="mini only: break one piece of the resume (to test the verifier).")
@json_option
@guarded
def verify_resume_cmd(output: str, trainer: str, steps: int, cut: int, atol: float, rtol: float,
                      command: str | None, fault: str | None, as_json: bool) -> None:
    """Prove a resume is complete: continuous, cut, resumed and resumed-without-RNG runs in
    fresh processes. Exit 0 when the resume matches and the negative control diverges."""
    from ..verify import VerifyIncomplete, verify_resume
    if cut >= steps:
        raise click.UsageError(f"--cut ({cut}) must be smaller than --steps ({steps})")
    log = None if as_json else (lambda m: click.echo(f"  {m}", err=True))
    try:
        result = verify_resume(output, trainer=trainer, steps=steps, cut=cut, atol=atol, rtol=rtol,
                               command=command, fault=fault, log=log)
    except VerifyIncomplete as exc:
        raise Fail(f"verify-resume could not complete: {exc}", EXIT_CANNOT) from None
    emit(result, as_json, _print_verification)
    if not result["all_checks_passed"]:
        sys.exit(EXIT_DEFECT)


def _print_verification(r: dict) -> None:
    click.echo(f"trainer {r['trainer']}: {r['steps']} steps, cut at {r['cut']}, atol {r['atol']}, rtol {r['rtol']}")
    for name, c in r["checks"]["resume"].items():
        neg = r["checks"]["resume_without_rng"].get(name, {})
        click.echo(f"  {name:16} resume {'ok' if c['ok'] else 'FAIL'} (max dev {c['max_deviation']:.3g})"
                   f"   without RNG: {'same' if neg.get('ok') else 'differs'} (max dev {neg.get('max_deviation', 0):.3g})")
    click.echo(f"positive: {r['positive']}  negative_divergence_detected: {r['negative_divergence_detected']}"
               f"  all_checks_passed: {r['all_checks_passed']}")
    for f in r["failed_checks"]:
        click.echo(f"  failed: {f}")


# ---------------------------------------------------------------- train
@main.command()
@click.option("--run", "--run-dir", "run_dir", required=True, type=click.Path(),
              help="Run directory (created if new). Under torchrun use --run-dir (torchrun claims --run).")
@click.option("--config", "config_name", default="tiny", show_default=True,
              type=click.Choice(["tiny", "andrea-12m", "andrea-120m"]), help="Named model/training config.")
@click.option("--steps", type=click.IntRange(min=0), required=True, help="Train until global step N.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--sample-every", type=click.IntRange(min=0), default=100, show_default=True)
@click.option("--keep-last", type=click.IntRange(min=1), help="Retention: newest generations kept.")
@click.option("--keep-every", type=click.IntRange(min=1), help="Retention: milestone interval.")
@click.option("--seed", type=int, help="Config seed (default 0; part of the config).")
@click.option("--threads", type=click.IntRange(min=1), help="torch threads (part of the config: bit-exact "
              "resume needs the same count).")
@click.option("--async-save", is_flag=True, help="Write checkpoints in the background.")
@click.option("--amp", type=click.Choice(["auto", "none", "bf16", "fp16"]), default="auto", show_default=True,
              help="Mixed precision on CUDA (auto: bf16 on CUDA, none on CPU).")
@click.option("--log-every", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--set", "sets", multiple=True, metavar="KEY=JSON",
              help="Override a config field, e.g. --set lr=1e-3 --set 'caps={\"code\":0.5,...}'. A run's "
                   "config can only change in caps, floors, sources and the lr schedule, after `ckptfmt pivot`.")
@click.option("--parallel", type=click.Choice(["ddp", "fsdp"]), default="ddp", show_default=True,
              help="Under torchrun: DDP replicas or FSDP2 sharding (the checkpoint format is the same).")
@click.option("--omit-rng-restore", is_flag=True, hidden=True, help="Negative control of verify-resume.")
@guarded
def train(run_dir: str, config_name: str, steps: int, device: str, checkpoint_every: int,
          sample_every: int, keep_last: int | None, keep_every: int | None, seed: int | None,
          threads: int | None, async_save: bool, amp: str, log_every: int, sets: tuple[str, ...],
          parallel: str, omit_rng_restore: bool) -> None:
    """Train the reference model to --steps N, resuming from the newest valid generation.

    SIGTERM/SIGINT: checkpoint the current step and exit 0 (75 if that save fails).
    SIGUSR1: checkpoint the current step and continue.
    """
    from ..trainer.signals import install
    flags = install()           # before the slow imports: a signal during start-up is honoured
    from ..trainer.config import parse_sets
    try:
        overrides = parse_sets(sets)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    from ..trainer.loop import train as run_train
    code = run_train(run_dir, config_name, steps, seed=seed, threads=threads, sets=overrides, flags=flags,
                     device=device, checkpoint_every=checkpoint_every, sample_every=sample_every,
                     keep_last=keep_last, keep_every=keep_every, async_save=async_save, amp=amp,
                     log_every=log_every, omit_rng_restore=omit_rng_restore, parallel=parallel)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from ..torch.distributed import exit_worker
        exit_worker(code)          # skip finalization: see exit_worker for the gloo abort it avoids
    sys.exit(code)


if __name__ == "__main__":
    main()
