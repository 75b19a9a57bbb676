"""Markdown tables from a benchmark result: python benchmarks/report.py benchmarks/results/latest.json"""
from __future__ import annotations

import json
import sys


def fmt(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def report(res: dict) -> str:
    parts = [f"Measured {res['date']} with `{res['command']}` on {res['machine']['cpus']} cores, "
             f"Python {res['machine']['python']}, torch {res['machine']['torch']}, numpy {res['machine']['numpy']}. "
             "Median of the repetitions (min-max in results/latest.json); contenders alternate within each repetition."]
    goals = res["goals"]
    rows = []
    for label, g in goals.items():
        if not isinstance(g, dict):
            continue
        rows += [[label, "durable save with blake3 vs the same durable writer without hash", ">= 0.9x",
                  fmt(g["save_vs_durable_writer"]) + "x" if "save_vs_durable_writer" in g else "not measured"],
                 [label, "durable save with blake3 vs naive write+fsync", "(beside)", fmt(g["save_vs_write_fsync"]) + "x"],
                 [label, "durable save vs best peer (durable)", "> 1x", fmt(g["save_vs_best_peer"]) + "x"],
                 [label, "open", "< 1 ms", fmt(g["open_ms"], 3) + " ms"],
                 [label, "load, hash verified, vs hash-then-copy floor (warm)", ">= 0.9x",
                  fmt(g["load_warm_vs_hash_then_copy"]) + "x" if "load_warm_vs_hash_then_copy" in g else "not measured"],
                 [label, "load, hash verified, vs mmap+memcpy, copy only (warm)", "(beside)", fmt(g["load_warm_vs_mmap_memcpy"]) + "x"],
                 [label, "load, hash verified, vs safetensors (warm)", ">= 1.0x", fmt(g["load_warm_vs_safetensors"]) + "x"],
                 [label, "load, hash verified, vs torch.load (warm)", ">= 5x", fmt(g["load_warm_vs_torch_load"]) + "x"],
                 [label, "load, no hash, vs mmap+memcpy (warm)", ">= 0.9x", fmt(g["load_warm_noverify_vs_mmap_memcpy"]) + "x"],
                 [label, "load, no hash, vs safetensors (warm)", ">= 1.0x", fmt(g["load_warm_noverify_vs_safetensors"]) + "x"],
                 [label, "load, hash verified, cold vs uncached read", ">= 0.9x", fmt(g["load_cold_vs_uncached_read"]) + "x"],
                 [label, "deep validate (committed: hash + recorded facts) vs blake3 in memory", ">= 0.9x",
                  fmt(g["validate_vs_blake3_memory"]) + "x"],
                 [label, "validate --scan (bare .bin: hash + value scan) vs blake3 in memory", "(beside)",
                  fmt(g["validate_scan_vs_blake3_memory"]) + "x" if "validate_scan_vs_blake3_memory" in g else "not measured"],
                 [label, "diff of two generations: GB/s read, peak RSS", "RSS < 256 MB",
                  f"{fmt(g['diff_gbps'])} GB/s, {fmt(g['diff_peak_rss_mb'], 1)} MB"]]
    if "async_stall_over_sync" in goals:
        rows.append(["andrea-12m", "async save stall vs sync save stall", "<= 0.25x", fmt(goals["async_stall_over_sync"]) + "x"])
    parts.append("### Goals\n\n" + table(["size", "figure", "goal", "measured"], rows))
    for label, r in res["sizes"].items():
        lim = r["limits"]
        parts.append(f"### {label} ({r['n_params']:,} parameters, {r['bytes'] / 1e9:.3f} GB)\n\n" + table(
            ["machine limit", "GB/s"], [[k, fmt(v["gbps"])] for k, v in lim.items()]))
        writer = "durable write, no hash (limit)"
        wf = r["save"][writer]["gbps"] if writer in r["save"] else lim["write_fsync"]["gbps"]
        best = max(v["gbps"] for k, v in r["save"].items() if k not in ("ckptfmt", writer))
        parts.append(table(["durable save", "GB/s", "vs durable write, no hash", "vs best peer", "peak RSS MB", "file bytes"],
                           [[k, fmt(v["gbps"]), fmt(v["gbps"] / wf) + "x", fmt(v["gbps"] / best) + "x",
                             fmt(v["peak_rss_mb"], 0), f"{v['bytes']:,}"] for k, v in r["save"].items()]))
        lim_w = r["load"]["warm"]["mmap+memcpy (limit)"]["gbps"]
        parts.append(table(["load into model + AdamW", "warm GB/s", "vs mmap+memcpy", "cold GB/s", "peak RSS MB (warm)"],
                           [[k, fmt(v["gbps"]), fmt(v["gbps"] / lim_w) + "x", fmt(r["load"]["cold"][k]["gbps"]),
                             fmt(v["peak_rss_mb"], 0)] for k, v in r["load"]["warm"].items()]))
        parts.append(table(["open", "ms"], [[k, fmt(v["ms"], 3)] for k, v in r["open"].items()]))
        parts.append(table(["operation", "GB/s", "peak RSS MB"],
                           [[k, fmt(v["gbps"]), fmt(v["peak_rss_mb"], 1)] for k, v in r["validate_diff"].items()]))
    for key in ("compression_tiny_trained", "compression_andrea12m_20_steps"):
        if key in res:
            parts.append(f"### Compression, {key.split('_', 1)[1].replace('_', ' ')}\n\n" + table(
                ["choice", "ratio", "compress GB/s", "decompress GB/s"],
                [[k, fmt(v["ratio"], 3), fmt(v["compress_gbps"]), fmt(v["decompress_gbps"])] for k, v in res[key].items()]))
    if "train" in res:
        t = res["train"]
        parts.append("### Reference trainer on this CPU\n\n" + table(
            ["config", "steps/s", "s/step"], [[k, fmt(v["steps_per_s"], 3), fmt(v["s_per_step"], 3)]
                                            for k, v in t["steps_per_s"].items()]))
        parts.append(table(["andrea-12m checkpoint", "stall ms (median)", "fraction of a step"],
                           [[k, fmt(t["stall"][k]["ms"], 1), fmt(t["stall"][k]["fraction_of_step"], 3)] for k in ("sync", "async")]))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    print(report(json.load(open(sys.argv[1]))))
