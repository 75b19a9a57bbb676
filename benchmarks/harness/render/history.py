"""A run at the seed's scale: the commands over long histories, tree against tree, and the
read of the history's root digests."""
from __future__ import annotations

from typing import Any

from .md import table

SCALE, MILLION, STREAM, ROOTS = "history_scale", "history_scale_1m", "history_stream", "roots_scan"
DIGESTS = "digests"
COST = "cost (manager's step, median on - off, / median step off)"
METRICS = (("seconds", "s", "{:.2f}"), ("peak_rss_mb", "MB", "{:.0f}"))


def _row(r: dict[str, Any]) -> str:
    load = "-".join(str(x) for x in r.get("load_avg_1min", []))
    return f"{r['steps']:,} ({r['history_lines']:,}, {r['history_bytes'] / 1e6:.1f}), {load}"


def _tables(docs: list[dict[str, Any]], by_metric: bool) -> list[str]:
    """Cells "tree -> tree" (before -> after) per command: one table per metric, or (the stream
    run) one table with every command's seconds then every command's MB."""
    names = list(docs[0]["trees"])
    commands = list(docs[0]["results"][0]["measured"][names[0]])
    lengths = [r for d in docs for r in d["results"]]

    def cells(r: dict[str, Any], metric: str, form: str) -> list[str]:
        return [" -> ".join(form.format(r["measured"][n][c][metric]["median"]) for n in names) for c in commands]
    if by_metric:
        return [table(["steps (lines, MB), load", *(f"{c} ({unit})" for c in commands)],
                      [[_row(r), *cells(r, metric, form)] for r in lengths]) for metric, unit, form in METRICS]
    heads = [f"{c} ({unit})" for _, unit, _ in METRICS for c in commands]
    return [table(["steps (lines, MB), load", *heads],
                  [[_row(r)] + [x for metric, _, form in METRICS for x in cells(r, metric, form)] for r in lengths])]


def _scale(results: Any) -> list[dict[str, Any]]:
    """The 20,000-200,000 run, and the 1,000,000-step run where there is one, as rows of one table."""
    return [results.doc(SCALE)] + ([results.doc(MILLION)] if results.has(MILLION) else [])


def scale_seconds(results: Any) -> str:
    return _tables(_scale(results), True)[0] + "\n\n" + results.source(SCALE, MILLION)


def scale_rss(results: Any) -> str:
    return _tables(_scale(results), True)[1] + "\n\n" + results.source(SCALE, MILLION)


def baselines(results: Any) -> str:
    rows = []
    for stem in (SCALE, MILLION, STREAM):
        if results.has(stem):
            d = results.doc(stem)
            rows += [[f"`{stem}`", f"`{tree}` ({d['revisions'][tree][:7]})", f"{b['cli_ls_empty_dir_mb']:.1f}",
                      f"{b['cli_and_pyplot_import_mb']:.1f}"] for tree, b in d["baseline_rss"].items()]
    return table(["results", "tree", "interpreter + CLI (`ls` of an empty directory), MB",
                  "with matplotlib's pyplot, MB"], rows)


def stream(results: Any) -> str:
    return _tables([results.doc(STREAM)], False)[0] + "\n\n" + results.source(STREAM)


def roots(results: Any) -> str:
    d = results.doc(ROOTS)
    s = d["seconds"]
    base = s["roots.recorded"]["median"]
    rows = [[f"`{name}`" if name == "roots.recorded" else name, f"{v['min']:.3f}", f"{v['median']:.3f}",
             f"{v['median'] / base:.0f}x"] for name, v in s.items()]
    return (table([f"read of a {d['steps']:,}-step history ({d['bytes'] / 1e6:.0f} MB), {d['reps']} repetitions",
                   "s, min", "s, median", "time vs `roots.recorded` (medians)"], rows) + "\n\n" + results.source(ROOTS))


def digests(results: Any) -> str:
    d = results.doc(DIGESTS)
    rows = [[name, *(f"{v[clock][k]:.3f}" for clock in ("wall", "cpu") for k in ("min_ms", "median_ms"))]
            for name, v in d["contenders"].items()]
    h = d["history"]
    said = (f"The digests' cost, the manager's step's medians on - off over the median step off: "
            f"{d[COST + ', cpu'] * 100:.2f} % by the CPU clock, {d[COST + ', wall'] * 100:.2f} % by the wall clock "
            f"(the whole steps' medians: {d['cost (median step, on / off - 1), cpu'] * 100:+.2f} % CPU, "
            f"{d['cost (median step, on / off - 1), wall'] * 100:+.2f} % wall); load average "
            f"{d['load_avg_1min_before']:.1f} before, {d['load_avg_1min_after']:.1f} after. `state` adds "
            f"{h['bytes_per_step']:.0f} bytes to a step's line ({h['line_bytes_without_state']:.0f} without it; "
            f"{len(h['components'])} components): {h['bytes_at_200k_steps'] / 1e6:.1f} MB at 200,000 steps.")
    return (table([f"{d['config']} config, {d['reps']} x {d['block']} steps each way", "min ms, wall",
                   "median ms, wall", "min ms, CPU", "median ms, CPU"], rows)
            + "\n\n" + said + "\n\n" + results.source(DIGESTS))


BLOCKS = {"history.seconds": scale_seconds, "history.rss": scale_rss, "history.baselines": baselines,
          "history.stream": stream, "history.roots": roots, "history.digests": digests}
