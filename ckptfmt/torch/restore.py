"""How ``CheckpointManager.restore`` puts a generation back: every refusal first, then the values.

The order is the run layer's, whatever the framework (``ckptfmt.run.resuming``): the generation
chosen (under torchrun rank 0 picks it for every rank) or given, its manifest viewed through the
loop's ``upgrade`` hook, then its ``on_restore`` hook. This module is the torch state side's part
in it (``Restoring``: ``choose``, ``plan``, ``load``), and why it goes as it does:

1. Every piece the loop has is matched against the checkpoint (and every companion tensor is
   read), and what is missing is refused together, by name, before a single value is copied:
   a refused restore leaves the model, optimizer, state objects and RNGs as they were, and under
   torchrun every rank refuses together. With ``strict=False`` those pieces start fresh.
2. The loop's objects (scheduler, scaler, state objects) take their state first, each kept as it
   was until all have: the one step that runs the loop's own code, and the only one after the
   checks that can still fail. If one raises, those already loaded are put back and no tensor has
   been copied, so a failed restore changes nothing here either (under torchrun every rank puts
   back together). Then parameters and moments, buffers; the RNGs last, after every object that
   consumes draws exists.

``restore(loop, ...)`` reads only what it restores into (a ``Loop``) and returns what it did
(``Restored``); ``CheckpointManager.restore`` goes the same way through its ``TorchState``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .. import manifest as mf
from ..errors import (ConfigMismatchError, DeviceChangeError, IncompleteResumeStateError, LayoutMismatchError,
                      StateRefusedError)
from ..run import Run, resuming
from ..run.stateside import Restored, Resuming
from ..shards import ShardedCheckpoint
from . import adapter, loaders, notes, optim, ranks, rng
from .distributed import any_rank, is_sharded_model, load_into
from .state import dtype_name, join, persistent_buffers
from ..warn import warn


@dataclass(frozen=True)
class Loop:
    """What a restore puts a generation back into, and how it speaks."""

    run: Run
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    pieces: tuple[tuple[str, Any], ...]       # (name in the manifest, object with state_dict)
    generators: Mapping[str, Any]             # named numpy / torch generators
    rank: int
    log: Callable[..., None]                  # log(message, info=False)
    event: Callable[..., None]                # event(kind, step, **fields): the history (rank 0)
    upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    on_restore: Callable[[dict[str, Any], str], Any] | None = None


@dataclass
class Plan:
    """What a restore will put back: checked in full before anything is copied."""

    doc: dict[str, Any]                       # the manifest as the loop's ``upgrade`` views it
    path: str
    get: Callable[[str], Any]                 # companion tensors by key
    state: dict[str, Any]                     # this rank's loop state trees
    rng: dict[str, Any] | None                # this rank's RNG states; None: they start fresh
    rng_skip: set[str] = field(default_factory=set)
    fresh: list[str] = field(default_factory=list)
    trees: dict[str, Any] = field(default_factory=dict)     # piece -> its state, tensors read
    buffers: dict[str, Any] = field(default_factory=dict)
    change: dict[str, Any] | None = None                     # a world-size change, said once it passed
    moved: list[tuple[str, str, str]] = field(default_factory=list)   # a device change: rng.device_changes
    groups: list[int] = field(default_factory=list)          # each live param group's saved group


def restore(loop: Loop, source: Any, strict: bool, restore_rng: bool,
            allow_nonfinite: bool = False, allow_device_change: bool = False) -> Restored:
    """What ``CheckpointManager.restore`` restores, into ``loop``: the run layer's order
    (``ckptfmt.run.resuming``) with the torch checks and copies; its step None on a fresh run."""
    at = Resuming(loop.run, loop.rank, loop.log, loop.event, loop.upgrade, loop.on_restore)
    options = {"strict": strict, "restore_rng": restore_rng, "allow_device_change": allow_device_change}
    return resuming.restore(at, _Given(loop), source, allow_nonfinite, options)


class Restoring:
    """The restore half of the torch state side (``StateSide.choose``, ``plan``, ``load``) over
    the ``Loop`` that ``loop(at)`` gives: the ``TorchState`` of a manager, or a ``Loop`` given."""

    collective: ranks.TorchCollective         # how a restore's refusals agree

    def loop(self, at: Resuming) -> Loop:
        raise NotImplementedError

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def choose(self, run: Run, allow_nonfinite: bool) -> dict[str, Any]:
        """Rank 0 picks for every rank; across nodes, the RAM tier every rank can reach."""
        return ranks.agreed_source(run, allow_nonfinite)

    def plan(self, at: Resuming, ck: Any, doc: dict[str, Any], strict: bool = True, restore_rng: bool = True,
             allow_device_change: bool = False) -> tuple[Loop, Plan]:
        """``make_plan``; once it passed, a world-size or device change said (log, history)."""
        loop = self.loop(at)
        plan = make_plan(loop, ck, doc, strict, restore_rng, allow_device_change)
        if plan.change is not None:
            notes.world_size_changed(loop.log, loop.event, doc.get("step", 0), plan.change)
        if plan.moved:
            if plan.rng is not None:        # the old device's RNGs: this process's own go on
                plan.rng_skip.update(piece for piece, _, _ in plan.moved)
                plan.fresh += [f"rng.{piece} (device change)" for piece, _, _ in plan.moved]
            notes.device_changed(loop.log, loop.event, doc.get("step", 0), plan.moved)
        return loop, plan

    def load(self, at: Resuming, ck: Any, planned: tuple[Loop, Plan]) -> list[str]:
        """The loop's objects, then parameters, moments and buffers, the RNGs last."""
        loop, plan = planned
        load_pieces(loop, plan)
        load_tensors(loop.model, loop.optimizer, ck, plan)
        if plan.rng is not None:
            rng.restore_rng(plan.rng, dict(loop.generators), plan.path, skip=plan.rng_skip)
        return plan.fresh


class _Given(Restoring):
    """The restore half over a ``Loop`` given whole."""

    def __init__(self, given: Loop):
        self.given, self.collective = given, ranks.TorchCollective()

    def loop(self, at: Resuming) -> Loop:
        return self.given


def make_plan(loop: Loop, ck: Any, doc: dict[str, Any], strict: bool,
              restore_rng: bool, allow_device_change: bool = False) -> Plan:
    """Every check of a restore, and every companion tensor read, before a value is copied.

    What the loop has and the checkpoint lacks, and what the checkpoint has and the loop does
    not restore, are refused together by name (with ``strict=False`` they start fresh). Under
    torchrun a refusal on any rank is every rank's (a collective), so no rank goes on alone.
    A change of device type (the RNGs of the old device cannot be restored) is refused by name
    unless ``allow_device_change`` (or ``strict=False``). A generation without RNGs (a converted
    ``.pt``, a ``ct.save`` file) lacks every RNG piece: refused like any other missing piece.
    """
    path = ck.path
    check_layout(doc, loop.model, path)
    mf.require(path, doc, ("layout", "optimizer"))
    groups = optim.check(loop.optimizer, doc["optimizer"], path, optim.names_of(loop.model))   # by their members
    unfit = _unfit(loop, doc, path, strict)
    extra = ck.companion()
    get = extra.tensor if extra is not None else _no_companion(path)
    own_rng, own_state, change = ranks.own_pieces(doc)
    new_rank = change is not None and own_rng is None
    plan = Plan(doc, path, get, own_state or {}, (own_rng or {}) if restore_rng and not new_rank else None,
                change=change, moved=_moved(loop, own_rng), groups=groups)
    if new_rank:
        plan.fresh.append(f"per-rank RNGs and loop state of rank {loop.rank} (a rank the run did not have)")
    lacks = [p for p, _ in loop.pieces if _lookup(plan, p) is None and not (new_rank and p.startswith("state."))]
    given = {piece for piece, _ in loop.pieces}
    saved = [k for k in ("scheduler",) if doc.get(k) is not None] + \
        [f"amp.{k}" for k in (doc.get("amp") or {})] + [f"state.{k}" for k in plan.state]
    unused = [p for p in saved if p not in given]
    if plan.rng is not None:
        more, more_unused = rng.missing(plan.rng, loop.generators, path, {piece for piece, _, _ in plan.moved})
        plan.rng_skip.update(more)
        lacks, unused = lacks + [f"rng.{key}" for key in more], unused + more_unused
    moved = rng.device_change_problem(plan.moved) if plan.moved and plan.rng is not None and strict \
        and not allow_device_change else None
    _refuse(path, lacks, unused, strict, moved)
    for piece in lacks + unused:
        warn(f"{path}: {piece} starts fresh (strict=False)")
    plan.fresh += lacks + [f"{p} (in the checkpoint, not restored)" for p in unused] + list(unfit.values())
    plan.buffers = join(doc.get("buffers", {}), get)
    plan.trees = {p: join(_lookup(plan, p), get) for p, _ in loop.pieces
                  if _lookup(plan, p) is not None and p not in unfit}
    return plan


def _unfit(loop: Loop, doc: dict[str, Any], path: str, strict: bool) -> dict[str, str]:
    """Pieces whose ``load_state_dict`` would fail half-way through a restore (after the values
    were copied) or silently take state that is not theirs: a scheduler of another class than the
    one saved (``scheduler_type``), a GradScaler enabled where the saved one was disabled (its
    state is empty) or the reverse (its scale would be dropped). Refused; ``strict=False`` starts
    them fresh (piece -> its ``fresh`` entry)."""
    out = {}
    scheduler, scaler = dict(loop.pieces).get("scheduler"), dict(loop.pieces).get("amp.scaler")
    saved, here = doc.get("scheduler_type"), optim.scheduler_type(scheduler)
    if scheduler is not None and doc.get("scheduler") is not None and saved not in (None, here):
        out["scheduler"] = (f"the checkpoint holds {saved} state, the loop uses {here}",
                            f"{saved} in the checkpoint, {here} in the loop")
    tree = (doc.get("amp") or {}).get("scaler")
    if scaler is not None and tree is not None and callable(getattr(scaler, "is_enabled", None)) \
            and scaler.is_enabled() != bool(tree):
        now, then = ("enabled", "disabled") if scaler.is_enabled() else ("disabled", "enabled")
        out["amp.scaler"] = (f"the checkpoint's GradScaler was {then}, the loop's is {now}",
                             f"{then} in the checkpoint, {now} in the loop")
    if out and strict:
        raise ConfigMismatchError(path, "; ".join(f"{p}: {why}" for p, (why, _) in out.items())
                                  + " (CheckpointManager.restore(strict=False) starts it fresh)")
    for piece, (why, _) in out.items():
        warn(f"{path}: {piece}: {why}; it starts fresh (strict=False)")
    return {piece: f"{piece} ({short})" for piece, (_, short) in out.items()}


def _refuse(path: str, lacks: list[str], unused: list[str], strict: bool, moved: str | None = None) -> None:
    """One refusal naming every piece (or the device change); agreed across ranks before
    anything is copied."""
    mine = strict and bool(lacks or unused) or moved is not None
    if not any_rank(mine)[0]:
        return
    if not mine:
        raise IncompleteResumeStateError(path, "cannot resume: another rank's pieces are missing from the "
                                               "checkpoint (its error names them)")
    if moved is not None:
        raise DeviceChangeError(path, moved)
    said = ([f"the checkpoint lacks {', '.join(lacks)}"] if lacks else []) + \
        ([f"the checkpoint has {', '.join(unused)}, which this loop does not restore"] if unused else [])
    raise IncompleteResumeStateError(path, "cannot resume: " + "; ".join(said)
                                     + " (CheckpointManager.restore(strict=False) would go on without them)")


def _moved(loop: Loop, saved_rng: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """The RNG pieces a change of device type leaves behind (``rng.device_changes``)."""
    if saved_rng is None:
        return []
    here = {name: str(g.device) for name, g in loop.generators.items() if isinstance(g, torch.Generator)}
    return rng.device_changes(saved_rng, rng.cuda_device(), here)


def _lookup(plan: Plan, piece: str) -> Any:
    """The saved tree of ``piece`` ('scheduler', 'amp.scaler', 'state.NAME'), or None."""
    head, _, name = piece.partition(".")
    if head == "state":
        return plan.state.get(name)
    if not name:
        return plan.doc.get(head)
    return (plan.doc.get(head) or {}).get(name)


def load_pieces(loop: Loop, plan: Plan) -> None:
    """The loop's objects take their saved state, all or none: each one's own ``state_dict`` is
    kept (a deep copy: it may hand out its live containers) until every one has loaded, and if a
    ``load_state_dict`` (or the ``state_dict`` kept) raises, the ones already loaded, and the one
    that raised, are given it back, on every rank (a collective), before the refusal names the
    piece. The copy costs each object's own size again while the restore runs."""
    kept: list[tuple[str, Any, Any]] = []
    failed: tuple[str, BaseException] | None = None
    for piece, obj in loop.pieces:
        if piece not in plan.trees:
            continue
        try:
            before = copy.deepcopy(loaders.state_of(obj))      # its own code too, and may not copy
        except Exception as e:
            failed = (piece, e)
            break
        kept.append((piece, obj, before))
        try:
            loaders.load(obj, plan.trees[piece])
            loaders.loaded(obj)          # a data loader's iterator, before the RNGs come back
        except Exception as e:           # the loop's own code: any error it raises
            failed = (piece, e)
            break
    if not any_rank(failed is not None)[0]:
        return
    unrestored = []
    for piece, obj, before in reversed(kept):
        try:
            loaders.load(obj, before)
        except Exception:                # said below; the first error is the one to raise
            unrestored.append(piece)
    said = (f"{', '.join(unrestored)} could not be put back (the other objects were; no tensor was copied)"
            if unrestored else "nothing was restored (every object it loaded was put back)")
    if failed is None:
        raise StateRefusedError(plan.path, "cannot resume: another rank's load_state_dict raised (its error "
                                           "names the piece); " + (said if unrestored else "this rank's "
                                                                   "objects were put back"))
    piece, err = failed
    what = "load_state_dict" if kept and kept[-1][0] == piece else "state_dict (kept to put it back)"
    raise StateRefusedError(plan.path, f"cannot resume: {piece}: {what} raised "
                                       f"{type(err).__name__}: {err}; {said}") from err


def load_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ck: Any, plan: Plan) -> None:
    """Parameters and moments (a replica from the file; FSDP2 shards by range), then buffers."""
    if isinstance(ck, ShardedCheckpoint) or is_sharded_model(model):
        load_into(ck, model, optimizer)           # Adam/AdamW, float32 (ranks.check_setup)
    else:
        params = adapter.in_layout_order(ck.layout, model)     # by name: check_layout
        with torch.no_grad():
            for p, entry in zip(params, ck.layout):
                p.copy_(adapter._view(ck.weights, entry))
        ms = [adapter._view(ck.m, e).to(p.device, p.dtype) for p, e in zip(params, ck.layout)]
        vs = [adapter._view(ck.v, e).to(p.device, p.dtype) for p, e in zip(params, ck.layout)]
        optim.restore(optimizer, params, plan.doc["optimizer"], ms, vs, plan.groups)
    live = persistent_buffers(model)                # the same names: check_layout
    with torch.no_grad():
        for name, tensor in plan.buffers.items():
            live[name].copy_(tensor)


def check_layout(doc: dict[str, Any], model: torch.nn.Module, path: str) -> None:
    """The checkpoint's parameters are the model's: names (in any order: each is read by its
    name), shapes and dtypes."""
    mf.require(path, doc, ("layout",))
    layout = doc["layout"]
    named = list(model.named_parameters())
    saved, live = [e["name"] for e in layout], [n for n, _ in named]
    params = adapter.in_layout_order(layout, model)
    if params is None:
        raise LayoutMismatchError(path, f"parameter names differ from the model's ({adapter.names_apart(saved, live)})"
                                        + notes.wrapper_hint(saved, live))
    for entry, p in zip(layout, params):
        name = entry["name"]
        if list(p.shape) != entry["shape"] or entry.get("dtype", "float32") != dtype_name(p.dtype):
            raise LayoutMismatchError(path, f"{name}: {entry.get('dtype', 'float32')} {entry['shape']} "
                                            f"in the checkpoint, {dtype_name(p.dtype)} {list(p.shape)} "
                                            "in the model")
    live, saved = sorted(persistent_buffers(model)), sorted((doc.get("buffers") or {}))
    if live != saved:
        raise LayoutMismatchError(path, f"buffers differ: the checkpoint has {saved}, the model {live}")


def _no_companion(path: str) -> Callable[[str], Any]:
    def get(key: str) -> Any:
        raise IncompleteResumeStateError(path, f"cannot resume: the manifest names tensor {key!r} "
                                               "but the generation has no companion file")
    return get
