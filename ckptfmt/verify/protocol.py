"""The resume-verification protocol (seed 001) as a reusable command.

Four fresh processes: continuous (N updates), cut (C updates, save, stop), full resume (load
C, run N-C) and a negative control (the same resume without RNG restore). The full resume must
match the continuous run within the tolerance (on the CPU: exactly) and the negative control
must diverge, or the check has no teeth. Exit 0 / 1 / 2 as every ckptfmt command.

Trainer contract (``--trainer command``): a command template with the placeholders {steps},
{output}, {resume} (expands to ``--resume PATH`` or nothing) and {omit_rng} (expands to
``--omit-rng-restore`` or nothing). Each run must create {output}, save a checkpoint there and
write {output}/summary.json::

    {"steps": [{"step": int, "ids": [...], "lr": float, "loss": float}, ...],  # this process
     "checkpoint": "file name of the checkpoint it saved, inside {output}",
     "final": {"step": ..., "parameters": ..., "optimizer": ..., "scheduler": ...,
               "progress": ..., "next_draws": {...}, "eval": {...}}}       # nested numbers

A loop on ``CheckpointManager`` may write no summary.json: its run directory {output} is its
record (``records``): the history's step records (loss, metrics, the state digests of spec/RUN.md
§3.9) are compared component by component, and the newest generations' weights, m and v.
"""
from __future__ import annotations

import json
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .. import fingerprint
from ..errors import CheckpointError
from ..run.ops import fork
from . import records
from .deviation import Deviation, compare

MINI = f"{shlex.quote(sys.executable)} -B -m ckptfmt.trainer.mini --steps {{steps}} --output {{output}} {{resume}} {{omit_rng}}"
TIMEOUT = 600


class VerifyIncomplete(Exception):
    """The protocol could not complete (exit 2).

    Examples:
        ```python
        from ckptfmt.verify import VerifyIncomplete, verify_resume

        try:
            verify_resume("proof", trainer="command", command="python my_loop.py --updates {steps} --output {output} {resume} {omit_rng}")
        except VerifyIncomplete as exc:          # a run crashed or wrote no summary.json: exit 2
            print(exc)
        ```
    """


def check_pair(reference: dict[str, Any], candidate: dict[str, Any], cut: int,
               atol: float, rtol: float) -> dict[str, dict[str, Any]]:
    """Per-check verdicts of ``candidate`` (a resumed run) against ``reference`` (continuous).

    Examples:
        >>> from ckptfmt.verify import check_pair
        >>> straight = {"steps": [{"step": s, "ids": [s], "lr": 0.1, "loss": 1.0 / s} for s in (1, 2, 3)], "final": {"w": [1.0]}}
        >>> resumed = {"steps": [{"step": 3, "ids": [3], "lr": 0.1, "loss": 1.0 / 3}], "final": {"w": [1.0]}}
        >>> {name: check["ok"] for name, check in check_pair(straight, resumed, cut=2, atol=0.0, rtol=0.0).items()}
        {'steps': True, 'sample_ids': True, 'learning_rates': True, 'losses': True, 'w': True}
    """
    ref_after = [s for s in reference["steps"] if s["step"] > cut]
    checks: dict[str, tuple[Any, Any]] = {
        "steps": ([s["step"] for s in ref_after], [s["step"] for s in candidate["steps"]]),
        "sample_ids": ([s["ids"] for s in ref_after], [s["ids"] for s in candidate["steps"]]),
        "learning_rates": ([s["lr"] for s in ref_after], [s["lr"] for s in candidate["steps"]]),
        "losses": ([s["loss"] for s in ref_after], [s["loss"] for s in candidate["steps"]]),
    }
    for key in sorted(set(reference["final"]) | set(candidate["final"])):
        checks[key] = (reference["final"].get(key), candidate["final"].get(key))
    out = {}
    for name, (a, b) in checks.items():
        dev = Deviation()
        if a is None or b is None:
            dev.structural.append(f"{name}: missing in {'reference' if a is None else 'candidate'}")
            hit = False
        else:
            hit = compare(a, b, name, dev, atol, rtol)
        out[name] = {"max_deviation": dev.max_abs, "ok": dev.ok(atol, hit),
                     "structural": dev.structural[:5], "non_finite": dev.non_finite[:5]}
    return out


class Protocol:
    """The four runs of seed 001 for one trainer (mini, andrea, or a command), and their verdict.

    Examples:
        ```python
        from ckptfmt.verify import Protocol

        verdict = Protocol("proof", trainer="mini", steps=10, cut=5).run()
        print(verdict["positive"], verdict["negative_divergence_detected"])
        ```
    """
    def __init__(self, output: str, *, trainer: str = "mini", steps: int = 10, cut: int = 5,
                 atol: float = 1e-12, rtol: float = 0.0, command: str | None = None,
                 fault: str | None = None, ignore: tuple[str, ...] = (), log=None):
        if not 0 < cut < steps:
            raise ValueError(f"--cut must be between 1 and --steps - 1, got cut {cut}, steps {steps}")
        self.out = Path(output)
        self.trainer, self.steps, self.cut, self.atol, self.rtol = trainer, steps, cut, atol, rtol
        self.command = command or (MINI + (f" --fault {fault}" if fault else "")
                                   if trainer == "mini" else None)
        self.fault = fault
        self.ignore = tuple(ignore)
        self.left_out: list[str] = []       # the digests that differ from the first record on (records.left_out)
        self.log = log or (lambda m: None)

    # ------------------------------------------------------------ template runs
    def _run_template(self, name: str, steps: int, resume: str | None, omit: bool) -> dict[str, Any]:
        output = self.out / name
        cmd = self.command.format(steps=steps, output=shlex.quote(str(output)),
                                  resume=f"--resume {shlex.quote(resume)}" if resume else "",
                                  omit_rng="--omit-rng-restore" if omit else "")
        if self.fault and not resume:
            cmd = cmd.replace(f" --fault {self.fault}", "")
        self._spawn(name, shlex.split(cmd))
        return self._summary(output)

    def _spawn(self, name: str, argv: list[str], on_start=None) -> None:
        self.log(f"{name}: {' '.join(argv)}")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if on_start:
            on_start(proc)
        try:
            output, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise VerifyIncomplete(f"{name} run timed out after {TIMEOUT} s") from None
        (self.out / f"{name}.log").write_text(output)
        if proc.returncode != 0:
            tail = output.strip().splitlines()[-1:] or ["(no output)"]
            raise VerifyIncomplete(f"{name} run exited {proc.returncode}: {tail[0]}")

    def _summary(self, output: Path) -> dict[str, Any]:
        """The run's summary.json; without one, the run directory a loop on the manager left
        there (``records.summary_of_run``: its history and newest generation)."""
        path = output / "summary.json"
        if not path.exists() and records.has_run(output):
            summary = records.summary_of_run(output)
            if summary["checkpoint"] is None:
                raise VerifyIncomplete(f"{output}: the run committed no generation (the trainer contract: save one)")
        else:
            summary = self._summary_json(path)
        ckpt = output / summary["checkpoint"]
        summary["checkpoint_blake3"] = fingerprint.of_file(ckpt) if ckpt.is_file() else None
        return summary

    @staticmethod
    def _summary_json(path: Path) -> dict[str, Any]:
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise VerifyIncomplete(f"{path}: cannot read the run's summary: {exc} (a loop on the manager may write "
                                   "none: then its run's history, .loss.json, is read)") from None
        for key in ("steps", "final", "checkpoint"):
            if key not in summary:
                raise VerifyIncomplete(f"{path}: summary lacks '{key}' (see the trainer contract)")
        return summary

    def run_template(self) -> dict[str, dict[str, Any]]:
        """The four runs of a command trainer (or mini), each in a fresh process."""
        runs = {"continuous": self._run_template("continuous", self.steps, None, False),
                "cut": self._run_template("cut", self.cut, None, False)}
        ckpt = str(self.out / "cut" / runs["cut"]["checkpoint"])
        rest = self.steps - self.cut
        runs["resume"] = self._run_template("resume", rest, ckpt, False)
        runs["resume-without-rng"] = self._run_template("resume-without-rng", rest, ckpt, True)
        return runs

    # ------------------------------------------------------------ the andrea trainer
    def run_andrea(self) -> dict[str, dict[str, Any]]:
        """The four runs of the reference trainer; the cut is a real SIGTERM after step ``cut``."""
        runs = {"continuous": self._andrea("continuous", self.steps)}
        runs["cut"] = self._andrea("cut", self.steps, pause_at=self.cut)
        cut_step = runs["cut"]["final"]["step"]
        if cut_step != self.cut:
            raise VerifyIncomplete(f"cut run stopped at step {cut_step}, expected {self.cut}")
        for name, omit in (("resume", False), ("resume-without-rng", True)):
            fork(self.out / "cut", cut_step, self.out / name)
            runs[name] = self._andrea(name, self.steps, omit=omit)
        return runs

    def _andrea(self, name: str, steps: int, pause_at: int | None = None, omit: bool = False) -> dict[str, Any]:
        """One run of ``ckptfmt train`` with the observer's options (trainer/protocol.py)."""
        run = self.out / name
        argv = [sys.executable, "-B", "-m", "ckptfmt.cli", "train", "--run", str(run), "--steps", str(steps),
                "--config", "tiny", "--checkpoint-every", str(10 ** 6), "--sample-every", "0",
                "--summary", str(run / "summary.json")]
        if omit:
            argv.append("--omit-rng-restore")
        on_start = None
        if pause_at is not None:
            marker = self.out / f"{name}.paused"
            argv += ["--pause-at-step", str(pause_at), str(marker)]
            on_start = lambda proc: self._sigterm_when(proc, marker)   # noqa: E731
        self._spawn(name, argv, on_start)
        return self._summary(run)

    @staticmethod
    def _sigterm_when(proc: subprocess.Popen, marker: Path) -> None:
        """Deliver a real SIGTERM from outside once the trainer reports the cut step done."""
        deadline = time.monotonic() + TIMEOUT
        while not marker.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)

    # ------------------------------------------------------------ verdict
    def run(self) -> dict[str, Any]:
        """Run the protocol into a new output directory; the verdict, also written to verification.json."""
        if self.out.exists():
            raise VerifyIncomplete(f"{self.out}: exists already; the protocol needs a new directory")
        self.out.mkdir(parents=True)
        if self.trainer == "andrea":
            runs = self.run_andrea()
        else:
            if not self.command:
                raise VerifyIncomplete("--trainer command needs --command TEMPLATE")
            runs = self.run_template()
        return self.verdict(runs)

    def verdict(self, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Positive (the resume matches) and negative (without RNG it diverges) checks of ``runs``."""
        cont = runs["continuous"]
        check = self._checker(runs)
        cut_check = check(cont, runs["cut"], 0, final=False, upto=self.cut)
        positive = check(cont, runs["resume"], self.cut)
        negative = check(cont, runs["resume-without-rng"], self.cut)
        pos_ok = all(c["ok"] for c in positive.values()) and all(c["ok"] for c in cut_check.values())
        neg_structural = any(c["structural"] or c["non_finite"] for c in negative.values())
        neg_diverged = not neg_structural and any(not c["ok"] for c in negative.values())
        failed = [f"resume.{k}" for k, c in positive.items() if not c["ok"]]
        failed += [f"cut.{k}" for k, c in cut_check.items() if not c["ok"]]
        if not neg_diverged:
            failed.append("negative_control: the resume without RNG restore did not diverge"
                          if not neg_structural else "negative_control: structural difference")
        result = {
            "trainer": self.trainer, "steps": self.steps, "cut": self.cut, "atol": self.atol, "rtol": self.rtol,
            "positive": pos_ok, "negative_divergence_detected": neg_diverged,
            "all_checks_passed": pos_ok and neg_diverged, "failed_checks": failed,
            "checks": {"cut": cut_check, "resume": positive, "resume_without_rng": negative},
            "left_out": {"ignored": list(self.ignore), "from_start": self.left_out},
            "checkpoints": {name: {"file": r.get("checkpoint"), "blake3": r.get("checkpoint_blake3")}
                            for name, r in runs.items()},
            "final_eval": {name: r["final"].get("eval") for name, r in runs.items()},
            "environment": _environment(),
        }
        (self.out / "verification.json").write_text(json.dumps(result, indent=1))
        return result

    def _checker(self, runs: dict[str, dict[str, Any]]):
        """The checks of one run against the continuous one, from summaries (``check_pair``) or
        from run directories (``records.check_records``) when every run left one and no summary."""
        by_history = all("records" in r for r in runs.values())
        if any("records" in r for r in runs.values()) and not by_history:
            raise VerifyIncomplete("some runs wrote summary.json and some did not: the runs cannot be compared")
        if by_history:
            self.left_out = records.left_out(runs["continuous"], runs["cut"], self.ignore)
        skip = (*self.ignore, *self.left_out)

        def check(reference: dict[str, Any], candidate: dict[str, Any], cut: int, *, final: bool = True,
                  upto: int | None = None) -> dict[str, dict[str, Any]]:
            if upto is not None:       # the cut run: the continuous run's first steps, nothing final
                key = "records" if by_history else "steps"
                reference = {**reference, key: [s for s in reference[key] if s["step"] <= upto], "final": {}}
                candidate = {**candidate, "final": {}}
            if by_history:
                return records.check_records(reference, candidate, cut, self.atol, self.rtol, final=final, ignore=skip)
            return check_pair(reference, candidate, cut, self.atol, self.rtol)
        return check


def _environment() -> dict[str, str]:
    env = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import numpy  # lazy: optional here, this module drives trainers as subprocesses
        import torch  # lazy: optional, as numpy
        env.update(torch=torch.__version__, numpy=numpy.__version__, device="cpu")
    except ImportError:
        pass
    return env


def verify_resume(output: str, **options: Any) -> dict[str, Any]:
    """Run the protocol; raises ``VerifyIncomplete`` when it cannot complete.

    Examples:
        The protocol on the built-in mini trainer (four fresh processes; what ``ckptfmt
        verify-resume`` runs):

        ```python
        from ckptfmt.verify import verify_resume

        verdict = verify_resume("proof", trainer="mini", steps=10, cut=5)
        assert verdict["positive"] and verdict["negative_divergence_detected"]
        ```
    """
    try:
        return Protocol(output, **options).run()
    except CheckpointError as exc:
        raise VerifyIncomplete(str(exc)) from None
