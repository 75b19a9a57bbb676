"""The pictures of docs/benchmarks/img/, where a comparison reads better than its table: the
save and the load against their limits and peers, time and memory against size, the history
commands' memory against the history's length, the RAM save's stall against its contenders.
Each is drawn from the same results as the tables; none is checked byte for byte (matplotlib's
output depends on its version and fonts), only that it exists."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    _pyplot().close(fig)


def save_load(results: Any, path: Path) -> None:
    res = results.doc("latest")
    plt = _pyplot()
    sizes = list(res["sizes"])
    fig, axes = plt.subplots(len(sizes), 2, figsize=(13, 4.2 * len(sizes)), squeeze=False)
    for row, label in enumerate(sizes):
        r = res["sizes"][label]
        ax = axes[row][0]
        names = list(r["save"])
        ax.barh(names, [r["save"][k]["gbps"] for k in names],
                color=["tab:red" if "limit" in k else "tab:blue" if k == "ckptfmt" else "tab:gray" for k in names])
        ax.axvline(r["limits"]["write_fsync"]["gbps"], color="tab:red", ls="--", label="write + fsync")
        ax.set_title(f"{label}: durable save, GB/s (higher is better)")
        ax.invert_yaxis()
        ax.legend(fontsize=8)
        ax = axes[row][1]
        names = list(r["load"]["warm"])
        ax.barh(names, [r["load"]["warm"][k]["gbps"] for k in names],
                color=["tab:red" if "limit" in k or "floor" in k else "tab:blue" if k.startswith("ckptfmt") else "tab:gray"
                       for k in names])
        ax.set_title(f"{label}: load into model + AdamW, warm, GB/s")
        ax.invert_yaxis()
    _save(fig, path)


def scale(results: Any, path: Path) -> None:
    doc = results.doc("scale")
    plt = _pyplot()
    labels = list(doc["sizes"])
    ops = list(doc["sizes"][labels[0]])
    ops = [op for op in ops if isinstance(doc["sizes"][labels[0]][op], dict)]
    gb = [doc["sizes"][k]["bytes"] / 1e9 for k in labels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for op in ops:
        left.plot(gb, [doc["sizes"][k][op]["median"] for k in labels], marker="o", label=op)
        right.plot(gb, [doc["sizes"][k][op]["peak_rss_mb"] for k in labels], marker="o", label=op)
    left.set(xscale="log", yscale="log", xlabel="file size, GB", ylabel="seconds (median, cold)",
             title="time vs size (a slope of 1 is linear)")
    right.set(xscale="log", xlabel="file size, GB", ylabel="peak RSS above start, MB",
              title="peak RSS vs size (load: beyond the model)")
    right.axhline(256, color="tab:red", ls="--", label="256 MB bound")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    _save(fig, path)


def history_rss(results: Any, path: Path) -> None:
    """Peak RSS of validate, bisect and plot against the history's length: a colour per
    command, dashed before and solid after, a marker per run of the benchmark."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours = {"validate": "tab:blue", "bisect": "tab:orange", "plot": "tab:green"}
    for stem, marker in (("history_scale", "o"), ("history_stream", "s")):
        if not results.has(stem):
            continue
        docs = [results.doc(stem)] + ([results.doc("history_scale_1m")] if stem == "history_scale"
                                      and results.has("history_scale_1m") else [])
        lengths = [r for d in docs for r in d["results"]]
        for i, tree in enumerate(docs[0]["trees"]):
            for op, colour in colours.items():
                got = [(r["steps"], r["measured"][tree][op]["peak_rss_mb"]["median"]) for r in lengths
                       if op in r["measured"][tree]]
                if got:
                    ax.plot(*zip(*got), marker=marker, color=colour, ls="--" if i == 0 else "-",
                            label=f"{op}, {docs[0]['revisions'][tree][:7]}")
    ax.set(xscale="log", yscale="log", xlabel="history length, steps", ylabel="peak RSS, MB (whole process)",
           title="history commands: memory vs length (dashed: before, solid: after)")
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


def tiers_stall(results: Any, path: Path) -> None:
    import statistics

    from .tiers import LABELS
    sizes = results.doc("tiers")["sizes"]
    plt = _pyplot()
    have = [s for s, r in sizes.items() if "stall" in r]
    fig, axes = plt.subplots(1, len(have), figsize=(6.5 * len(have), 3.8), squeeze=False)
    for ax, s in zip(axes[0], have):
        c = sizes[s]["stall"]["contenders"]
        names = list(c)
        ax.barh(names, [statistics.median(c[n]["s"]) * 1e3 for n in names], color="tab:gray", label="median")
        ax.barh(names, [min(c[n]["s"]) * 1e3 for n in names], color="tab:blue", label="min")
        ax.invert_yaxis()
        ax.set(xlabel="ms the loop waits", title=f"{LABELS.get(s, s)}: the stall of one save to RAM, and its contenders")
        ax.legend(fontsize=8)
    _save(fig, path)


PLOTS: dict[str, tuple[str, Callable[[Any, Path], None]]] = {
    "save-load.png": ("latest", save_load), "scale.png": ("scale", scale),
    "history-rss.png": ("history_scale", history_rss), "tiers-stall.png": ("tiers", tiers_stall)}


def draw_all(results: Any, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, (stem, draw) in PLOTS.items():
        if results.has(stem):
            draw(results, folder / name)
            out.append(folder / name)
    return out
