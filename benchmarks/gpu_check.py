"""The check for the lent GPU machine: one H200, 16 cores, 10 minutes a command,
15 minutes of device time in all. Correctness first, throughput last, every stage under a budget.

    bash benchmarks/gpu_check.sh                     # on the GPU machine: wheels, PYTHONPATH, deadline
    python3 benchmarks/gpu_check.py [--out DIR]      # the same when blake3 and zstandard import
    python -m benchmarks gpu-check --dry-run --out /tmp/gc   # the CPU plumbing, 1-2 min

Each stage runs in its own process (its own session) and is killed when its budget is spent;
what it had measured by then is kept (``gpu_stage.Context.record``). After every stage the
report ``DIR/gpu_check.json`` is replaced atomically and ``DIR/gpu_check.log`` gets the stage's
output and the tail of each trainer's stderr, so a run cut short by the device's limit still
returns the stages that finished. Stages whose budget exceeds what is left of ``--deadline``
are skipped and say so. DIR defaults to ``$OUT`` (the device tool's folder), else
benchmarks/results/gpu_check. At the end the report is also written as results
(``DIR/gpu_check.jsonl``, the schema of benchmarks/harness/record.py): copied to
benchmarks/results/, ``python -m benchmarks render`` draws it. Three files (four with the wrapper's copy of
the console): the device tool returns at most eight.

``--dry-run`` runs every stage on the CPU with small sizes (tiny models, a few saves, tiny
trainer runs; andrea-12m is stood in for by tiny); what only CUDA has (pinned copies) is
recorded as ``skipped: needs CUDA``. Exit 0: every check passed; 1: a check failed (a digest or
byte mismatch, a resume that is not bit-identical, a negative control that does not diverge);
2: the check could not run or complete (no CUDA without --dry-run, a stage timed out, crashed or
had no time left).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_report import Report
from gpu_stage import Context, StageTimeout, read_json, tail

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Stage:
    """One stage: where its function lives, its budget on the GPU and in the dry run."""
    name: str
    module: str
    budget_s: float
    dry_budget_s: float
    what: str


STAGES = (   # priority order: a run cut short keeps the first ones
    Stage("environment", "gpu_stages", 20, 60, "torch, CUDA, cuDNN, GPU, driver, SDPA backends, file system"),
    Stage("save_digests", "gpu_stages", 95, 60, "20 saves of 120M from GPU memory, each against an independent "
          "blake3 of tensor.cpu() and the file's bytes"),
    Stage("async_save", "gpu_stages", 30, 60, "an async save: the loop changes the tensors at once, the file "
          "holds the snapshot"),
    Stage("resume_tiny_bf16", "gpu_resume", 40, 90, "tiny, bf16: straight x2, SIGTERM cut + resume, negative control"),
    Stage("resume_andrea12m_bf16", "gpu_resume", 70, 90, "andrea-12m (ctx 512), bf16: the same four controls"),
    Stage("resume_tiny_fp16", "gpu_resume", 40, 90, "tiny, fp16 with GradScaler: the same"),
    Stage("resume_tiny_bf16_async", "gpu_resume", 40, 90, "tiny, bf16, --async-save: the same"),
    Stage("throughput_limits", "gpu_throughput", 30, 60, "pinned D2H/H2D, blake3 1 and all cores, write+fsync, "
          "page eviction"),
    Stage("throughput_save", "gpu_throughput", 55, 60, "ct.save from GPU memory, the manager's stall sync and "
          "async, torch.save and safetensors from CUDA"),
    Stage("throughput_load", "gpu_throughput", 60, 60, "ct.load to GPU warm/cold, verify or not, against "
          "torch.load and safetensors to CUDA"),
)
BY_NAME = {s.name: s for s in STAGES}
DEADLINE_S, DRY_DEADLINE_S = 480, 900
KILL_GRACE_S = 1.0


class Interrupted(Exception):
    """SIGTERM/SIGINT to the driver (the wrapper's total timeout): stop, keep the report."""


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="every stage on the CPU with small sizes")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks/results/gpu_check"),
                    help="folder for gpu_check.json and gpu_check.log (default: $OUT)")
    ap.add_argument("--deadline", type=float, help=f"total seconds (default {DEADLINE_S}, dry run {DRY_DEADLINE_S})")
    ap.add_argument("--budget", action="append", default=[], metavar="STAGE=SECONDS",
                    help="override one stage's budget (repeatable)")
    ap.add_argument("--only", action="append", choices=list(BY_NAME), help="run only these stages (repeatable)")
    ap.add_argument("--stop-after", choices=list(BY_NAME), help="run the stages up to and including this one")
    ap.add_argument("--inject-failure", action="append", default=[], choices=[s.name for s in STAGES
                    if s.module == "gpu_resume"], help="a self-test: that stage's first trainer gets an "
                    "unknown option (its error must reach the log)")
    ap.add_argument("--work", help="keep the scratch folder (runs, logs, files) in a new folder under WORK; "
                    "by default it is made in the system temp folder and removed at the end")
    ap.add_argument("--stage", choices=list(BY_NAME), help=argparse.SUPPRESS)
    ap.add_argument("--stage-dir", help=argparse.SUPPRESS)
    ap.add_argument("--stage-budget", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.budgets = {}
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in BY_NAME:
            ap.error(f"--budget {item}: unknown stage {name!r}")
        try:
            args.budgets[name] = float(seconds)
        except ValueError:
            ap.error(f"--budget {item}: SECONDS must be a number")
    return args


def preflight(dry_run: bool) -> str | None:
    """Why the check cannot run here (one line), or None."""
    missing = [m for m in ("numpy", "click", "blake3", "zstandard", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"{', '.join(missing)} not importable: on the GPU machine run benchmarks/gpu_check.sh, which "
                "installs the carried wheels (benchmarks/README.md \"GPU\")")
    if dry_run:
        return None
    import torch  # lazy: the driver needs it only to ask for a device
    if not torch.cuda.is_available():
        return "no CUDA device here (--dry-run runs the stages' plumbing on the CPU)"
    return None


def plan(args: argparse.Namespace) -> dict[str, str | None]:
    """Each stage and why it will not run (None: it runs)."""
    out: dict[str, str | None] = {}
    stopped = False
    for stage in STAGES:
        if stopped:
            out[stage.name] = f"--stop-after {args.stop_after}"
        elif args.only and stage.name not in args.only:
            out[stage.name] = "not selected (--only)"
        else:
            out[stage.name] = None
        stopped = stopped or stage.name == args.stop_after
    return out


def budget_of(stage: Stage, args: argparse.Namespace) -> float:
    return args.budgets.get(stage.name, stage.dry_budget_s if args.dry_run else stage.budget_s)


def kill_group(proc: subprocess.Popen) -> None:
    """The stage's process group: the stage and any trainer it left behind."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_stage(stage: Stage, args: argparse.Namespace, work: Path, budget: float) -> dict[str, Any]:
    """Run one stage in its own session; kill it at its budget (or when the driver is
    interrupted); its result, or what it had by then."""
    folder = work / stage.name
    folder.mkdir(parents=True)
    argv = [sys.executable, "-u", str(Path(__file__).resolve()), "--stage", stage.name, "--stage-dir",
            str(folder), "--stage-budget", str(budget)] + (["--dry-run"] if args.dry_run else []) \
        + (["--inject-failure", stage.name] if stage.name in args.inject_failure else [])
    started, interrupted = time.monotonic(), None
    with open(folder / "stage.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=budget + KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            rc = None
        except Interrupted as exc:
            rc, interrupted = None, str(exc)
        finally:
            kill_group(proc)
    entry = outcome(read_json(folder / "result.json"), rc, folder, budget, time.monotonic() - started)
    if interrupted:
        entry.update(reason=f"interrupted by {interrupted} while it ran", interrupted=interrupted)
    return entry


def outcome(result: dict[str, Any] | None, rc: int | None, folder: Path, budget: float,
            seconds: float) -> dict[str, Any]:
    """The stage's entry in the report, from its result file and how its process ended."""
    had = {k: v for k, v in (result or {}).items() if k not in ("partial", "status")}
    timing = {"seconds": round(seconds, 2), "budget_s": budget}
    if rc is None:
        return {"status": "timed_out", "reason": f"over its budget of {budget:g} s: killed", **timing, "had": had}
    if result is None or result.get("partial"):
        last = next((line for line in reversed(tail(folder / "stage.log", 40)) if line.strip()), "(no output)")
        return {"status": "error", "reason": f"stage exited {rc}: {last.strip()}", **timing, "had": had}
    return {"status": result["status"], **had, **timing}


def drive(args: argparse.Namespace) -> int:
    problem = preflight(args.dry_run)
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    deadline_s = args.deadline or (DRY_DEADLINE_S if args.dry_run else DEADLINE_S)
    end = time.monotonic() + deadline_s
    report = Report(Path(args.out), "dry-run" if args.dry_run else "gpu", deadline_s,
                    [(s.name, s.what, budget_of(s, args)) for s in STAGES])
    if args.work:
        os.makedirs(args.work, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=args.work))
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    planned = plan(args)
    for stage, why_not in planned.items():       # the caller's own skips, recorded up front
        if why_not:
            report.set(stage, {"status": "skipped", "reason": why_not})
    try:
        for stage in [name for name, why_not in planned.items() if not why_not]:
            report.begin(stage)
            budget, left = budget_of(BY_NAME[stage], args), end - time.monotonic()
            if left < budget:
                report.set(stage, {"status": "skipped", "reason": f"no time left: {left:.0f} s of the "
                                   f"deadline, budget {budget:g} s"})
                continue
            entry = run_stage(BY_NAME[stage], args, work, budget)
            report.set(stage, entry, work / stage)
            if entry.get("interrupted"):
                raise Interrupted(entry["interrupted"])
    except Interrupted as exc:
        report.interrupted(str(exc))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return report.finish()


def stage_main(args: argparse.Namespace) -> int:
    """Inside a stage's process: run its function; a stage that sees its deadline stops itself."""
    stage = BY_NAME[args.stage]
    ctx = Context(stage.name, args.dry_run, Path(args.stage_dir), args.stage_budget,
                  inject_failure=stage.name in args.inject_failure)
    module = importlib.import_module(stage.module)
    try:
        module.STAGES[stage.name](ctx)
    except StageTimeout as exc:
        ctx.finish("timed_out", reason=str(exc))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return stage_main(args) if args.stage else drive(args)


if __name__ == "__main__":
    sys.exit(main())
