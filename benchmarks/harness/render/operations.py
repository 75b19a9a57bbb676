"""The benchmarks of one operation on local files: value facts at save, the writer's buffer
contract, the sharded save, scale, the load's schedules, export, compression."""
from __future__ import annotations

from typing import Any

from .md import fmt, ratio, table

FACTS_ROWS = ("save", "save, no facts", "write only", "validate (recorded facts)", "validate --scan", "facts pass alone",
              "blake3, 1 thread, alone")
SCALE_OPS = ("save", "open", "validate", "validate --scan", "load (verified)", "diff")


def _facts(results: Any, stem: str) -> str:
    doc = results.doc(stem)
    labels = list(doc["sizes"])
    sizes = [doc["sizes"][k] for k in labels]
    rows = [[name] + [f"{r[name]['median']:.3f} s ({r[name]['min']:.3f}-{r[name]['max']:.3f}), {r[name]['gbps']:.2f} GB/s"
                      for r in sizes] for name in FACTS_ROWS]
    speed = "save vs write only (speed, median)"
    rows += [["save with facts / without (time, medians)"] + [f"{r['save cost of facts (median ratio)']:.3f}" for r in sizes],
             ["speed vs write only: save / save, no facts"]
             + [f"{ratio(r[speed]['save'])} / {ratio(r[speed]['save, no facts'])}" for r in sizes],
             ["validate: --scan time / recorded time"] + [ratio(r["validate speed-up (median ratio)"]) for r in sizes],
             ["load average (1 min) before, after"] + [f"{r['load_before'][0]:.1f}, {r['load_after'][0]:.1f}" for r in sizes]]
    heads = [f"{k} ({doc['sizes'][k]['bytes'] / 1e9:.3f} GB)" for k in labels]
    return table(["", *heads], rows) + "\n\n" + results.source(stem)


def facts(results: Any) -> str:
    return _facts(results, "facts")


def facts_120m(results: Any) -> str:
    return _facts(results, "facts_120m_11reps")


def writer_contract(results: Any) -> str:
    rows = []
    for label, r in results.doc("writer_contract")["sizes"].items():
        gb = r["after"]["gbps"] * r["after"]["median"]          # the bytes written, from the run's own rate

        def cell(k: str, r: dict = r) -> str:
            return f"{r[k]['median']:.3f} s ({r[k]['min']:.3f}-{r[k]['max']:.3f})"
        rows.append([f"{label}, {gb:.3f} GB", cell("write+fsync"),
                     f"{cell('before')}, {ratio(r['ratio_vs_write_fsync']['before'])}",
                     f"{cell('after')}, {ratio(r['ratio_vs_write_fsync']['after'])}", ratio(r["after_vs_before"])])
    return (table(["size", "write + fsync", "save before", "save after", "after / before (speed)"], rows) + "\n\n"
            + results.source("writer_contract"))


def sharded(results: Any) -> str:
    doc = results.doc("sharded_save")
    rows = [[str(k), fmt(r["gbps"])] + ([f"{r['median_s']:.3f}"] if "median_s" in r else ["not recorded"])
            for k, r in doc["ranks"].items()]
    rows.append(["2 ranks / 1 rank", ratio(doc["speedup_2_over_1"]), ""])
    return (table(["ranks", "GB/s (all ranks together)", "s, median (the better of two runs)"], rows) + "\n\n"
            + results.source("sharded_save"))


def scale(results: Any) -> str:
    doc = results.doc("scale")
    labels = list(doc["sizes"])
    rows = []
    for op in SCALE_OPS:
        cells = []
        for k in labels:
            r = doc["sizes"][k][op]
            rate = f"{r['median'] * 1e3:.2f} ms" if op == "open" else f"{r['median']:.2f} s, {r['gbps']:.2f} GB/s"
            cells.append(f"{rate}, {r['peak_rss_mb']:.0f} MB")
        rows.append([op, *cells])
    heads = [f"{k} ({doc['sizes'][k]['bytes'] / 1e9:.2f} GB)" for k in labels]
    return table(["operation", *heads], rows) + "\n\n" + results.source("scale")


def load_variants(results: Any) -> str:
    doc = results.doc("load_variants")
    rows = [[name, fmt(doc["median_ms"][name], 1), ratio(doc["vs_copy_limit"][name])] for name in doc["median_ms"]]
    return table(["variant", "ms (median)", "vs copy only"], rows) + "\n\n" + results.source("load_variants")


def export(results: Any) -> str:
    d = results.doc("export")
    rows = [["`cp -r` + `sync`", f"{d['cp_sync_s'] * 1e3:.0f}", fmt(d["cp_gbps"])],
            ["`ckptfmt export`", f"{d['export_s'] * 1e3:.0f}", fmt(d["export_gbps"])],
            ["export / copy (time)", ratio(d["export_over_cp"], 1), ""]]
    return (table([f"copy of a run ({d['bytes']:,} bytes)", "ms, median", "GB/s"], rows) + "\n\n"
            + results.source("export"))


def compress(results: Any) -> str:
    rows = []
    for name, c in results.doc("compress").items():
        for i, r in enumerate(c["rows"]):
            form = "`.zst` (standard)" if r["form"] == "zst" else "`.ckz` (byte planes)"
            zstd_d = {True: "yes", False: "no"}.get(r.get("zstd_d_equals_bin"), "no: not a zstd file")
            level = f"{r['level']} (the default)" if r["level"] == 1 else str(r["level"])
            rows.append([f"{name} ({c['bytes']:,} B)" if i == 0 else "", form, level, fmt(r["ratio"], 3),
                         f"{r['compress_mb_s']:.0f}", f"{r['decompress_mb_s']:.0f}", zstd_d])
    heads = ["checkpoint", "form", "level", "ratio", "compress MB/s", "decompress MB/s", "`zstd -d` gives the `.bin`"]
    return table(heads, rows) + "\n\n" + results.source("compress")


BLOCKS = {"facts": facts, "facts.120m": facts_120m, "writer-contract": writer_contract, "sharded-save": sharded,
          "scale": scale, "load-variants": load_variants, "export": export, "compress": compress}
