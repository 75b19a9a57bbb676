"""The training loop: resume from the newest valid generation, train to ``--steps N``, commit
generations on cadence, on SIGUSR1 (and continue) and on SIGTERM (and exit), and always at N.

Read top to bottom, it is the single-process story: ``Trainer.build`` (model, optimizer,
scheduler, data, bandit, and the ``CheckpointManager`` that saves and restores them), ``resume``,
the step loop in ``fit`` (step, sample, the signal flags handed to the manager, which records the
history and saves on cadence or request), stop; ``train`` at the end is what ``ckptfmt train``
calls. The trainer is a user of the manager like any other loop: it keeps only what is its own
(model, data, bandit, pivot rules: ``.checkpointing``; the signal flags ``ckptfmt train`` sets from
before its start-up: ``..run.signals``). Under
torchrun every rank runs the same loop: the calls into ``.distributed`` (trainer specifics) and
``..torch.distributed`` (collectives) give the single-process answer for one process, and only
rank 0 (``is_main``) writes the run's history and sidecars.
"""
from __future__ import annotations

import math
import os
import random
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

from .. import fingerprint
from .. import manifest as mf
from .. import torch as ct
from ..errors import (CheckpointError, ConfigMismatchError, DeviceChangeError, IncompleteResumeStateError,
                      StorageError)
from ..run import PIVOT, SAMPLES, STATE, Policy, Run, SavePolicy, tiers
from ..run.storerun import open_run
from ..run.history import encode_float
from ..run.signals import Flags
from ..torch import CheckpointManager, ranks
from ..torch.digests import DEFAULT as DIGESTS
from ..torch.distributed import any_rank, mean_over_ranks, rank_world
from . import checkpointing, determinism
from . import config as cfgmod
from .bandit import Bandit
from .data import DataStream, corpus, identity
from .distributed import pick_device, rank_device, wrap_model
from .model import GPT

EXIT_SAVE_FAILED = 75
EXIT_DIVERGED = 3        # the loss became NaN or inf: that step is committed (diverged), then stop
SAMPLES_KEPT = 50
LOSS_EMA = 0.98          # the loss_ema metric: an exponential moving average of the loss (span 50 steps)
_CODE_ID: dict[str, str] | None = None


def code_identity() -> dict[str, str]:
    """blake3 of the trainer's own source files (computed once per process)."""
    global _CODE_ID
    if _CODE_ID is None:
        here = os.path.dirname(os.path.abspath(__file__))
        files = sorted(f for f in os.listdir(here) if f.endswith(".py"))
        _CODE_ID = {f: fingerprint.of_bytes(open(os.path.join(here, f), "rb").read()) for f in files}
        _CODE_ID["torch_adapter"] = fingerprint.of_bytes(open(ct.__file__, "rb").read())
    return _CODE_ID


class Trainer:
    def __init__(self, run_dir: "str | Run", cfg: cfgmod.TrainConfig, *, device: str = "auto",
                 checkpoint_every: int = 100, sample_every: int = 100, keep_last: int | None = None,
                 keep_every: int | None = None, retention: Policy | None = None, saving: SavePolicy | None = None,
                 async_save: bool = False, amp: str = "auto",
                 omit_rng_restore: bool = False, log_every: int = 50, flags: Flags | None = None,
                 parallel: str = "ddp", mirror: str | None = None, allow_nonfinite: bool = False,
                 force_nonfinite_at: int | None = None, log: Callable[[str], None] | None = None,
                 allow_device_change: bool = False, memory_every: int | None = None, digests: bool = DIGESTS):
        self.cfg, self.sample_every = cfg, sample_every
        self.flags = flags if flags is not None else Flags()    # set by signals (``ckptfmt train``)
        self.saving = saving or SavePolicy(every=checkpoint_every or None)     # when the manager saves
        self.retention = retention or (Policy.by_count(keep_last, keep_every) if keep_last or keep_every else None)
        self.loss_ema: float | None = None        # a metric beside the loss (LOSS_EMA), resumed from the manifest
        self.omit_rng_restore, self.log_every = omit_rng_restore, log_every
        self.allow_nonfinite = allow_nonfinite              # resume a diverged generation too
        self.allow_device_change = allow_device_change      # resume a run of another device type
        self.force_nonfinite_at = force_nonfinite_at        # test hook (trainer/protocol.py)
        self.log = log or (lambda msg: print(f"[train] {msg}", file=sys.stderr, flush=True))
        self.run = open_run(run_dir, create=True)       # a URL: a run on object storage
        self.rank, self.world = rank_world()
        self.is_main = self.rank == 0           # rank 0 writes the history and the sidecars
        self.device = rank_device(pick_device(device))
        self.amp = ("bf16" if self.device.type == "cuda" else "none") if amp == "auto" else amp
        self.parallel, self.async_save, self.mirror, self.memory_every = parallel, async_save, mirror, memory_every
        self.digests = digests                   # the history's state digests (spec/RUN.md §3.9)
        self.mgr: CheckpointManager | None = None
        self.pivot = False                       # set when a resume finds a pivot record
        self.provenance: dict[str, Any] | None = None
        self.started = time.time()
        self.save_failed = False                 # a checkpoint failed: the exit is EXIT_SAVE_FAILED

    # ------------------------------------------------------------ construction
    def build(self) -> None:
        """Model, optimizer, scheduler, data, bandit; seeded for a fresh start."""
        cfg = self.cfg
        torch.set_num_threads(cfg.threads)
        self.kernels = determinism.apply(self.device)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)   # never drawn from, but saved and digested (RUN.md §3.9): not two states for one config
        torch.manual_seed(cfg.seed)
        self.sources = corpus(cfg.corpus_bytes)
        self.data = DataStream(self.sources, cfg.sources, cfg.ctx, cfg.seed + 7 * self.rank)
        self.model = GPT(cfg).to(self.device)
        self.model.train()
        self.net = wrap_model(self.model, self.parallel, cfg.seed)   # the model itself for one process
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                     weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.lr_factor)
        self.bandit = self._fresh_bandit(phase=0)
        self.scaler = torch.amp.GradScaler("cuda") if self.amp == "fp16" else None
        self.bandit_state = checkpointing.BanditState(self)
        self.mgr = CheckpointManager(
            self.run, self.model, self.opt, self.sched, self.scaler,
            state={"data": checkpointing.DataState(self), "bandit": self.bandit_state},
            generators={"bandit": self.bandit.rng}, saving=self.saving, retention=self.retention,
            async_save=self.async_save, memory_every=self.memory_every, digests=self.digests,
            handle_signals=False, lock=False, config=cfg.to_dict(), log=self.log, mirror=self.mirror,
            manifest_fields=self.facts, on_restore=self._check_resume, on_commit=self._after_commit,
            upgrade=checkpointing.upgrade)

    def _fresh_bandit(self, phase: int) -> Bandit:
        c = self.cfg
        return Bandit(c.sources, c.caps, c.floors, seed=c.seed + 7919 * phase + 104729 * self.rank, ema=c.bandit_ema,
                      temperature=c.bandit_temperature, phase=phase)

    def lr_factor(self, step: int) -> float:
        """Linear warmup, cosine decay to ``min_lr_frac`` over ``decay_steps`` (config-owned)."""
        c = self.cfg
        if step < c.warmup:
            return (step + 1) / c.warmup
        progress = min(1.0, (step - c.warmup) / max(1, c.decay_steps - c.warmup))
        return c.min_lr_frac + (1 - c.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))

    # ------------------------------------------------------------ resume
    def resume(self) -> int:
        """Restore everything from the newest valid finite generation (the manager, which logs
        the diverged generations it passes over; ``allow_nonfinite`` resumes the newest valid
        one, diverged or not); 0 for a fresh run."""
        step = self.mgr.restore(restore_rng=not self.omit_rng_restore,   # a fresh run: its start event
                                allow_nonfinite=self.allow_nonfinite,
                                allow_device_change=self.allow_device_change)
        if not step:
            return 0
        self.loss_ema = self.mgr.metric("loss_ema")
        if self.pivot:                   # after the RNGs: neither change consumes a draw
            self._apply_new_schedule()
            self.bandit = self._fresh_bandit(phase=self.bandit_state.saved_phase + 1)
            self.mgr.generators["bandit"] = self.bandit.rng
        self.log(f"resumed from {os.path.basename(self.mgr.restored_from)}" + tiers.NOTE.get(self.mgr.restored_tier, "")
                 + (" after a pivot: fresh bandit" if self.pivot else ""))
        return step

    def _check_resume(self, doc: dict[str, Any], path: str) -> None:
        """The manager's ``on_restore``: before anything is restored, the config and the data
        sources must be the run's (or a pivot must allow the change)."""
        mf.require(path, doc, ("config", "state.data.identity"))
        self.pivot = self._pivot_applies(doc.get("step"))
        cfgmod.check_compatible(path, doc["config"], self.cfg, pivot=self.pivot)
        self._check_data(path, doc["state"]["data"], self.pivot)
        moved = checkpointing.device_refusal((doc.get("run") or {}).get("device"), str(self.device))
        if moved and not self.allow_device_change:
            raise DeviceChangeError(path, moved)
        saved_amp = (doc.get("run") or {}).get("amp", self.amp)
        if saved_amp != self.amp:
            raise ConfigMismatchError(path, f"the run trained with --amp {saved_amp}, this start asks for "
                                            f"--amp {self.amp}: pass --amp {saved_amp}")
        own = ranks.own_pieces(doc)[1]          # this rank's data positions (None: a new rank)
        missing = self.data.missing(own["data"]) if own and "data" in own else []
        if missing and not self.pivot:
            raise IncompleteResumeStateError(path, "cannot resume: " + ", ".join(
                f"state.data.positions.{n}" for n in missing) + " missing")
        self.provenance = doc.get("provenance")

    def _pivot_applies(self, step: int) -> bool:
        record = self.run.read_sidecar(PIVOT, default=None)
        return isinstance(record, dict) and record.get("step") == step

    def _check_data(self, path: str, data: dict[str, Any], pivot: bool) -> None:
        ident = identity(self.sources)
        stored = data.get("identity", {})
        for name in self.cfg.sources:
            if name in stored and stored[name] != ident[name]:
                raise ConfigMismatchError(path, f"data source {name!r} differs from the one the run "
                                                f"was trained on (blake3 {stored[name]['blake3'][:12]}… vs "
                                                f"{ident[name]['blake3'][:12]}…)")
            if name not in stored and not pivot:
                raise ConfigMismatchError(path, f"data source {name!r} is not in the run's data")

    def _apply_new_schedule(self) -> None:
        self.sched.base_lrs = [self.cfg.lr for _ in self.sched.base_lrs]
        factor = self.lr_factor(self.sched.last_epoch)
        for group in self.opt.param_groups:
            group["initial_lr"], group["lr"] = self.cfg.lr, self.cfg.lr * factor
        self.sched._last_lr = [g["lr"] for g in self.opt.param_groups]

    # ------------------------------------------------------------ training
    def train_step(self, step: int) -> dict[str, Any]:
        source = self.bandit.pick()
        x, y, ids = self.data.batch(source, self.cfg.batch, self.device)
        lr = self.opt.param_groups[0]["lr"]
        with torch.autocast(self.device.type, dtype=torch.bfloat16 if self.amp == "bf16" else torch.float16,
                            enabled=self.amp != "none"):
            _, loss = self.net(x, y)
        if step == self.force_nonfinite_at:     # test hook: a divergence at a known step
            loss = loss * float("nan")
        self.opt.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.sched.step()
        self.bandit.update(source, float(loss.item()))
        value = mean_over_ranks(loss)          # the history records the mean loss over the ranks
        ema = self.loss_ema                    # restarts from a value after a non-finite one
        self.loss_ema = value if ema is None or not math.isfinite(ema) else LOSS_EMA * ema + (1 - LOSS_EMA) * value
        return {"step": step, "loss": encode_float(value), "loss_ema": encode_float(self.loss_ema), "lr": lr,
                "source": source,
                "tokens": step * self.cfg.batch * self.cfg.ctx, "ids": ids,
                "wall": round(time.time() - self.started, 4)}

    def facts(self, step: int) -> dict[str, Any]:
        """The trainer's own manifest fields (the manager's ``manifest_fields``)."""
        doc = {"code": code_identity(),
               "run": {"device": str(self.device), "amp": self.amp,
                       "tokens_seen": step * self.cfg.batch * self.cfg.ctx * self.world,
                       **self.kernels, "threads": torch.get_num_threads(), "world_size": self.world,
                       "parallel": self.parallel if self.world > 1 else "none"}}
        if self.provenance:
            doc["provenance"] = self.provenance
        return doc

    def _after_commit(self, step: int, manifest: dict[str, Any]) -> None:
        if self.is_main:
            self.run.write_sidecar(STATE, checkpointing.sidecar_state(step, manifest))

    def sample(self, step: int, source: str) -> None:
        """A greedy sample into ``.samples.json`` (rank 0). An FSDP2 model's forward is a
        collective, so every rank generates (greedy: no RNG, the same text) and rank 0 writes."""
        if not self.is_main and not (self.world > 1 and self.parallel == "fsdp"):
            return
        text = self.model.sample(b"def ", 48).decode("utf-8", "replace")
        if not self.is_main:
            return
        samples = self.run.read_sidecar(SAMPLES, default=[]) or []
        samples = (samples + [{"step": step, "source": source, "prompt": "def ", "text": text}])[-SAMPLES_KEPT:]
        self.run.write_sidecar(SAMPLES, samples)

    def fit(self, target: int, on_step: Callable[[dict[str, Any]], None] | None = None) -> int:
        """Train to global step ``target``; returns the process exit code."""
        step = self.data_step = self.resume()
        if step >= target:
            self.log(f"run is at step {step}, target {target}: nothing to do")
            if tiers.in_ram(self.mgr.restored_tier):     # "train to N" ends with N on disk
                self.mgr.save(step, "target")
            return 0
        stop = any_rank(self.flags.stop)[0]        # a SIGTERM during start-up, on any rank
        while step < target and not stop:
            step += 1
            self.data_step = step
            record = self.train_step(step)
            if on_step:
                on_step(record)
            record.pop("ids")
            if self.sample_every and step % self.sample_every == 0:
                self.sample(step, record["source"])    # before a save: step N's sample exists when N commits
            try:
                stop = self._step(step, target, record)
                if not _finite(record["loss"]):
                    return self._diverged(step, record["loss"])
            except StorageError:          # the history or a sidecar, not the checkpoint: named, exit 2
                raise
            except (CheckpointError, OSError) as exc:
                return self._save_failed(exc)
            if step % self.log_every == 0:
                self.log(f"step {step}: loss {record['loss']:.4f} lr {record['lr']:.2e} source {record['source']}")
        try:
            self.mgr.wait()
        except StorageError:
            raise
        except (CheckpointError, OSError) as exc:
            return self._save_failed(exc)
        self._log_stop(step)
        return 0

    def _step(self, step: int, target: int, record: dict[str, Any]) -> bool:
        """Hand the signal flags to the manager, which records the step and saves when due
        (every rank agrees); the target step is always committed. True: stop now."""
        if self.flags.pop_save():           # consumed before it is shared: a later SIGUSR1 counts next step
            self.mgr.request_save()
        if self.flags.stop:
            self.mgr.request_stop(self.flags.reason or "SIGTERM")
        stop = self.mgr.step(step, **{k: v for k, v in record.items() if k != "step"})
        if step == target and self.mgr.committed != step:
            self.mgr.save(step, "target")
        if stop and not self.flags.stop:          # a signal delivered to another rank
            self.flags.stop, self.flags.stop_at = True, time.monotonic()
        if self.mgr.last_save and self.mgr.last_save[0] == step:
            audit = self.mgr.last_save[1] == "SIGUSR1" and self.retention is not None
            self.log(f"step {step}: checkpoint ({self.mgr.last_save[1]}), "
                     f"training stalled {self.mgr.stall_s * 1e3:.1f} ms"
                     + (f"; retention counts it: to keep it, ckptfmt pin {self.run.where} {step}" if audit else ""))
        return stop

    def _diverged(self, step: int, loss: Any) -> int:
        """The loss is NaN or inf: commit this step anyway (nothing is hidden: its recorded value
        facts mark it diverged, so latest-valid resume and retention pass over it) and stop
        with ``EXIT_DIVERGED``: training on would only write NaN over every later step."""
        if self.mgr.committed != step:
            self.mgr.save(step, "non-finite")
        self.mgr.wait()
        self._event("stop", step, reason="non-finite loss", loss=loss)
        self.log(f"step {step}: loss is {loss}: committed step {step} (diverged) and stopped with exit "
                 f"code {EXIT_DIVERGED}; the next start resumes from the newest finite generation "
                 "(--allow-nonfinite resumes this one)")
        if self.is_main:
            self.run.history.sync()
        return EXIT_DIVERGED

    def _save_failed(self, exc: BaseException) -> int:
        self.log(f"checkpoint failed: {exc}; the previous generation is intact")
        self.save_failed = True
        return EXIT_SAVE_FAILED

    def _log_stop(self, step: int) -> None:
        if self.flags.stop and self.flags.stop_at is not None:
            took = time.monotonic() - self.flags.stop_at
            self._event("stop", step, seconds_after_signal=round(took, 3))
            self.log(f"stopped at step {step}, {took:.3f} s after the signal")
        if self.is_main:
            self.run.history.sync()

    def close(self) -> None:
        """Wait for a save in flight and close the run's history (the manager's ``close``)."""
        self._after_failure(self.mgr.close if self.mgr is not None else self.run.history.close)

    def release(self, lock: Any) -> None:
        """Give the run's writer lock (a store's lease) back."""
        self._after_failure(lock.release)

    def _after_failure(self, done: Callable[[], None]) -> None:
        """``done()``; after a failed checkpoint, what it fails with is said, not raised: the
        storage that failed the save (a stalled or unreachable store) fails the history's last
        write and the lease's release too, each in bounded time, and the exit stays
        ``EXIT_SAVE_FAILED``."""
        try:
            done()
        except (CheckpointError, OSError) as exc:
            if not self.save_failed:
                raise
            self.log(f"after the failed checkpoint: {exc}")

    def _event(self, name: str, step: int, **fields: Any) -> None:
        """A history event; every rank's loop calls this, rank 0 writes it."""
        if self.is_main:
            self.run.history.event(name, step, **fields)


def _finite(loss: Any) -> bool:
    """A history record's loss is finite (``encode_float`` writes NaN and inf as strings)."""
    return isinstance(loss, (int, float)) and math.isfinite(loss)
