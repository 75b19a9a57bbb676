"""A run at the seed's scale: 2,000 generations and a ``.loss.json`` of up to
200,000 steps (ANDREA's length), and what ``ls``, ``validate``, ``gc``, ``bisect`` and ``plot``
cost on it in wall time and peak RSS, at several history lengths (time should grow linearly,
RSS should stay flat).

The runs are written by the library itself: a ``CheckpointManager`` over a 4,160-parameter
model records every step (loss, lr, source, tokens, wall, as the trainer does) and commits a
generation every ``steps / generations`` steps; three crashes part-way between two commits
leave records that the next manager's ``restore`` supersedes with a ``resume`` event and
re-done steps (one crash also leaves a torn last line). Each command runs as a fresh child
process (``python -m ckptfmt.cli``); its peak RSS is the child's ``ru_maxrss`` from ``wait4``.
``--trees main,.`` runs the package as it is at git revision ``main`` and as it is in the
working tree (``.``), alternating within each repetition. Everything is written under a scratch directory that is
removed at the end.

    python -m benchmarks history-scale                     # 20k/50k/100k/200k steps, ~10 min
    python -m benchmarks history-scale --trees main,. --out benchmarks/results/history_scale.jsonl
    python -m benchmarks history-scale --table benchmarks/results/history_scale.jsonl
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.record import write_results  # noqa: E402
from harness.render import tables  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("code", "topics", "prose", "repo-docstrings")
COMMANDS = ("ls", "validate", "gc", "bisect", "plot")
EXPECTED_EXIT = {"ls": 0, "validate": 0, "gc": 0, "bisect": 1, "plot": 0}   # bisect: the runs differ


# ---------------------------------------------------------------- the run, as a trainer writes it
def _loss(step: int, rng: random.Random) -> float:
    """A falling training curve with noise, like a real one (the values only need to look real)."""
    return 2.0 + 8.0 / math.sqrt(1.0 + step / 50.0) + rng.gauss(0.0, 0.15)


def _manager(run: Path) -> Any:
    """A checkpoint manager over a tiny model (a few thousand parameters, AdamW state set)."""
    import torch
    from ckptfmt.torch import CheckpointManager
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return model, opt, lambda every: CheckpointManager(run, model, opt, every=every, keep_last=None,
                                                       handle_signals=False, lock=False, log=lambda m: None)


def build_run(run: Path, steps: int, generations: int, seed: int = 0) -> dict[str, Any]:
    """Train (in name) to ``steps`` with a commit every ``steps // generations`` steps and three
    crashes half-way between two commits; returns what was written."""
    every = steps // generations
    crashes = sorted({(int(steps * f) // every) * every + every // 2 for f in (0.3, 0.6, 0.85)})
    rng = random.Random(seed)
    _, _, new = _manager(run)
    start, t0, redone = 0, time.time(), 0
    for end in crashes + [steps]:
        mgr = new(every)
        resumed = mgr.restore()
        redone += start - resumed
        for s in range(resumed + 1, end + 1):
            mgr.step(s, loss=_loss(s, rng), lr=1e-3 * min(1.0, s / 2000), source=SOURCES[(s // 97) % 4],
                     tokens=s * 8 * 64, wall=round(time.time() - t0, 4))
        if end == steps:
            mgr.close(end)
        else:                                  # a crash: no close, the history just stops here
            mgr.run.history.close()
            if end == crashes[0]:
                with open(run / ".loss.json", "ab") as f:
                    f.write(b'{"step":%d,"time":17' % (end + 1))      # a torn append
        start = end
    return {"steps": steps, "generations": sum(1 for p in run.glob("step_*.json")), "every": every, "crashes_at": crashes,
            "redone_steps": redone, "history_bytes": (run / ".loss.json").stat().st_size,
            "history_lines": sum(1 for _ in open(run / ".loss.json", "rb"))}


def twin(run: Path, dest: Path, change_step: int) -> None:
    """A second run for ``bisect``: the same generations (hard links) and the same history but
    for one loss, at ``change_step`` (its last record, the canonical one)."""
    dest.mkdir()
    for entry in run.iterdir():
        if entry.name != ".loss.json":
            os.link(entry, dest / entry.name)
    lines = (run / ".loss.json").read_bytes().split(b"\n")
    last = max(i for i, line in enumerate(lines) if line.startswith(b'{"step":%d,' % change_step))
    rec = json.loads(lines[last])
    rec["loss"] += 0.001
    lines[last] = json.dumps(rec, separators=(",", ":")).encode()
    (dest / ".loss.json").write_bytes(b"\n".join(lines))


def hardlink_copy(run: Path, dest: Path) -> None:
    """A copy for ``gc`` to delete from (hard links: deleting there leaves the original)."""
    dest.mkdir()
    for entry in run.iterdir():
        os.link(entry, dest / entry.name)


# ---------------------------------------------------------------- measuring one child process
# The child is spawned by a small launcher, not by this process: on Linux a child's ru_maxrss
# starts at the high-water mark of the process it was forked (or vforked) from, and this one
# holds torch after building the runs.
LAUNCHER = """import os, sys, time
null = os.open(os.devnull, os.O_WRONLY)
t = time.perf_counter()
pid = os.posix_spawn(sys.executable, [sys.executable, *sys.argv[1:]], os.environ,
                     file_actions=[(os.POSIX_SPAWN_DUP2, null, 1)])
_, status, usage = os.wait4(pid, 0)
print(time.perf_counter() - t, usage.ru_maxrss, os.waitstatus_to_exitcode(status))
"""


def child(tree: Path, args: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in MB, exit code) of ``python -m ckptfmt.cli ARGS`` with the
    package taken from ``tree``."""
    return spawn(tree, ["-m", "ckptfmt.cli", *args])


def spawn(tree: Path, argv: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in MB, exit code) of ``python ARGV`` in a fresh child; exit codes
    other than 0 and 1 stop the benchmark (the command could not run)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, *argv], env=env, capture_output=True, text=True,
                          cwd="/")    # not the repository: python -m would import its ckptfmt first
    seconds, maxrss_kb, code = proc.stdout.split()
    if int(code) not in (0, 1):
        raise SystemExit(f"{argv}: exit {code}: {proc.stderr[-2000:]}")
    return float(seconds), int(maxrss_kb) / 1024, int(code)


def one_command(tree: Path, command: str, run: Path, other: Path, scratch: Path, tag: str) -> tuple[float, float, int]:
    """Run one command once; ``gc`` works on a fresh hard-link copy, ``plot`` on a new file."""
    if command == "gc":
        copy = scratch / f"gc-{tag}"
        hardlink_copy(run, copy)
        try:
            return child(tree, ["gc", str(copy), "--keep-last", "10"])
        finally:
            shutil.rmtree(copy)
    if command == "plot":
        out = scratch / f"plot-{tag}.png"
        try:
            return child(tree, ["plot", str(run), "--out", str(out)])
        finally:
            out.unlink(missing_ok=True)
    args = {"ls": ["ls", str(run)], "validate": ["validate", str(run)], "bisect": ["bisect", str(run), str(other)]}
    return child(tree, args[command])


def measure(trees: dict[str, Path], run: Path, other: Path, scratch: Path, reps: int,
            commands: list[str]) -> dict[str, dict[str, Any]]:
    """Each command ``reps`` times for each tree, the trees alternating within each repetition."""
    samples: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    names = list(trees)
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for command in commands:
            for name in order:
                got = one_command(trees[name], command, run, other, scratch, f"{name}-{rep}")
                samples.setdefault((name, command), []).append(got)
    out: dict[str, dict[str, Any]] = {}
    for (name, command), got in samples.items():
        codes = sorted({c for _, _, c in got})
        if codes != [EXPECTED_EXIT[command]]:
            raise SystemExit(f"{name} {command}: exit {codes}, expected {EXPECTED_EXIT[command]}")
        out.setdefault(name, {})[command] = {
            "seconds": _summary([s for s, _, _ in got]), "peak_rss_mb": _summary([m for _, m, _ in got])}
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "n": len(values)}


def check_tree(tree: Path) -> None:
    """The children of ``tree`` import its package, not another one on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    where = subprocess.run([sys.executable, "-c", "import ckptfmt; print(ckptfmt.__file__)"], env=env,
                           cwd="/", capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: the child imports ckptfmt from {where}")


def baselines(tree: Path, scratch: Path) -> dict[str, float]:
    """Peak RSS (MB) of what every command pays whatever the history: the interpreter with the
    CLI (``ls`` of an empty directory), and with matplotlib's pyplot (what ``plot`` imports)."""
    empty = scratch / "empty"
    empty.mkdir(exist_ok=True)
    _, cli, _ = child(tree, ["ls", str(empty)])
    _, pyplot, _ = spawn(tree, ["-c", "import ckptfmt.cli, matplotlib.pyplot"])
    return {"cli_ls_empty_dir_mb": round(cli, 1), "cli_and_pyplot_import_mb": round(pyplot, 1)}


# ---------------------------------------------------------------- main
def export_tree(rev: str, dest: Path) -> Path:
    """The ``ckptfmt`` package as it is at git revision ``rev``, unpacked under ``dest``."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "ckptfmt"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def _revision(name: str) -> str:
    """The commit a tree name stands for (the working tree: HEAD, plus "+ changes" if dirty)."""
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD" if name == "." else name],
                         capture_output=True, text=True, check=True).stdout.strip()
    dirty = name == "." and subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "ckptfmt"],
                                           capture_output=True, text=True).stdout.strip()
    return rev + (" + uncommitted changes" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="20000,50000,100000,200000", help="history lengths in steps")
    ap.add_argument("--generations", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--commands", default=",".join(COMMANDS))
    ap.add_argument("--trees", default=".", help="the packages to measure, alternating: git revisions, "
                                                 "or . for the working tree")
    ap.add_argument("--scratch", default="/work/bench" if os.path.isdir("/work/bench") else None,
                    help="where the scratch directory goes (removed at the end)")
    ap.add_argument("--out", help="write the results here (JSON lines)")
    ap.add_argument("--table", metavar="FILE", help="only print the tables of results written before")
    args = ap.parse_args()
    if args.table:
        print(tables(args.table, "history-scale"))
        return
    scratch = Path(tempfile.mkdtemp(prefix="history_scale.", dir=args.scratch))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # so that the scratch goes too
    try:
        doc = run_all(args, scratch)
    finally:
        shutil.rmtree(scratch)
    print(json.dumps(doc, indent=1))
    if args.out:
        print(tables(write_results("history-scale", doc, args.out)))


def run_all(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    trees = {name: ROOT if name == "." else export_tree(name, scratch / f"tree-{i}")
             for i, name in enumerate(args.trees.split(","))}
    for tree in trees.values():
        check_tree(tree)
    commands = args.commands.split(",")
    results = []
    for steps in [int(x) for x in args.lengths.split(",")]:
        run, other = scratch / f"run-{steps}", scratch / f"twin-{steps}"
        t = time.perf_counter()
        built = build_run(run, steps, args.generations)
        built["build_s"] = round(time.perf_counter() - t, 1)
        twin(run, other, change_step=int(steps * 0.9))
        print(f"built {built}", file=sys.stderr)
        load = [round(os.getloadavg()[0], 2)]
        measured = measure(trees, run, other, scratch, args.reps, commands)
        results.append({**built, "load_avg_1min": load + [round(os.getloadavg()[0], 2)], "measured": measured})
        shutil.rmtree(run)
        shutil.rmtree(other)
    return {"command": "python " + " ".join(sys.argv), "trees": {k: str(v) for k, v in trees.items()},
            "revisions": {name: _revision(name) for name in trees}, "reps": args.reps, "python": sys.version.split()[0],
            "machine": f"{os.cpu_count()} cores",
            "baseline_rss": {name: baselines(tree, scratch) for name, tree in trees.items()},
            "results": results}


if __name__ == "__main__":
    main()
