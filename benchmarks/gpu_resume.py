"""The resume controls of benchmarks/gpu_check.py: for one trainer variant (config, amp,
--async-save), five fresh processes of ``ckptfmt train`` on the stage's device.

  straight-1, straight-2   the same run twice: the control that the device is deterministic
                           at all (without it a resume "difference" could be noise)
  cut, then resume         a real SIGTERM after step CUT (``--pause-at-step``, the hook
                           ``ckptfmt verify-resume --trainer andrea`` uses, so the signal lands
                           at a known step), then the same command again on the same run
  negative-control         a fork of the cut run at CUT resumed with ``--omit-rng-restore``: it
                           must diverge, or the comparison has no teeth

The straight runs and the cut run go at once, then the resume and the negative control. Each is
compared with straight-1 by its canonical loss history (exact floats) and the blake3 of every
generation both hold: the first step that differs is reported, and the step each resume started
from (its history's resume event). verify-resume's own summaries hold every parameter as JSON,
too large for andrea-12m, hence the loss and fingerprint comparison here.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_stage import Context, StageTimeout, tail

VARIANTS = {"resume_tiny_bf16": ("tiny", "bf16", False), "resume_andrea12m_bf16": ("andrea-12m", "bf16", False),
            "resume_tiny_fp16": ("tiny", "fp16", False), "resume_tiny_bf16_async": ("tiny", "bf16", True)}
SCHEDULES = {"tiny": (40, 25, 10), "andrea-12m": (30, 17, 10)}   # steps, cut, checkpoint every
DRY_SCHEDULE = (12, 7, 4)          # the cut is never a cadence step: SIGTERM's own save is tested


class TrainerFailed(Exception):
    """A trainer process exited with an error (or the cut run before its cut)."""

    def __init__(self, name: str, why: str | None = None):
        super().__init__(name)
        self.name, self.why = name, why


class Runs:
    """The stage's trainer processes, each logging to ``run-NAME.log`` in the stage folder."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.procs: dict[str, tuple[subprocess.Popen, float]] = {}
        self.done: dict[str, dict[str, Any]] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.ctx.folder / f"run-{name}.log", "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = (proc, time.monotonic())
        return proc

    def check(self, name: str, rc: int | None) -> None:
        """Record an exit; a failed run raises with its stderr's last line."""
        if rc is None or name in self.done:
            return
        proc, started = self.procs[name]
        self.done[name] = {"exit": rc, "seconds": round(time.monotonic() - started, 2)}
        if rc != 0:
            raise TrainerFailed(name)

    def wait(self, *names: str) -> None:
        for name in names:
            try:
                rc = self.procs[name][0].wait(timeout=max(0.1, self.ctx.left()))
            except subprocess.TimeoutExpired:
                raise StageTimeout(f"trainer run {name} still running at the stage's deadline") from None
            self.check(name, rc)

    def until(self, marker: Path, cut: str) -> None:
        """Wait for the cut run's marker, failing fast if any run dies first."""
        while not marker.exists():
            for name, (proc, _) in self.procs.items():
                self.check(name, proc.poll())
            if cut in self.done:
                raise TrainerFailed(cut, "exited 0 before its cut step")
            self.ctx.check_time(f"the {cut} run reached its cut step")
            time.sleep(0.02)

    def kill(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def losses(run: Path) -> dict[int, Any]:
    from ckptfmt.run import history
    return {r["step"]: r.get("loss") for r in history.read(run / history.NAME).canonical()}


def resumed_from(run: Path) -> int | None:
    from ckptfmt.run import history
    events = [r["step"] for r in history.read(run / history.NAME).events() if r["event"] == "resume"]
    return events[-1] if events else None


def generations(run: Path) -> dict[int, str]:
    """step -> blake3 of every committed generation (its manifest) whose .bin is there."""
    out = {}
    for manifest in sorted(run.glob("step_*.json")):
        if manifest.with_suffix(".bin").exists():
            doc = json.loads(manifest.read_text())
            out[doc["step"]] = doc["blake3"]
    return out


def compare(reference: Path, other: Path, steps: int) -> dict[str, Any]:
    """First step whose loss or common generation differs from the reference run, and more."""
    ref_loss, loss = losses(reference), losses(other)
    ref_gen, gen = generations(reference), generations(other)
    first = None
    for step in range(1, steps + 1):
        if ref_loss.get(step) != loss.get(step) or (step in ref_gen and step in gen and ref_gen[step] != gen[step]):
            first = step
            break
    common = sorted(set(ref_gen) & set(gen))
    return {"first_divergent_step": first, "resumed_from": resumed_from(other), "generations_compared": common,
            "final_identical": steps in common and ref_gen[steps] == gen[steps]}


def train_argv(ctx: Context, run: Path, config: str, amp: str, async_save: bool, sched: tuple[int, int, int],
               *extra: str) -> list[str]:
    steps, _, every = sched
    return [sys.executable, "-u", "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", str(steps),
            "--config", config, "--device", ctx.device, "--amp", amp, "--checkpoint-every", str(every),
            "--sample-every", "0", "--log-every", "1000"] + (["--async-save"] if async_save else []) + list(extra)


def run_controls(ctx: Context, runs: Runs, config: str, amp: str, async_save: bool,
                 sched: tuple[int, int, int]) -> dict[str, Path]:
    """The five runs, two at a time after three at once (see the module docstring)."""
    from ckptfmt.run.ops import fork
    steps, cut, _ = sched
    dirs = {name: ctx.folder / name for name in ("straight-1", "straight-2", "cut", "negative-control")}
    marker = ctx.folder / "cut.paused"
    first_extra = ("--no-such-option",) if ctx.inject_failure else ()
    runs.start("straight-1", train_argv(ctx, dirs["straight-1"], config, amp, async_save, sched, *first_extra))
    runs.start("straight-2", train_argv(ctx, dirs["straight-2"], config, amp, async_save, sched))
    proc = runs.start("cut", train_argv(ctx, dirs["cut"], config, amp, async_save, sched,
                                        "--pause-at-step", str(cut), str(marker)))
    runs.until(marker, "cut")
    proc.send_signal(signal.SIGTERM)
    runs.wait("cut", "straight-1", "straight-2")
    ctx.record(runs=runs.done, cut_committed=cut in generations(dirs["cut"]))
    fork(dirs["cut"], cut, dirs["negative-control"])
    runs.start("resume", train_argv(ctx, dirs["cut"], config, amp, async_save, sched))
    runs.start("negative-control", train_argv(ctx, dirs["negative-control"], config, amp, async_save, sched,
                                              "--omit-rng-restore"))
    runs.wait("resume", "negative-control")
    ctx.record(runs=runs.done)
    return {"straight-2": dirs["straight-2"], "resume": dirs["cut"], "negative-control": dirs["negative-control"],
            "straight-1": dirs["straight-1"]}


def verdict(found: dict[str, dict[str, Any]], cut: int, cut_committed: bool) -> tuple[list[str], str]:
    """The checks that failed (none: straight = straight = resumed from the cut, and the negative
    control diverges after it), and one line for the console."""
    neg = found["negative-control"]
    checks = {
        "straight-2 identical to straight-1": found["straight-2"]["first_divergent_step"] is None
        and found["straight-2"]["final_identical"],
        "resume identical to straight-1": found["resume"]["first_divergent_step"] is None
        and found["resume"]["final_identical"],
        "negative control diverges after the cut": neg["first_divergent_step"] is not None
        and neg["first_divergent_step"] > cut and not neg["final_identical"],
        "both resumes started from the cut": found["resume"]["resumed_from"] == cut == neg["resumed_from"],
        "SIGTERM committed the cut step": cut_committed,
    }
    line = (f"straight-2: {found['straight-2']['first_divergent_step'] or 'no divergence'}; "
            f"resume from {found['resume']['resumed_from']}: {found['resume']['first_divergent_step'] or 'no divergence'}"
            f"; negative control from {neg['resumed_from']}: first divergent step {neg['first_divergent_step']}")
    return [name for name, ok in checks.items() if not ok], line


def resume_variant(ctx: Context) -> None:
    """One variant's controls and verdict; a trainer that fails leaves its stderr in the report."""
    config, amp, async_save = VARIANTS[ctx.name]
    sched = DRY_SCHEDULE if ctx.dry_run else SCHEDULES[config]
    steps, cut, every = sched
    ran = "tiny" if ctx.dry_run else config          # the dry run stands tiny in for andrea-12m
    ctx.record(config=ran, amp=amp, async_save=async_save, device=ctx.device, steps=steps, cut=cut,
               checkpoint_every=every, **({"stands_in_for": config} if ran != config else {}))
    runs = Runs(ctx)
    config = ran
    try:
        dirs = run_controls(ctx, runs, config, amp, async_save, sched)
    except TrainerFailed as exc:
        runs.kill()
        log = tail(ctx.folder / f"run-{exc.name}.log", 15)
        last = next((x for x in reversed(log) if x.strip()), "(no output)").strip()
        why = exc.why or f"exited {runs.done.get(exc.name, {}).get('exit')}: {last}"
        ctx.finish("error", runs=runs.done, reason=f"trainer run {exc.name} {why}", stderr_tail=log)
        return
    finally:
        runs.kill()
    found = {k: compare(dirs["straight-1"], d, steps) for k, d in dirs.items() if k != "straight-1"}
    failed, line = verdict(found, cut, ctx.found.get("cut_committed", False))
    with open(dirs["straight-1"] / f"step_{steps:06d}.json") as f:
        facts = json.load(f).get("run", {})
    ctx.finish("failed" if failed else "passed", controls=found, failed_checks=failed, manifest_run=facts,
               line=line + (f"; FAILED: {', '.join(failed)}" if failed else ""))


STAGES = {name: resume_variant for name in VARIANTS}
