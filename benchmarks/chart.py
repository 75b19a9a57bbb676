"""Bar charts of a benchmark result: throughput of each contender against the machine limit."""
from __future__ import annotations

import json
import sys


def draw(res: dict, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = list(res["sizes"])
    fig, axes = plt.subplots(len(sizes), 2, figsize=(13, 4.2 * len(sizes)), squeeze=False)
    for row, label in enumerate(sizes):
        r = res["sizes"][label]
        ax = axes[row][0]
        names = list(r["save"])
        ax.barh(names, [r["save"][k]["gbps"] for k in names], color=["tab:blue"] + ["tab:gray"] * (len(names) - 1))
        ax.axvline(r["limits"]["write_fsync"]["gbps"], color="tab:red", ls="--", label="write + fsync (limit)")
        ax.set_title(f"{label}: durable save, GB/s (higher is better)")
        ax.legend(fontsize=8)
        ax = axes[row][1]
        names = list(r["load"]["warm"])
        ax.barh(names, [r["load"]["warm"][k]["gbps"] for k in names],
                color=["tab:red"] + ["tab:blue"] * 2 + ["tab:gray"] * (len(names) - 3))
        ax.set_title(f"{label}: load into model + AdamW, warm cache, GB/s")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    draw(json.load(open(sys.argv[1])), sys.argv[2])
