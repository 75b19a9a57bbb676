"""``CheckpointManager``: the reference trainer's guarantees in any PyTorch training loop.

    from ckptfmt.torch import CheckpointManager
    mgr = CheckpointManager("runs/x", model, optimizer, scheduler, state={"data": sampler},
                            generators={"noise": np_gen}, every=100, keep_last=3)
    start = mgr.restore()                  # newest valid generation, everything restored; 0 if fresh
    for step in range(start + 1, total + 1):
        loss = train_step(...)
        if mgr.step(step, loss=loss):      # records the loss; saves on cadence, SIGUSR1, SIGTERM
            break                          # True after SIGTERM/SIGINT: committed, time to exit 0
    mgr.close(step)                        # idempotent: commits `step` unless committed already

What goes where (spec/RUN.md §8): parameters (stored as float32, each tensor's own dtype in the
layout), m and v in the ``.bin``; persistent buffers and every tensor of the loop's state
objects in the generation's companion file; the optimizer's type, step and param groups, the
scheduler, the GradScaler, the JSON-able state, every RNG and the config in the manifest.
"""
from __future__ import annotations

import math
import signal
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from .. import format as fmt
from .. import manifest as mf
from .. import reader
from ..errors import (IncompleteResumeStateError, LayoutMismatchError, NoValidGenerationError,
                      RankDisagreementError, UnsupportedSetupError)
from ..shards import ShardedCheckpoint
from ..run import Run, RunLock
from ..run.history import encode_float
from . import adapter, optim, ranks, rng
from .distributed import load_into
from .saver import Saver
from .state import dtype_name, join, persistent_buffers, split

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Saves, retains and restores every piece of a training loop's state in a run directory.

    The run lock is held from construction to ``close()``; an optimizer the seed layout cannot
    hold is refused here, before any training step.
    """

    def __init__(self, directory: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, scaler: Any = None, *, state: Mapping[str, Any] | None = None,
                 generators: Mapping[str, Any] | None = None, every: int = 100, keep_last: int | None = 3,
                 keep_every: int | None = None, async_save: bool = False, handle_signals: bool = True,
                 config: Any = None):
        optim.kind(optimizer)
        _check_pieces(state, every, keep_last)
        _check_params(model, optimizer)
        _strict_json({"rng": rng.capture(generators), "config": config})   # a generator JSON cannot hold
        self.rank, self.world = ranks.check_setup(model, optimizer)
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.state, self.generators = dict(state or {}), dict(generators or {})
        self.every, self.keep_last, self.keep_every, self.config = every, keep_last, keep_every, config
        self.run = Run(directory, create=True)
        self._stop = self._save_requested = False
        self._handlers = _install(self) if handle_signals else None   # before the lock: may raise
        self._lock = RunLock(directory, purpose="checkpoint manager").acquire() if self.rank == 0 else None
        self._saver = Saver(self.run, asynchronous=async_save, sharded=self.world > 1,
                            after_commit=self._retain)
        self.committed: int | None = None
        self.fresh: list[str] = []
        self.closed = False

    # ------------------------------------------------------------ driving
    def request_save(self) -> None:
        """Commit a generation at the next ``step()`` and continue (what SIGUSR1 does)."""
        self._save_requested = True

    def request_stop(self) -> None:
        """Commit a generation at the next ``step()``, which then returns True (SIGTERM)."""
        self._stop = True

    def step(self, step: int, loss: Any = None, **metrics: Any) -> bool:
        """Record step ``step`` in ``.loss.json``; save on cadence or on request. True once a
        stop was requested: the generation is committed and the loop should exit."""
        self._require_open()
        record: dict[str, Any] = {"step": step, "time": time.time()}
        values = {**({"loss": loss} if loss is not None else {}), **metrics}
        for key, value in values.items():
            record[key] = encode_float(float(value)) if _is_number(value) else value
        if self.rank == 0:
            self.run.history.append(record)
        # the agreed decision; the local flags are only ever set here, never cleared by the
        # collective, so a signal that lands while it runs counts at the next step
        stop, save = ranks.agree(self._stop, self._save_requested)
        if save:
            self._save_requested = False
        self._stop = self._stop or stop
        if (stop or save or step % self.every == 0) and self.committed != step:
            self.save(step)
        return stop

    def save(self, step: int) -> None:
        """Commit generation ``step`` now (asynchronously with ``async_save``). Everything that
        cannot be stored is refused here, before a byte is written."""
        self._require_open()
        manifest, extra = self._manifest(step)
        _strict_json(manifest)
        self._saver.save(step, self.model, self.optimizer, manifest, extra)
        self.committed = step

    def close(self, step: int | None = None) -> None:
        """Commit ``step`` unless it is committed already, wait for a save in flight, release the
        run lock and the signal handlers. Idempotent."""
        if self.closed:
            return
        try:
            if step is not None and self.committed != step:
                self.save(step)
            self._saver.wait()
        finally:
            self.closed = True
            self.run.history.sync()
            self.run.history.close()
            if self._lock is not None:
                self._lock.release()
            if self._handlers:
                for sig, handler in self._handlers.items():
                    signal.signal(sig, handler)

    def _require_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self.run.path}: the checkpoint manager is closed")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ what is saved
    def _manifest(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        params = list(self.model.parameters())
        opt_step = optim.step_of(params, self.optimizer, step)
        layout = adapter.layout_of(self.model)
        for entry, p in zip(layout, params):
            if p.dtype != torch.float32:
                entry["dtype"] = dtype_name(p.dtype)
        doc: dict[str, Any] = {"layout": layout, "optimizer": optim.describe(self.optimizer, opt_step, params),
                               "rng": rng.capture(self.generators), "versions": adapter.versions(),
                               "created": time.time(), "progress": {"step": step}}
        extra: dict[str, Any] = {}
        doc["buffers"], more = split(persistent_buffers(self.model), "buffers")
        extra.update(more)
        for piece, obj in self._pieces():
            doc_key, name = piece.split(".", 1) if "." in piece else (piece, None)
            tree, more = split(obj.state_dict(), piece)
            extra.update(more)
            if name is None:
                doc[doc_key] = tree
            else:
                doc.setdefault(doc_key, {})[name] = tree
        if self.config is not None:
            doc["config"] = self.config
        ranks.add_ranks(doc, extra)
        return doc, extra

    def _pieces(self) -> list[tuple[str, Any]]:
        out = [("scheduler", self.scheduler)] if self.scheduler is not None else []
        if self.scaler is not None:
            out.append(("amp.scaler", self.scaler))
        return out + [(f"state.{name}", obj) for name, obj in self.state.items()]

    def _retain(self, step: int, manifest: dict[str, Any]) -> None:
        if self.keep_last and self.rank == 0:
            self.run.gc(keep_last=self.keep_last, keep_every=self.keep_every)

    # ------------------------------------------------------------ restore
    def restore(self, source: Any = None, *, strict: bool = True, restore_rng: bool = True) -> int:
        """Restore everything from the newest valid generation of the run (or from the
        generation ``source``, a ``step_NNNNNN.bin`` anywhere: verified first); its step, or 0
        on a fresh run.

        A piece the loop has but the checkpoint lacks (or the reverse) is refused by name; with
        ``strict=False`` it starts fresh instead and is listed in ``self.fresh``.
        ``restore_rng=False`` is the negative control of resume verification.
        """
        if self.rank == 0:
            self.run.sweep_temps()
        self.fresh = []
        if source is not None:
            self._refuse_rollback(source)
        path = source if source is not None else self._newest()
        if path is None:
            self._event("resume", 0, fresh=True)
            return 0
        with _open(path, verify=source is not None) as ck:
            self._load_tensors(ck)
            self._load_pieces(ck, strict)
            if restore_rng:
                self._load_rng(ck.manifest, strict, ck.path)
            step = ck.step
        if source is None:
            self.committed = step
        self._event("resume", step, fresh_pieces=self.fresh)
        return step

    def _event(self, kind: str, step: int, **fields: Any) -> None:
        if self.rank == 0:
            self.run.history.event(kind, step, **fields)

    def _refuse_rollback(self, source: Any) -> None:
        """Resuming this run from one of its own older generations would collide with the newer
        ones at the next save, and deleting them would lose good checkpoints: fork instead."""
        src = Path(source).resolve()
        parsed = fmt.parse_name(src.name)
        if src.parent != self.run.path.resolve() or parsed is None:
            return
        later = [g.step for g in self.run.generations() if g.committed and g.step > parsed[0]]
        if later:
            raise UnsupportedSetupError(str(source), f"a generation of this run, which has newer ones "
                                                     f"(steps {later}); to go back, fork it: ckptfmt fork "
                                                     f"{self.run.path} --step STEP NEW_RUN, and resume NEW_RUN")

    def _newest(self) -> Any:
        try:
            return ranks.agreed_source(self.run)   # hashed here, so the open does not again
        except (NoValidGenerationError, RankDisagreementError):
            if any(g.manifest is not None for g in self.run.generations()):
                raise                         # committed generations exist and all fail: refuse
            warnings.warn(f"{self.run.path}: only uncommitted leftovers of an interrupted first save; "
                          "starting fresh", stacklevel=3)
            return None

    def _load_tensors(self, ck: Any) -> None:
        _check_layout(ck, self.model)
        if isinstance(ck, ShardedCheckpoint):
            load_into(ck, self.model, self.optimizer)     # Adam/AdamW, float32 (ranks.check_setup)
        else:
            params = list(self.model.parameters())
            with torch.no_grad():
                for p, entry in zip(params, ck.layout):
                    p.copy_(_view(ck.weights, entry))
            ms = [_view(ck.m, e).to(p.device, p.dtype) for p, e in zip(params, ck.layout)]
            vs = [_view(ck.v, e).to(p.device, p.dtype) for p, e in zip(params, ck.layout)]
            optim.restore(self.optimizer, params, _need(ck.manifest, "optimizer", ck.path), ms, vs, ck.path)
        extra = ck.companion()
        self._get = (lambda key: extra.tensor(key)) if extra is not None else {}.__getitem__
        saved = join(ck.manifest.get("buffers", {}), self._get)
        _loadpersistent_buffers(self.model, saved, ck.path)

    def _load_pieces(self, ck: Any, strict: bool) -> None:
        doc = dict(ck.manifest)
        _, doc["state"], why = ranks.own_pieces(ck.manifest)
        if why:
            warnings.warn(f"{ck.path}: {why}", stacklevel=3)
            self.fresh.append(why)
            doc["state"], strict = {}, False
        for piece, obj in self._pieces():
            doc_key, name = piece.split(".", 1) if "." in piece else (piece, None)
            tree = doc.get(doc_key) if name is None else (doc.get(doc_key) or {}).get(name)
            if tree is None:
                self._missing(piece, strict, ck.path)
                continue
            obj.load_state_dict(join(tree, self._get))
        given = {piece for piece, _ in self._pieces()}
        saved = [k for k in ("scheduler",) if doc.get(k) is not None] + \
            [f"amp.{k}" for k in (doc.get("amp") or {})] + [f"state.{k}" for k in (doc.get("state") or {})]
        for piece in saved:
            if piece not in given:
                self._missing(f"{piece} (in the checkpoint, not given to the manager)", strict, ck.path)

    def _load_rng(self, doc: dict[str, Any], strict: bool, path: str) -> None:
        saved, _, why = ranks.own_pieces(doc)
        if why:
            return                            # said by _load_pieces: per-rank pieces start fresh
        saved = _need({"rng": saved} if saved is not None else {}, "rng", path)
        skip: set[str] = set()
        keys = ["python", "numpy_global", "torch_cpu"] + [f"generators.{g}" for g in self.generators]
        for key in keys:
            present = key in saved or (key.startswith("generators.")
                                       and key.split(".", 1)[1] in saved.get("generators", {}))
            if not present:
                self._missing(f"rng.{key}", strict, path)
                skip.add(key)
        for name in saved.get("generators", {}):
            if name not in self.generators:
                self._missing(f"rng.generators.{name} (in the checkpoint, not given to the manager)", strict, path)
        rng.restore_all(saved, self.generators, skip=skip, path=path)

    def _missing(self, piece: str, strict: bool, path: str) -> None:
        if strict:
            raise IncompleteResumeStateError(path, f"cannot resume: the checkpoint lacks {piece} "
                                                   "(restore(strict=False) starts it fresh)")
        self.fresh.append(piece)
        warnings.warn(f"{path}: {piece} starts fresh (not in the checkpoint)", stacklevel=3)


# ---------------------------------------------------------------- helpers
def _check_pieces(state: Mapping[str, Any] | None, every: int, keep_last: int | None) -> None:
    for name, obj in (state or {}).items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"state[{name!r}]: needs state_dict() and load_state_dict()")
    if every < 1 or (keep_last is not None and keep_last < 1):
        raise ValueError(f"every and keep_last must be at least 1, got {every} and {keep_last}")


def _check_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Parameters the layout holds exactly, and no optimizer tensor outside the model."""
    for name, p in model.named_parameters():
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise UnsupportedSetupError(None, f"parameter {name} is {dtype_name(p.dtype)}: the seed layout "
                                              "holds float32 (bf16 and fp16 widen exactly; float64 would not)")
    known = {id(p) for p in model.parameters()}
    outside = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in known)
    if outside:
        raise UnsupportedSetupError(None, f"the optimizer holds {outside} tensor(s) that are not parameters "
                                          "of the model: their values and state would not be saved")


def _install(mgr: CheckpointManager) -> dict[int, Any]:
    """SIGTERM/SIGINT request a stop, SIGUSR1 a save; the handlers only set flags."""
    previous = {}
    for sig, act in ((signal.SIGTERM, mgr.request_stop), (signal.SIGINT, mgr.request_stop),
                     (signal.SIGUSR1, mgr.request_save)):
        previous[sig] = signal.signal(sig, lambda signum, frame, act=act: act())
    return previous


def _strict_json(manifest: dict[str, Any]) -> None:
    """Refuse, before anything is written, a manifest JSON cannot hold (a NaN or a Path in the
    config, a generator whose state is not JSON): a failure after the .bin is on disk would
    leave an uncommitted leftover behind."""
    try:
        mf.dumps(manifest)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot checkpoint: the manifest would not be strict JSON ({exc})") from None


def _is_number(value: Any) -> bool:
    return isinstance(value, (float, int, torch.Tensor, np.number)) and not isinstance(value, bool)


def _loadpersistent_buffers(model: torch.nn.Module, saved: dict[str, Any], path: str) -> None:
    live = persistent_buffers(model)
    if set(live) != set(saved):
        raise LayoutMismatchError(path, f"buffers differ: the checkpoint has {sorted(saved)}, "
                                        f"the model {sorted(live)}")
    with torch.no_grad():
        for name, tensor in saved.items():
            live[name].copy_(tensor)


def _check_layout(ck: reader.Checkpoint, model: torch.nn.Module) -> None:
    layout = _need(ck.manifest, "layout", ck.path)
    named = list(model.named_parameters())
    if [e["name"] for e in layout] != [n for n, _ in named]:
        raise LayoutMismatchError(ck.path, "parameter names/order differ from the model's")
    for entry, (name, p) in zip(layout, named):
        if list(p.shape) != entry["shape"] or entry.get("dtype", "float32") != dtype_name(p.dtype):
            raise LayoutMismatchError(ck.path, f"{name}: {entry.get('dtype', 'float32')} {entry['shape']} "
                                               f"in the checkpoint, {dtype_name(p.dtype)} {list(p.shape)} "
                                               "in the model")


def _open(path: Any, verify: bool) -> Any:
    """A generation to restore from: a ``.bin`` or a sharded generation's manifest."""
    if str(path).endswith(".json"):
        return ShardedCheckpoint(path, verify=verify)
    return reader.open(path, manifest="require", verify=verify)


def _view(region: Any, entry: dict[str, Any]) -> torch.Tensor:
    count = math.prod(entry["shape"])
    flat = region[entry["offset"]:entry["offset"] + count]
    return torch.from_numpy(flat.copy()).view(entry["shape"])


def _need(doc: dict[str, Any], key: str, path: str) -> Any:
    if key not in doc:
        raise IncompleteResumeStateError(path, f"cannot resume: manifest lacks {key}")
    return doc[key]
