"""The core run (``peers``, benchmarks/run.py): the goals, the machine's limits, save, open,
load, validate and diff against the peers, compression, the reference trainer's stall."""
from __future__ import annotations

from typing import Any

from .md import fmt, ratio, table

RUN, RERUN = "latest", "stall"
WRITER = "durable write, no hash (limit)"

GOAL_ROWS = (   # (figure, goal, key in the run's goals)
    ("durable save with blake3 vs the same durable writer without hash", ">= 0.9x", "save_vs_durable_writer"),
    ("durable save with blake3 vs naive write+fsync", "(beside)", "save_vs_write_fsync"),
    ("durable save vs best peer (durable)", "> 1x", "save_vs_best_peer"),
    ("open", "< 1 ms", "open_ms"),
    ("load, hash verified, vs hash-then-copy floor (warm)", ">= 0.9x", "load_warm_vs_hash_then_copy"),
    ("load, hash verified, vs mmap+memcpy, copy only (warm)", "(beside)", "load_warm_vs_mmap_memcpy"),
    ("load, hash verified, vs safetensors (warm)", ">= 1.0x", "load_warm_vs_safetensors"),
    ("load, hash verified, vs torch.load (warm)", ">= 5x", "load_warm_vs_torch_load"),
    ("load, no hash, vs mmap+memcpy (warm)", ">= 0.9x", "load_warm_noverify_vs_mmap_memcpy"),
    ("load, no hash, vs safetensors (warm)", ">= 1.0x", "load_warm_noverify_vs_safetensors"),
    ("load, hash verified, cold vs uncached read", ">= 0.9x", "load_cold_vs_uncached_read"),
    ("deep validate (committed: hash + recorded facts) vs blake3 in memory", ">= 0.9x", "validate_vs_blake3_memory"),
    ("validate --scan (bare .bin: hash + value scan) vs blake3 in memory", "(beside)", "validate_scan_vs_blake3_memory"),
    ("diff of two generations: GB/s read, peak RSS", "RSS < 256 MB", "diff"),
)

FAIR_ROWS = (   # (figure, the limit it is measured against, goal, key in the run's goals)
    ("durable save with blake3", "the same durable writer without hash or facts (8 MiB writes, writeback every "
     "64 MiB, fsync, rename, dir fsync) over the same bytes", ">= 0.9x", "save_vs_durable_writer"),
    ("deep validate of a committed generation (one hash, recorded facts)", "blake3 of the same bytes in memory, "
     "both cores", ">= 0.9x", "validate_vs_blake3_memory"),
    ("`validate --scan` (a bare `.bin`: hash and value scan)", "the same", "(beside)", "validate_scan_vs_blake3_memory"),
    ("verified warm load into model + AdamW", "hash the mapped file, then mmap + memcpy into place (the floor of any "
     "loader that checks before it copies)", ">= 0.9x", "load_warm_vs_hash_then_copy"),
    ("the same", "mmap + memcpy, copy only", "(beside)", "load_warm_vs_mmap_memcpy"),
    ("unverified warm load", "safetensors `load_file`", ">= 1.0x", "load_warm_noverify_vs_safetensors"),
    ("verified cold load (pages evicted)", "an uncached sequential `read`", ">= 0.9x", "load_cold_vs_uncached_read"),
)


def _goal(g: dict[str, Any], key: str) -> str:
    if key == "diff":
        return f"{fmt(g['diff_gbps'])} GB/s, {fmt(g['diff_peak_rss_mb'], 1)} MB"
    if key not in g:
        return "not measured"
    return fmt(g[key], 3) + " ms" if key == "open_ms" else ratio(g[key])


def header(results: Any) -> str:
    rec = results.records(RUN)[0]
    m = rec["machine"]
    return (f"Measured {rec['date']} with `{rec['command']}` on {m['cpus']} cores, Python {m['python']}, torch "
            f"{m['torch']}, numpy {m['numpy']}. Median of the repetitions (min and max in "
            f"`benchmarks/results/{RUN}.jsonl`); contenders alternate within each repetition.")


def goals(results: Any) -> str:
    res = results.doc(RUN)
    rows = [[label, figure, goal, _goal(g, key)] for label, g in res["goals"].items() if isinstance(g, dict)
            for figure, goal, key in GOAL_ROWS]
    if "async_stall_over_sync" in res["goals"]:
        rows.append(["andrea-12m", "async save stall vs sync save stall", "<= 0.25x",
                     ratio(res["goals"]["async_stall_over_sync"])])
    return table(["size", "figure", "goal", "measured"], rows) + "\n\n" + results.source(RUN)


def fair_limits(results: Any) -> str:
    g = {k: v for k, v in results.doc(RUN)["goals"].items() if isinstance(v, dict)}
    rows = [[figure, limit, goal, *(_goal(g[s], key) for s in g)] for figure, limit, goal, key in FAIR_ROWS]
    return table(["figure", "limit it is measured against", "goal", *g], rows) + "\n\n" + results.source(RUN)


def _sizes(results: Any, draw: Any) -> str:
    parts = []
    for label, r in results.doc(RUN)["sizes"].items():
        parts.append(f"#### {label} ({r['n_params']:,} parameters, {r['bytes'] / 1e9:.3f} GB)\n\n" + draw(r))
    return "\n\n".join(parts) + "\n\n" + results.source(RUN)


def limits(results: Any) -> str:
    return _sizes(results, lambda r: table(["machine limit", "GB/s"], [[k, fmt(v["gbps"])] for k, v in r["limits"].items()]))


def saves(results: Any) -> str:
    def draw(r: dict[str, Any]) -> str:
        wf = r["save"][WRITER]["gbps"] if WRITER in r["save"] else r["limits"]["write_fsync"]["gbps"]
        best = max(v["gbps"] for k, v in r["save"].items() if k not in ("ckptfmt", WRITER))
        return table(["durable save", "GB/s", "vs durable write, no hash", "vs best peer", "peak RSS MB", "file bytes"],
                     [[k, fmt(v["gbps"]), ratio(v["gbps"] / wf), ratio(v["gbps"] / best), fmt(v["peak_rss_mb"], 0),
                       f"{v['bytes']:,}"] for k, v in r["save"].items()])
    return _sizes(results, draw)


def loads(results: Any) -> str:
    def draw(r: dict[str, Any]) -> str:
        lim = r["load"]["warm"]["mmap+memcpy (limit)"]["gbps"]
        return table(["load into model + AdamW", "warm GB/s", "vs mmap+memcpy", "cold GB/s", "peak RSS MB (warm)"],
                     [[k, fmt(v["gbps"]), ratio(v["gbps"] / lim), fmt(r["load"]["cold"][k]["gbps"]),
                       fmt(v["peak_rss_mb"], 0)] for k, v in r["load"]["warm"].items()])
    return _sizes(results, draw)


def opens(results: Any) -> str:
    return _sizes(results, lambda r: table(["open", "ms"], [[k, fmt(v["ms"], 3)] for k, v in r["open"].items()]))


def validates(results: Any) -> str:
    return _sizes(results, lambda r: table(["operation", "GB/s", "peak RSS MB"], [
        [k, fmt(v["gbps"]), fmt(v["peak_rss_mb"], 1)] for k, v in r["validate_diff"].items()]))


def compression(results: Any) -> str:
    res, parts = results.doc(RUN), []
    for key, title in (("compression_tiny_trained", "tiny, trained 400 steps"),
                       ("compression_andrea12m_20_steps", "andrea-12m, trained 20 steps")):
        if key in res:
            parts.append(f"#### {title}\n\n" + table(["choice", "ratio", "compress GB/s", "decompress GB/s"], [
                [k, fmt(v["ratio"], 3), fmt(v["compress_gbps"]), fmt(v["decompress_gbps"])] for k, v in res[key].items()]))
    if not parts:
        raise KeyError("compression")
    return "\n\n".join(parts) + "\n\n" + results.source(RUN)


def trainer(results: Any) -> str:
    t = results.doc(RUN)["train"]
    speed = table(["config", "steps/s", "s/step", "steps timed"], [
        [k, fmt(v["steps_per_s"], 3), fmt(v["s_per_step"], 3), str(v["steps"])] for k, v in t["steps_per_s"].items()])
    stall = table(["andrea-12m checkpoint", "stall ms, median (min-max, n)", "fraction of a step"], [
        [k, f"{fmt(t['stall'][k]['ms'], 1)} ({fmt(t['stall'][k]['min'], 1)}-{fmt(t['stall'][k]['max'], 1)}, "
            f"{t['stall'][k]['n']})", fmt(t["stall"][k]["fraction_of_step"], 3)] for k in ("sync", "async")])
    return speed + "\n\n" + stall + "\n\n" + results.source(RUN)


def stall_rerun(results: Any) -> str:
    s = results.doc(RERUN)["stall"]
    rows = [[k, f"{fmt(s[k]['median'], 1)} ({fmt(s[k]['min'], 1)}-{fmt(s[k]['max'], 1)}, {s[k]['n']})"]
            for k in ("sync", "async")]
    rows.append(["async / sync (medians)", ratio(s["async_over_sync"])])
    return table(["andrea-12m checkpoint", "stall ms, median (min-max, n)"], rows) + "\n\n" + results.source(RERUN)


BLOCKS = {"peers.header": header, "peers.goals": goals, "peers.fair-limits": fair_limits, "peers.limits": limits,
          "peers.save": saves, "peers.load": loads, "peers.open": opens, "peers.validate": validates,
          "peers.compression": compression, "peers.trainer": trainer, "peers.stall-rerun": stall_rerun}
