"""Frameworks (the Lightning plugin), the GPU (the check's stages, its results, the checks by
hand), and generic tables for results no page draws."""
from __future__ import annotations

import json
from typing import Any

from .md import source, table


def lightning(results: Any) -> str:
    rows = []
    for size, r in results.doc("lightning_io")["results"].items():
        t = r["times"]
        for op in ("save", "load"):
            a, b = t[f"{op}:ckptfmt"]["median"], t[f"{op}:torch+fsync"]["median"]
            rows.append([size, op, f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}"])
        if "stall:ckptfmt-async" in t:
            a, b = t["stall:ckptfmt-async"]["median"], t["save:torch+fsync"]["median"]
            rows.append([size, "save, async (stall)", f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}"])
    return (table(["size", "op", "ckptfmt plugin (s)", "TorchCheckpointIO + fsync (s)", "ratio (plugin / torch)"], rows)
            + "\n\n" + results.source("lightning_io"))


def gpu_stages(results: Any) -> str:
    """The check's stages as benchmarks/gpu_check.py runs them (its code, not the results)."""
    import gpu_check
    rows = [[f"`{s.name}`", f"{s.budget_s:g} s", f"{s.dry_budget_s:g} s", s.what] for s in gpu_check.STAGES]
    return (table(["stage", "budget", "budget, --dry-run", "what"], rows) + "\n\n"
            + f"Deadline of the whole check: {gpu_check.DEADLINE_S} s ({gpu_check.DRY_DEADLINE_S} s with --dry-run).")


def gpu_check(results: Any) -> str:
    if not results.has("gpu_check"):
        return ("No run of the GPU check is in benchmarks/results/ yet: copy the `gpu_check.jsonl` a run leaves in "
                "`$OUT` to `benchmarks/results/gpu_check.jsonl` and render again.")
    doc = results.doc("gpu_check")
    rows = [[f"`{name}`", e["status"], f"{e.get('seconds', 0):.1f}", e.get("line") or e.get("reason") or ""]
            for name, e in doc["stages"].items()]
    summary = table(["figure", "ratio"], [[k, f"{v}"] for k, v in doc.get("summary", {}).items()])
    return (table(["stage", "status", "s", "what it said"], rows) + "\n\n" + summary + "\n\n"
            + results.source("gpu_check"))


def cuda_manager(results: Any) -> str:
    yes = {True: "yes", False: "**no**"}
    rows = [[name, yes[v["resumed_identical"]], yes[v["negative_control_diverged"]], yes[v["cuda_rng_in_manifest"]],
             f"{v['seconds']:.0f}"] for name, v in results.doc("cuda_manager")["variants"].items()]
    return (table(["variant", "resumed bit-identical", "negative control (no RNG restored) diverged",
                   "`rng.torch_cuda` in every manifest", "s"], rows) + "\n\n" + results.source("cuda_manager"))


def first_runs(results: Any) -> str:
    rows = [[c["what"], f"`{c['command']}`" if c.get("command") else c.get("how", ""), c["result"]]
            for c in results.doc("gpu_first_runs")["checks"].values()]
    return table(["check", "command", "result"], rows) + "\n\n" + results.source("gpu_first_runs")


def generic(records: list[dict[str, Any]]) -> str:
    """Any benchmark's records: one row per measurement set, its parameters and summary."""
    def scalars(d: dict[str, Any] | None) -> str:
        return ", ".join(f"{k} {json.dumps(v) if not isinstance(v, float) else f'{v:.4g}'}"
                         for k, v in (d or {}).items() if not isinstance(v, (dict, list)))
    rows = [[", ".join(f"{k}={v}" for k, v in r["parameters"].items()) or "(the run)", scalars(r["summary"]),
             str(len(r["samples"])) if r["samples"] is not None else ""] for r in records]
    return table(["parameters", "summary (its plain values)", "samples"], rows)


def other_page(results: Any, stems: list[str]) -> str:
    """The page of results no page draws ("" when every results file has a page)."""
    if not stems:
        return ""
    parts = ["# Other results", "", "Results in benchmarks/results/ that no page of this folder draws yet, as they "
             "are: give their benchmark a block in benchmarks/harness/render/ and a place in benchmarks/pages/."]
    for stem in stems:
        records = results.records(stem)
        parts += ["", f"## {stem}", "", generic(records), "", source(f"benchmarks/results/{stem}.jsonl", records)]
    return "\n".join(parts) + "\n"


BLOCKS = {"lightning-io": lightning, "gpu.stages": gpu_stages, "gpu.check": gpu_check, "gpu.cuda-manager": cuda_manager,
          "gpu.first-runs": first_runs}
