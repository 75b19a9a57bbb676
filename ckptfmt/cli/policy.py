"""The policy flags (spec/RUN.md §5): what to keep (``gc``, ``ls``, ``train``, ``mirror``) and when
to save (``train``), each parsed into the run layer's one value, ``Policy`` or ``SavePolicy``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import click

if TYPE_CHECKING:
    from ..run.retention import Policy
    from ..run.saving import SavePolicy

POLICY_FLAGS = "--keep-last, --keep-every, --keep-best, --keep-within or --keep-interval"
DURATIONS = "90s, 30m, 6h, 2d"


def policy_options(fn: Callable) -> Callable:
    """The retention policy's flags (spec/RUN.md §5.1), the same on every command that keeps."""
    options = [
        click.option("--keep-last", type=click.IntRange(min=1), help="Keep the newest K generations."),
        click.option("--keep-every", type=click.IntRange(min=1), help="Keep steps divisible by N (milestones)."),
        click.option("--keep-best", type=click.IntRange(min=1), help="Keep the best K by --metric (NaN/inf never best)."),
        click.option("--metric", help="The metric of --keep-best, as the manifest records it (val_loss)."),
        click.option("--mode", type=click.Choice(["min", "max"]),
                     help="Whether the best value of --metric is the smallest or the largest (default: min)."),
        click.option("--keep-missing-metric/--no-keep-missing-metric", "keep_missing", default=None,
                     help="Keep generations that recorded no --metric (default: keep them)."),
        click.option("--keep-within", metavar="DURATION",
                     help=f"Keep generations committed within DURATION of the newest ({DURATIONS})."),
        click.option("--keep-interval", metavar="DURATION",
                     help="Keep the first generation committed in each DURATION (1h: one an hour)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def policy_of(keep_last: int | None = None, keep_every: int | None = None, keep_best: int | None = None,
              metric: str | None = None, mode: str | None = None, keep_missing: bool | None = None,
              keep_within: str | None = None, keep_interval: str | None = None) -> "Policy | None":
    """The ``Policy`` of the flags (None: no keep flag given); a usage error (exit 2) for what
    cannot be one, or a flag that would change nothing."""
    from ..run.retention import Policy  # lazy: keeps `ckptfmt --help` fast
    if keep_best is not None and metric is None:
        raise click.UsageError("--keep-best needs --metric NAME (the best K by which metric)")
    if keep_best is None and (metric, mode, keep_missing) != (None, None, None):
        raise click.UsageError("--metric, --mode and --[no-]keep-missing-metric need --keep-best K")
    if (keep_last, keep_every, keep_best, keep_within, keep_interval) == (None,) * 5:
        return None
    try:
        return Policy(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, metric=metric,
                      mode=mode or "min", keep_missing=keep_missing is not False,
                      keep_within=keep_within, keep_interval=keep_interval)
    except ValueError as exc:
        raise click.UsageError(f"--keep-within/--keep-interval: {exc}") from None


def save_options(fn: Callable) -> Callable:
    """When ``train`` commits a generation besides --checkpoint-every and the signals (§5.5)."""
    options = [
        click.option("--checkpoint-interval", metavar="DURATION",
                     help=f"Also commit a generation when DURATION of wall time passed since the newest "
                          f"save ({DURATIONS}): at most that much training is ever lost."),
        click.option("--checkpoint-on-best", metavar="METRIC",
                     help="Also commit a generation at each new best value of METRIC (loss, loss_ema); "
                          "NaN and inf are never best."),
        click.option("--checkpoint-best-mode", type=click.Choice(["min", "max"]),
                     help="Whether the best value of --checkpoint-on-best is the smallest or the largest "
                          "(default: min)."),
        click.option("--checkpoint-best-min-delta", type=click.FloatRange(min=0), metavar="X",
                     help="A new best must beat the best so far by more than X (default 0); a metric "
                          "that falls a little at nearly every step saves at nearly every step without it."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def save_policy_of(every: int | None, checkpoint_interval: str | None, checkpoint_on_best: str | None,
                   checkpoint_best_mode: str | None, checkpoint_best_min_delta: float | None) -> "SavePolicy":
    """The ``SavePolicy`` of the flags; a usage error (exit 2) for a bad duration, or a flag
    that would change nothing."""
    from ..run.retention import parse_duration  # lazy: keeps `ckptfmt --help` fast
    from ..run.saving import SavePolicy  # lazy: as above
    try:
        seconds = None if checkpoint_interval is None else parse_duration(checkpoint_interval)
    except ValueError as exc:
        raise click.UsageError(f"--checkpoint-interval: {exc}") from None
    if checkpoint_on_best is not None and not checkpoint_on_best.strip():
        raise click.UsageError("--checkpoint-on-best needs a metric name (loss, loss_ema)")
    if checkpoint_on_best is None and (checkpoint_best_mode, checkpoint_best_min_delta) != (None, None):
        raise click.UsageError("--checkpoint-best-mode and --checkpoint-best-min-delta need --checkpoint-on-best METRIC")
    return SavePolicy(every=every, every_seconds=seconds, on_best=checkpoint_on_best, mode=checkpoint_best_mode or "min",
                      min_delta=checkpoint_best_min_delta or 0.0)


def require_metrics(known: tuple[str, ...], **named: str | None) -> None:
    """A metric a flag names that the command's trainer never reports is a usage error (a typo
    would otherwise keep every generation as 'no NAME')."""
    for flag, metric in named.items():
        if metric is not None and metric not in known:
            raise click.UsageError(f"--{flag.replace('_', '-')}: the trainer reports no metric {metric!r} "
                                   f"(it reports {', '.join(known)})")
