"""``ckptfmt plot``: the loss history of one or more runs on one chart (raw and EMA), with
committed generations, pivots, resumes after crashes and fork points marked, and the
curriculum's source shares over time below. Needs matplotlib (the ``plot`` extra)."""
from __future__ import annotations

import math
import os
from collections import Counter
from itertools import chain, islice
from pathlib import Path
from typing import Any

from .. import atomic
from ..run import history as hist
from ..run import timeline
from ..errors import DestinationExistsError, EmptyRunError, HistoryCorruptError, MissingDependencyError
from ..run.storerun import open_run

__all__ = ["plot", "series"]

EVENT_STYLE = {"pivot": ("tab:red", "--"), "resume": ("tab:orange", ":"), "fork": ("tab:purple", "-.")}


POINTS = 2000      # step buckets per run: more than the chart is pixels wide (11 in at 110 dpi)


def series(run_dir: str, ema: float | None = None, window: int | None = None,
           points: int | None = None) -> dict[str, Any]:
    """The data the chart draws, as plain lists (tested without matplotlib). The EMA and the
    share window scale with the run length unless given: ~1/50 of the run, within sane bounds.

    The canonical history is streamed in step order (``run.timeline``: a few numbers per
    resume, no index), and only its first ``LONG`` steps are held, to learn the length where
    the EMA span depends on it. With ``points``, a history of more steps is summed up in
    ``points`` buckets of steps (narrower than a pixel): ``low`` and ``high``, the lowest and
    highest finite loss of each, ``loss`` their mean, ``ema`` at the bucket's first and last
    step, in ``steps``. ``history_steps``: the length of the history.

    Examples:
        >>> import os
        >>> from ckptfmt.run import History
        >>> from ckptfmt.tools.plot import series
        >>> os.makedirs("curve", exist_ok=True)
        >>> history = History("curve/.loss.json")
        >>> for step in range(1, 4):
        ...     history.append({"step": step, "loss": 1.0 / step})
        >>> history.close()
        >>> drawn = series("curve", ema=0.5)
        >>> drawn["steps"], drawn["ema"]
        ([1, 2, 3], [1.0, 0.75, 0.5416666666666666])
    """
    run = open_run(run_dir)            # a URL: a run on object storage, its history's segments
    plan = timeline.plan(run.history.source, events=tuple(EVENT_STYLE))
    walk = (_point(rec, plan.path) for rec in plan.records())
    head = list(islice(walk, max(LONG, points or 0) + 1))        # all of it, if not longer
    span = max(5, min(len(head) // 50, 500))
    ema = 1 - 1 / span if ema is None else ema
    window = max(10, span * 2) if window is None else window
    gens = [g.step for g in run.generations() if g.committed]
    buckets = points if points and len(head) > points else None
    curve = Curve(ema, buckets, (head[0][0], plan.last_step) if head else (0, 0), set(gens))
    shares, steps = Shares(window), 0
    for step, loss, source in chain(head, walk):
        curve.add(step, loss)
        shares.add(step, source)
        steps += 1
    events = [{"event": kind, "step": step} for kind, step in plan.events]
    return {"run": run_dir, **curve.drawn(), "generations": gens, "events": events,
            **shares.drawn(), "history_steps": steps, "smoothing": {"ema": ema, "window": window}}


LONG = 25_000       # steps from which the EMA span is its longest (500 = LONG // 50)


def _point(rec: dict[str, Any], path: str) -> tuple[int, float, Any]:
    """(step, loss, source) of a canonical record. A record without a loss is a gap in the
    curve (``CheckpointManager.step(step)`` logs none); one whose loss is not a number (or
    "nan", "inf", "-inf") is refused (``HistoryCorruptError``)."""
    loss = rec.get("loss", "nan")
    try:
        if not isinstance(loss, (int, float, str)):
            raise ValueError
        return rec["step"], hist.decode_float(loss), rec.get("source")
    except (ValueError, OverflowError):
        raise HistoryCorruptError(path, f"step {rec['step']} has a loss that is not a number: "
                                             f"{loss!r:.40}") from None


class Curve:
    """The loss and its EMA (over every step), step by step: every point, or with ``buckets``
    each bucket's lowest, highest and mean finite loss, so that a chart of 200,000 steps draws
    a band over a few thousand buckets that covers the pixels the 200,000 points would, at a
    fraction of the memory and time (a bucket of only NaN or inf losses is a gap, as those
    points were). ``at_generations``: the EMA at each generation's step.

    Examples:
        >>> from ckptfmt.tools.plot import Curve
        >>> curve = Curve(0.5, None, (1, 3), generations={2})
        >>> for step, loss in ((1, 1.0), (2, 0.5), (3, 0.25)):
        ...     curve.add(step, loss)
        >>> curve.drawn()
        {'steps': [1, 2, 3], 'loss': [1.0, 0.5, 0.25], 'ema': [1.0, 0.75, 0.5], 'generation_ema': [(2, 0.75)]}
    """

    def __init__(self, ema: float, buckets: int | None, first_last: tuple[int, int], generations: set[int]):
        self.ema, self.buckets, self.generations = ema, buckets, generations
        self.first, self.width = first_last[0], first_last[1] - first_last[0] + 1
        self.acc: float | None = None
        self.points: list[tuple[float, ...]] = []     # (step, loss, ema) or (step, mean, ema, low, high)
        self.bucket: int | None = None
        self.start = self.last = (0, math.nan)         # (step, ema) of the bucket's first and last step
        self.low, self.high, self.total, self.finite = math.inf, -math.inf, 0.0, 0
        self.at_generations: dict[int, float] = {}

    def add(self, step: int, loss: float) -> None:
        acc = self.acc
        acc = loss if acc is None or acc != acc else self.ema * acc + (1 - self.ema) * loss
        self.acc = acc
        if step in self.generations:
            self.at_generations[step] = acc
        if self.buckets is None:
            self.points.append((step, loss, acc))
            return
        bucket = (step - self.first) * self.buckets // self.width
        if bucket != self.bucket:
            self._flush()
            self.bucket, self.start = bucket, (step, acc)
            self.low, self.high, self.total, self.finite = math.inf, -math.inf, 0.0, 0
        self.last = (step, acc)
        if math.isfinite(loss):
            self.low, self.high = min(self.low, loss), max(self.high, loss)
            self.total += loss
            self.finite += 1

    def _flush(self) -> None:
        """The bucket as two points, at its first and its last step: the band covers the steps
        of the bucket, and the EMA line passes through its value at both."""
        if self.bucket is None:
            return
        summary = (self.total / self.finite, self.low, self.high) if self.finite else (math.nan,) * 3
        for step, acc in (self.start, self.last):
            self.points.append((step, summary[0], acc, summary[1], summary[2]))

    def drawn(self) -> dict[str, list]:
        """``steps``, ``loss`` and ``ema`` (and with buckets ``low`` and ``high``) of the points
        to draw, and ``generation_ema``: (step, EMA) of each generation in the history."""
        self._flush()
        self.bucket = None
        names = ("steps", "loss", "ema") + (("low", "high") if self.buckets else ())
        return {**{name: [p[k] for p in self.points] for k, name in enumerate(names)},
                "generation_ema": sorted(self.at_generations.items())}


class Shares:
    """Each source's share of the steps in consecutive windows of ``window`` canonical steps.
    A history of more than ``POINTS`` windows has its windows merged in pairs (the window
    doubles) whenever they would pass ``POINTS``, so the chart holds at most ``POINTS`` of them,
    still narrower than a pixel, at any length.

    Examples:
        >>> from ckptfmt.tools.plot import Shares
        >>> shares = Shares(window=2)
        >>> for step, source in enumerate(["code", "code", "code", "topics"], start=1):
        ...     shares.add(step, source)
        >>> shares.drawn()
        {'share_steps': [1.5, 3.5], 'shares': {'code': [1.0, 0.5], 'topics': [0.0, 0.5]}}
    """

    def __init__(self, window: int, most: int = POINTS):
        self.window, self.filled, self.most = window, window, max(2, most - most % 2)
        self.blocks: list[tuple[int, int, Counter]] = []    # (first step, last step, sources)

    def add(self, step: int, source: Any) -> None:
        if self.filled == self.window:
            if len(self.blocks) == self.most:
                self._merge_pairs()
            self.blocks.append((step, step, Counter()))
            self.filled = 0
        first, _, counts = self.blocks[-1]
        counts[source] += 1
        self.filled += 1
        self.blocks[-1] = (first, step, counts)

    def _merge_pairs(self) -> None:
        """Every two full windows become one of twice the width (``most`` is even)."""
        pairs = zip(self.blocks[0::2], self.blocks[1::2])
        self.blocks = [(a[0], b[1], a[2] + b[2]) for a, b in pairs]
        self.window *= 2

    def drawn(self) -> dict[str, Any]:
        """``share_steps`` (each window's middle) and ``shares`` (source -> share per window)."""
        sources = sorted({s for _, _, counts in self.blocks for s in counts if s})
        return {"share_steps": [(first + last) / 2 for first, last, _ in self.blocks],
                "shares": {s: [counts[s] / sum(counts.values()) for _, _, counts in self.blocks] for s in sources}}


def plot(run_dirs: list[str], out: str) -> dict[str, Any]:
    """Draw the loss (raw and EMA) of each run with its events into ``out`` (a .png, .svg or
    .pdf); needs matplotlib (``MissingDependencyError`` otherwise). Returns what was drawn.

    An existing ``out`` is never replaced (``DestinationExistsError``), a run without a loss
    history is refused (``EmptyRunError``: an empty picture would look like a result), and the
    picture is written durably under a temp name, so a failure leaves nothing at ``out``.

    Examples:
        >>> import os
        >>> from ckptfmt.run import History
        >>> from ckptfmt.tools.plot import plot
        >>> os.makedirs("plotted", exist_ok=True)
        >>> history = History("plotted/.loss.json")
        >>> for step in range(1, 6):
        ...     history.append({"step": step, "loss": 1.0 / step})
        >>> history.close()
        >>> _ = plot(["plotted"], "loss.png")
        >>> os.path.getsize("loss.png") > 0
        True
    """
    if os.path.lexists(out):
        raise DestinationExistsError(out, "exists already; refusing to overwrite (choose a new --out)")
    data = [series(r, points=POINTS) for r in run_dirs]
    for d in data:
        if not d["history_steps"]:
            raise EmptyRunError(d["run"], f"no loss history to plot ({hist.NAME} is missing or empty)")
    longest = max(data, key=lambda d: d["history_steps"])["smoothing"]
    data = [d if d["smoothing"] == longest else series(d["run"], points=POINTS, **longest)
            for d in data]                              # runs compared smooth alike (a fork, a retry)
    try:
        import matplotlib  # lazy: the optional plot extra, here only
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: as matplotlib
    except ImportError:
        raise MissingDependencyError(out, "plot needs matplotlib: pip install 'ckptfmt[plot]'") from None
    fig, legend = _draw(plt, data)
    _save_figure(plt, fig, out)
    return {"out": out, "legend": legend,
            "runs": [{"run": d["run"], "steps": d["history_steps"], "events": len(d["events"]),
                      "smoothing": d["smoothing"]} for d in data]}


def _draw(plt: Any, data: list[dict[str, Any]]) -> tuple[Any, list[str]]:
    """The figure of the runs' series: loss and EMA above, source shares below; and the labels
    of its legend (an event kind only where one is drawn)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=[3, 1])
    for i, d in enumerate(data):
        name, color = Path(d["run"]).name, f"C{i % 10}"     # the colour cycle's, as plot() picks them
        if "low" in d:                                     # a band: cheap to draw, same pixels
            top.fill_between(d["steps"], d["low"], d["high"], color=color, alpha=0.25, lw=0)
        else:
            top.plot(d["steps"], d["loss"], color=color, alpha=0.25, lw=0.8)
        top.plot(d["steps"], d["ema"], color=color, lw=1.8, label=f"{name} (EMA)")
        gx, gy = zip(*d["generation_ema"]) if d["generation_ema"] else ((), ())
        top.scatter(gx, gy, color=color, marker="|", s=120, zorder=3)
        for e in d["events"]:
            marker_color, style = EVENT_STYLE[e["event"]]
            top.axvline(e["step"], color=marker_color, ls=style, lw=1, alpha=0.8)
        for s, values in d["shares"].items():
            bottom.plot(d["share_steps"], values, label=f"{name}: {s}" if len(data) > 1 else s)
    shown = {e["event"] for d in data for e in d["events"]}          # a key only for what is drawn
    for kind, (color, style) in EVENT_STYLE.items():
        if kind in shown:
            top.plot([], [], color=color, ls=style, label=kind)
    top.scatter([], [], marker="|", color="gray", label="committed generation")
    top.set_ylabel("loss")
    # "best" looks for few data points and no lines: a band has points only on its outline, so
    # it would sit the legend inside; over a dense curve "best" chose the upper right, its first
    top.legend(fontsize=8, loc="upper right" if any("low" in d for d in data) else "best")
    top.set_title("ckptfmt: loss history")
    bottom.set_ylabel("source share")
    bottom.set_xlabel("step")
    if bottom.get_legend_handles_labels()[1]:        # a history without sources draws no shares
        bottom.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return fig, top.get_legend_handles_labels()[1]


def _save_figure(plt: Any, fig: Any, out: str) -> None:
    """Write the picture durably under a temp name and rename it to ``out`` (nothing at ``out``
    if drawing or writing fails); the figure is closed either way."""
    try:
        with atomic.AtomicWriter(out) as writer:
            with writer.fileobj() as f:
                fig.savefig(f, dpi=110, format=Path(out).suffix.lstrip(".").lower() or "png")
            writer.commit()
    finally:
        plt.close(fig)
