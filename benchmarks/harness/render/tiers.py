"""Recovery tiers: the RAM save's stall, restarts from each tier, two-node launches, memory."""
from __future__ import annotations

import statistics
from typing import Any

from .md import mb, mm, table

TIERS = "tiers"
LABELS = {"12m": "12.8M", "120m": "120M"}
STALL = ("ckptfmt RAM save", "ckptfmt RAM save, async_save=True", "memcpy floor", "write to /dev/shm (no hash)",
         "DCP async_save", "DCP async_save, reused stager")
PARTS = (("start_s", "python start"), ("imports_s", "imports"), ("group_s", "process group"), ("model_s", "model"),
         ("optimizer_s", "AdamW"), ("manager_s", "manager (+DDP)"), ("restore_s", "restore"),
         ("first_step_s", "first step"))


def _label(size: str) -> str:
    return LABELS.get(size, size)


def stall(results: Any) -> str:
    sizes = results.doc(TIERS)["sizes"]
    have = [s for s, r in sizes.items() if "stall" in r]
    heads = [h for s in have for h in (f"{_label(s)}: ms, min / median", f"{_label(s)}: vs memcpy floor, mins / medians",
                                       f"{_label(s)}: peak RSS MB")]
    rows = []
    for name in STALL:
        if any(name not in sizes[s]["stall"]["contenders"] for s in have):
            continue
        cells = []
        for s in have:
            c = sizes[s]["stall"]["contenders"]
            floor = c["memcpy floor"]["s"]
            cells += [mm(c[name]["s"], 1e3, "{:.1f}"), f"{min(c[name]['s']) / min(floor):.1f}x / "
                      f"{statistics.median(c[name]['s']) / statistics.median(floor):.1f}x",
                      mb(statistics.median(c[name]["peak_rss"]))]
        rows.append([name, *cells])
    steps = [[_label(s), name, mm(c["step_nosave_s"], 1e3), mm(c["step_save_s"], 1e3, "{:.1f}"),
              mm(c["history_stall_s"], 1e3, "{:.1f}")]
             for s in have for name in STALL[:2] if (c := sizes[s]["stall"]["contenders"].get(name))]
    return (table(["contender", *heads], rows) + "\n\n"
            + table(["size", "manager", "step() without a save, ms", "step() with the RAM save, ms",
                     "its `stall_ms` in the history, ms"], steps) + "\n\n" + results.source(TIERS))


def _restart_rows(r: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]], bool]]:
    rows = []
    if "restarts" in r:
        rs = r["restarts"]
        rows += [("RAM (this node's tier)", rs["ram"], False), ("disk (RAM tier gone, pages evicted)", rs["disk"], False),
                 ("mirror: `ckptfmt import` of a file:// mirror, then restart", rs["mirror"], True)]
    if "peer" in r:
        rows += [("peer: 2 nodes, node 1 relaunched without its RAM", r["peer"]["peer"], False),
                 ("2 nodes, both relaunched with their RAM", r["peer"]["own_ram"], False)]
    return [row for row in rows if row[1]]


def restarts(results: Any) -> str:
    rows = []
    for s, r in results.doc(TIERS)["sizes"].items():
        for name, samples, imported in _restart_rows(r):
            total = [x["total_with_import_s"] if imported else x["total_s"] for x in samples]
            med = {k: statistics.median(x[k] for x in samples) for k, _ in PARTS}
            rows.append([_label(s), name, str(samples[0]["step"]), str(len(samples)), mm(total),
                         mm([x["import_s"] for x in samples]) if imported else "", *(f"{med[k]:.2f}" for k, _ in PARTS)])
    heads = ["size", "from", "resumed step", "reps", "total s, min / median", "`ckptfmt import` s", *(n for _, n in PARTS)]
    return table(heads, rows) + "\n\n" + results.source(TIERS)


def launches(results: Any) -> str:
    rows = []
    for s, r in results.doc(TIERS)["sizes"].items():
        for name, key in (("node 1 relaunched without its RAM (peer)", "peer"), ("both relaunched with their RAM", "own_ram")):
            got = [x for x in r.get("peer", {}).get(key, []) if "rendezvous_s" in x]
            if got:
                med = {k: statistics.median(x[k] for x in got)
                       for k in ("agent_start_s", "rendezvous_s", "worker_spawn_s", "start_s", "total_s")}
                rows.append([_label(s), name, f"{med['agent_start_s']:.2f}", f"{med['rendezvous_s']:.2f}",
                             f"{med['worker_spawn_s']:.2f}", f"{med['total_s'] - med['start_s']:.2f}"])
    return (table(["size", "two-node launch", "node 1's agent start s", "its rendezvous s", "worker spawn s",
                   "worker to first step s"], rows) + "\n\n" + results.source(TIERS))


def _groups(r: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]], bool]]:
    groups = []
    setups = r.get("restarts", {}).get("setups", [])
    for every in sorted({x["memory_every"] for x in setups}, key=lambda e: (e == 0, e)):
        for background in (False, True):
            runs = [x for x in setups if x["memory_every"] == every and x["async_save"] == background]
            groups.append((f"{every or 'off'}{', async_save' if background else ''}", runs, False))
    if "peer" in r:
        every = next((x["memory_every"] for x in setups if x["memory_every"]), "")
        groups.append((f"{every}, 2 nodes (per rank; du per node)", r["peer"]["setup"], True))
    return [g for g in groups if g[1]]


def memory(results: Any) -> str:
    rows = []
    for s, r in results.doc(TIERS)["sizes"].items():
        for label, runs, two in _groups(r):
            if two:
                hwm = statistics.median(max(v["VmHWM"] for v in x["rss"].values()) for x in runs)
                rss = statistics.median(max(v["VmRSS"] for v in x["rss"].values()) for x in runs)
                shm = statistics.median(max(x["shm_bytes"].values()) for x in runs)
            else:
                hwm = statistics.median(x["rss"]["VmHWM"] for x in runs)
                rss = statistics.median(x["rss"]["VmRSS"] for x in runs)
                shm = statistics.median(x["shm_bytes"] for x in runs)
            ram = [y for x in runs for y in x["ram_save_stall_s"]]
            dur = [y for x in runs for y in x["durable_save_stall_s"]]
            rows.append([_label(s), label, str(len(runs)), mb(hwm), mb(rss), mb(shm),
                         mm(ram, 1e3, "{:.0f}") if ram else "-", mm(dur, 1e3, "{:.0f}")])
    heads = ["size", "memory_every", "runs", "VmHWM MB", "VmRSS MB", "RAM tier (du) MB",
             "RAM save stall in the loop, ms, min / median", "durable save stall, ms"]
    return table(heads, rows) + "\n\n" + results.source(TIERS)


BLOCKS = {"tiers.stall": stall, "tiers.restarts": restarts, "tiers.launches": launches, "tiers.memory": memory}
