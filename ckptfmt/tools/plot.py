"""``ckptfmt plot``: the loss history of one or more runs on one chart (raw and EMA), with
committed generations, pivots, resumes after crashes and fork points marked, and the
curriculum's source shares over time below. Needs matplotlib (the ``plot`` extra)."""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from .. import atomic
from ..run import history as hist
from ..errors import DestinationExistsError, EmptyRunError, MissingDependencyError
from ..run import Run

__all__ = ["plot", "series"]

EVENT_STYLE = {"pivot": ("tab:red", "--"), "resume": ("tab:orange", ":"), "fork": ("tab:purple", "-.")}


def series(run_dir: str, ema: float | None = None, window: int | None = None) -> dict[str, Any]:
    """The data the chart draws, as plain lists (tested without matplotlib). The EMA and the
    share window scale with the run length unless given: ~1/50 of the run, within sane bounds."""
    read = hist.read(Path(run_dir) / hist.NAME)
    canon = read.canonical()
    span = max(5, min(len(canon) // 50, 500))
    ema = 1 - 1 / span if ema is None else ema
    window = max(10, span * 2) if window is None else window
    steps = [r["step"] for r in canon]
    loss = [hist.decode_float(r["loss"]) for r in canon]
    smooth, acc = [], None
    for x in loss:
        acc = x if acc is None or acc != acc else ema * acc + (1 - ema) * x
        smooth.append(acc)
    sources = sorted({r.get("source") for r in canon if r.get("source")})
    shares: dict[str, list[float]] = {s: [] for s in sources}
    share_steps = []
    for start in range(0, len(canon), window):
        block = Counter(r.get("source") for r in canon[start:start + window])
        chunk = canon[start:start + window]
        share_steps.append((chunk[0]["step"] + chunk[-1]["step"]) / 2)
        for s in sources:
            shares[s].append(block[s] / sum(block.values()))
    gens = [g.step for g in Run(run_dir).generations() if g.committed]
    events = [{"event": e["event"], "step": e["step"]} for e in read.events() if e["event"] in EVENT_STYLE]
    return {"run": run_dir, "steps": steps, "loss": loss, "ema": smooth, "generations": gens,
            "events": events, "share_steps": share_steps, "shares": shares}


def plot(run_dirs: list[str], out: str) -> dict[str, Any]:
    """Draw the loss (raw and EMA) of each run with its events into ``out`` (a .png, .svg or
    .pdf); needs matplotlib (``MissingDependencyError`` otherwise). Returns what was drawn.

    An existing ``out`` is never replaced (``DestinationExistsError``), a run without a loss
    history is refused (``EmptyRunError``: an empty picture would look like a result), and the
    picture is written durably under a temp name, so a failure leaves nothing at ``out``.
    """
    if os.path.lexists(out):
        raise DestinationExistsError(out, "exists already; refusing to overwrite (choose a new --out)")
    data = [series(r) for r in run_dirs]
    for d in data:
        if not d["steps"]:
            raise EmptyRunError(d["run"], f"no loss history to plot ({hist.NAME} is missing or empty)")
    try:
        import matplotlib  # lazy: the optional plot extra, here only
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: as matplotlib
    except ImportError:
        raise MissingDependencyError(out, "plot needs matplotlib: pip install 'ckptfmt[plot]'") from None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=[3, 1])
    for d in data:
        name = Path(d["run"]).name
        line, = top.plot(d["steps"], d["loss"], alpha=0.25, lw=0.8)
        top.plot(d["steps"], d["ema"], color=line.get_color(), lw=1.8, label=f"{name} (EMA)")
        by_step = dict(zip(d["steps"], d["ema"]))
        gx = [s for s in d["generations"] if s in by_step]
        top.scatter(gx, [by_step[s] for s in gx], color=line.get_color(), marker="|", s=120, zorder=3)
        for e in d["events"]:
            color, style = EVENT_STYLE[e["event"]]
            top.axvline(e["step"], color=color, ls=style, lw=1, alpha=0.8)
        for s, values in d["shares"].items():
            bottom.plot(d["share_steps"], values, label=f"{name}: {s}" if len(data) > 1 else s)
    for kind, (color, style) in EVENT_STYLE.items():
        top.plot([], [], color=color, ls=style, label=kind)
    top.scatter([], [], marker="|", color="gray", label="committed generation")
    top.set_ylabel("loss")
    top.legend(fontsize=8)
    top.set_title("ckptfmt: loss history")
    bottom.set_ylabel("source share")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    _save_figure(plt, fig, out)
    return {"out": out, "runs": [{"run": d["run"], "steps": len(d["steps"]), "events": len(d["events"])} for d in data]}


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
