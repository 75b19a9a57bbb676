"""``train`` and ``verify-resume``: the commands that run the reference trainer (torch)."""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import click

from .app import main
from .output import EXIT_CANNOT, EXIT_DEFECT, TOLERANCE, Fail, emit, guarded, guarded_keeping_tracebacks, json_option
from .policy import policy_of, policy_options, require_metrics, save_options, save_policy_of


def require_torch(command: str) -> None:
    """The commands that run a trainer need the torch extra: without it, one line and exit 2
    (looked up, not imported: the import is slow and comes later)."""
    if importlib.util.find_spec("torch") is None:
        raise Fail(f"{command} needs torch: pip install 'ckptfmt[torch]'", EXIT_CANNOT)


# ---------------------------------------------------------------- verify-resume
@main.command("verify-resume")
@click.option("--output", required=True, type=click.Path(), help="New directory for the four runs and verification.json.")
@click.option("--trainer", type=click.Choice(["mini", "andrea", "command"]), default="mini", show_default=True,
              help="mini: the seed's 33-parameter exercise; andrea: the reference trainer (tiny); "
                   "command: your own, see --command.")
@click.option("--steps", type=click.IntRange(min=2), default=10, show_default=True,
              help="Updates of the continuous run.")
@click.option("--cut", type=click.IntRange(min=1), default=5, show_default=True,
              help="Step at which the cut run saves and stops (smaller than --steps).")
@click.option("--atol", type=TOLERANCE, default=1e-12, show_default=True, help="Absolute tolerance of each comparison.")
@click.option("--rtol", type=TOLERANCE, default=0.0, show_default=True, help="Relative tolerance of each comparison.")
@click.option("--command", "command", help="With --trainer command: template with {steps} {output} {resume} {omit_rng}.")
@click.option("--fault", type=click.Choice(["optimizer", "scheduler", "cursor", "rng-python", "rng-numpy", "rng-torch"]),
              hidden=True, help="mini only: break one piece of the resume (to test the verifier).")
@click.option("--ignore", "ignore", multiple=True, metavar="NAME",
              help="A loop that writes no summary.json: leave this component of its run's history out of the "
              "checks (a metric that measures time, step_s; a digest, rng.numpy). Repeatable.")
@json_option
@guarded
def verify_resume_cmd(output: str, trainer: str, steps: int, cut: int, atol: float, rtol: float,
                      command: str | None, fault: str | None, ignore: tuple[str, ...], as_json: bool) -> None:
    """Prove a resume is complete: continuous, cut, resumed and resumed-without-RNG runs in
    fresh processes. Exit 0 when the resume matches and the negative control diverges."""
    require_torch("verify-resume")
    from .. import fsio  # lazy: keeps --help fast
    fsio.refuse_url(output, "the output directory", "verify-resume writes its two runs locally")
    from ..verify import VerifyIncomplete, verify_resume  # lazy: the verify layer (uses torch), keeps --help fast
    if cut >= steps:
        raise click.UsageError(f"--cut ({cut}) must be smaller than --steps ({steps})")
    log = None if as_json else (lambda m: click.echo(f"  {m}", err=True))
    try:
        result = verify_resume(output, trainer=trainer, steps=steps, cut=cut, atol=atol, rtol=rtol,
                               command=command, fault=fault, ignore=ignore, log=log)
    except VerifyIncomplete as exc:
        raise Fail(f"verify-resume could not complete: {exc}", EXIT_CANNOT) from None
    emit(result, as_json, _print_verification)
    if not result["all_checks_passed"]:
        sys.exit(EXIT_DEFECT)


def _print_verification(r: dict) -> None:
    click.echo(f"trainer {r['trainer']}: {r['steps']} steps, cut at {r['cut']}, atol {r['atol']}, rtol {r['rtol']}")
    for name, c in r["checks"]["resume"].items():
        neg = r["checks"]["resume_without_rng"].get(name, {})
        click.echo(f"  {name:16} resume {'ok' if c['ok'] else 'FAIL'} (max dev {c['max_deviation']:.3g}{_why(c)})"
                   f"   without RNG: {'same' if neg.get('ok') else 'differs'} (max dev {neg.get('max_deviation', 0):.3g}"
                   f"{_why(neg)})")
    click.echo(f"positive: {r['positive']}  negative_divergence_detected: {r['negative_divergence_detected']}"
               f"  all_checks_passed: {r['all_checks_passed']}")
    for f in r["failed_checks"]:
        click.echo(f"  failed: {f}")
    left = r.get("left_out", {})
    if left.get("from_start"):
        click.echo(f"left out: {', '.join(left['from_start'])} (differ from the first record on while the loss "
                   "agrees: an RNG the loop neither seeds nor draws from, a difference of the runs, not of the resume)")
    if left.get("ignored"):
        click.echo(f"ignored: {', '.join(left['ignored'])}")


def _why(check: dict) -> str:
    """What a deviation alone does not say: the first structural difference or non-finite value
    (seed 001: the comparison reports them rather than accept an unusable output), or the first
    step at which a recorded digest differs (a loop's run compared by its history)."""
    if check.get("first_difference") is not None:
        return f"; first at step {check['first_difference']}"
    for kind in ("structural", "non_finite"):
        found = check.get(kind) or []
        if found:
            more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
            return f"; {kind.replace('_', '-')}: {found[0]}{more}"
    return ""


# ---------------------------------------------------------------- train
@main.command()
@click.option("--run", "--run-dir", "run_dir", required=True, type=click.Path(),
              help="Run directory (created if new), or a URL: a run written straight to object storage "
              "(s3://bucket/runs/x; the remote extra). Under torchrun use --run-dir "
              "(torchrun claims --run).")
@click.option("--config", "config_name", default="tiny", show_default=True,
              type=click.Choice(["tiny", "andrea-12m", "andrea-120m"]), help="Named model/training config.")
@click.option("--steps", type=click.IntRange(min=0, max=2**31 - 1), required=True,
              help="Train until global step N (a step is an int32 in the file).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: CUDA when available, else the CPU.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=100, show_default=True,
              help="Commit a generation every N steps.")
@click.option("--memory-every", type=click.IntRange(min=1), metavar="N",
              help="Also commit a generation to node-local RAM (/dev/shm, or $CKPTFMT_MEMORY_DIR) every N steps "
                   "between durable ones: it survives a killed process, not a reboot; a restart resumes the "
                   "newest generation that verifies in either tier. Under torchrun on several nodes each "
                   "rank's shard is also copied to a partner rank on the next node, so a lost node's "
                   "replacement resumes from its peers' copies.")
@click.option("--sample-every", type=click.IntRange(min=0), default=100, show_default=True,
              help="Write a generated sample to .samples.json every N steps (0: never).")
@save_options
@policy_options
@click.option("--seed", type=click.IntRange(min=0), help="Config seed (default 0; part of the config).")
@click.option("--threads", type=click.IntRange(min=1), help="torch threads (default 1; part of the config: "
              "bit-exact resume needs the same count).")
@click.option("--async-save", is_flag=True, help="Write checkpoints in the background.")
@click.option("--amp", type=click.Choice(["auto", "none", "bf16", "fp16"]), default="auto", show_default=True,
              help="Mixed precision on CUDA (auto: bf16 on CUDA, none on CPU).")
@click.option("--log-every", type=click.IntRange(min=1), default=50, show_default=True,
              help="Print the loss every N steps.")
@click.option("--set", "sets", multiple=True, metavar="KEY=JSON",
              help="Override a config field, e.g. --set lr=1e-3 --set 'caps={\"code\":0.5,\"topics\":0.7,"
                   "\"docstrings\":0.7}' (caps and floors name every source). A run's "
                   "config can only change in caps, floors, sources, bandit_temperature and the lr schedule "
                   "(lr, warmup, decay_steps, min_lr_frac), after `ckptfmt pivot`.")
@click.option("--parallel", type=click.Choice(["ddp", "fsdp"]), default="ddp", show_default=True,
              help="Under torchrun: DDP replicas or FSDP2 sharding (the checkpoint format is the same).")
@click.option("--dist-timeout", type=click.IntRange(min=1), default=120, show_default=True, metavar="SECONDS",
              help="Under torchrun: how long a collective may wait for the other ranks before failing.")
@click.option("--mirror", metavar="URL", help="Also upload each committed generation to URL (s3://bucket/path, "
              "any fsspec URL; the remote extra) on a background thread, verified, with the same retention.")
@click.option("--allow-nonfinite", is_flag=True,
              help="Resume the newest valid generation even if it diverged (its values hold NaN or inf); "
                   "by default the newest finite one is resumed and the log says which were passed over.")
@click.option("--allow-device-change", is_flag=True,
              help="Resume a run that trained on another device type (CUDA vs CPU); its RNG state "
                   "there cannot be restored, so the run does not continue bit-exactly.")
@click.option("--state-digests", is_flag=True,
              help="Record with each step a digest of every piece of training state as the next step finds "
                   "it (the history's state field, spec/RUN.md §3.9): where a resumed run parted from a "
                   "straight one. About 0.45 ms a step.")
@click.option("--force-nonfinite-at", type=click.IntRange(min=1), hidden=True, metavar="STEP",
              help="Test hook: make the loss NaN at STEP (a divergence at a known step).")
@click.option("--omit-rng-restore", is_flag=True, hidden=True, help="Negative control of verify-resume.")
@click.option("--summary", type=click.Path(), hidden=True, help="verify-resume: write summary.json here at exit.")
@click.option("--pause-at-step", "pause_at", nargs=2, type=(click.IntRange(min=1), click.Path()), hidden=True,
              metavar="N MARKER", help="verify-resume: after step N, create MARKER and wait for a signal.")
@guarded_keeping_tracebacks
def train(run_dir: str, config_name: str, steps: int, device: str, checkpoint_every: int,
          memory_every: int | None, sample_every: int, seed: int | None, threads: int | None, async_save: bool, amp: str, log_every: int,
          sets: tuple[str, ...], parallel: str, dist_timeout: int, mirror: str | None, allow_nonfinite: bool,
          allow_device_change: bool, state_digests: bool, force_nonfinite_at: int | None, omit_rng_restore: bool, summary: str | None,
          pause_at: tuple[int, str] | None, checkpoint_interval: str | None, checkpoint_on_best: str | None,
          checkpoint_best_mode: str | None, checkpoint_best_min_delta: float | None, **keep: Any) -> None:
    """Train the reference model to --steps N, resuming from the newest valid finite generation.

    Saves on the --checkpoint-* rules and at step N; keeps by gc's --keep-* (none: all) after each
    commit. Metrics: loss, loss_ema, lr.
    SIGTERM/SIGINT: checkpoint the current step and exit 0 (75 if that save fails).
    SIGUSR1: checkpoint the current step and continue.
    Exit 3: the loss became NaN or inf; that step is committed (marked diverged by its value
    facts) and the run stops. The next start resumes from the newest finite generation
    (--allow-nonfinite: from the diverged one).
    \f
    Hidden options, passed by ``ckptfmt verify-resume --trainer andrea`` (single process only;
    see ckptfmt/trainer/protocol.py): ``--summary PATH`` writes the verifier's summary.json at
    exit; ``--pause-at-step N MARKER`` creates MARKER after step N and waits for a signal, so an
    external SIGTERM lands exactly at step N; ``--omit-rng-restore`` resumes without restoring
    any RNG (the negative control). ``--force-nonfinite-at STEP`` (a test hook, single process or
    torchrun) makes the loss NaN at STEP, so the divergence guard can be tested with the tiny
    config.
    """
    from ..run import signals   # lazy: keeps --help fast
    flags = signals.Flags()     # set from before the slow imports: a signal during start-up is honoured
    signals.Handlers(flags, signals.Flags.take).install()
    retention = policy_of(**keep)
    saving = save_policy_of(checkpoint_every, checkpoint_interval, checkpoint_on_best, checkpoint_best_mode,
                            checkpoint_best_min_delta)
    require_torch("train")
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1   # launched by torchrun
    if distributed and (summary or pause_at):
        raise click.UsageError("--summary and --pause-at-step are single-process only (not under torchrun)")
    overrides = _overrides(config_name, sets, seed, threads)
    from ..trainer.config import METRICS  # lazy: as above
    require_metrics(METRICS, metric=retention.metric if retention else None, checkpoint_on_best=saving.on_best)
    from ..trainer.entry import train as run_train  # lazy: imports torch
    code = run_train(run_dir, config_name, steps, seed=seed, threads=threads, sets=overrides, flags=flags,
                     device=device, saving=saving, sample_every=sample_every,
                     retention=retention, async_save=async_save, amp=amp,
                     log_every=log_every, omit_rng_restore=omit_rng_restore, parallel=parallel,
                     allow_nonfinite=allow_nonfinite, allow_device_change=allow_device_change,
                     force_nonfinite_at=force_nonfinite_at,
                     summary=summary, pause_at=pause_at, dist_timeout=dist_timeout, mirror=mirror,
                     memory_every=memory_every, digests=state_digests)
    if distributed:
        from ..torch.distributed import exit_worker  # lazy: imports torch
        exit_worker(code)          # skip finalization: see exit_worker for the gloo abort it avoids
    sys.exit(code)



def _overrides(config_name: str, sets: tuple[str, ...], seed: int | None, threads: int | None) -> dict:
    """The --set overrides, checked with the config they change: values the trainer cannot run
    with are usage errors here, not failures deep in torch."""
    from ..trainer.config import for_run, parse_sets  # lazy: keeps `ckptfmt --help` fast
    try:
        overrides = parse_sets(sets)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        for_run(config_name, overrides, seed, threads)
    except ValueError as exc:
        raise click.UsageError(f"--config {config_name} --set: {exc}") from None
    return overrides
