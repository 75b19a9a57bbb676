"""Model + Adam/AdamW optimizer <-> the three regions (the only core-adjacent torch module).

weights = parameters in ``model.parameters()`` order, m = ``exp_avg``, v = ``exp_avg_sq``,
step = the optimizer's own step count. Saving streams each tensor's memory straight into the
writer (CPU tensors: zero-copy numpy views; CUDA tensors: one save's pair of pinned staging
buffers, each copy overlapped with writing the piece before: ``staging``), so no full copy of
the model is ever made on the CPU.
"""
from __future__ import annotations

import math
import platform
from typing import Any, Iterable, Iterator

import numpy as np
import torch

import ckptfmt

from .. import format as fmt
from .. import reader, writer
from ..errors import (CheckpointError, IncompleteResumeStateError, LayoutMismatchError,
                      OptimizerMismatchError)
from . import staging

SLICE = 8 << 20     # elements a load copies between two releases of mapped pages (32 MiB)


def layout_of(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Name, shape and element offset of every parameter, in iterator order (spec §4.2)."""
    out, offset = [], 0
    for name, p in model.named_parameters():
        out.append({"name": name, "shape": list(p.shape), "offset": offset})
        offset += p.numel()
    return out


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"ckptfmt stores Adam/AdamW state (m, v); got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            raise TypeError("amsgrad keeps a third moment the seed layout cannot hold")


def moments(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list, list, int]:
    """(exp_avg tensors, exp_avg_sq tensors, optimizer step) in parameter order; zeros before
    the first update, so a step-0 checkpoint is still a complete file."""
    _check_optimizer(optimizer)
    ms, vs, steps = [], [], {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        if "exp_avg" in state:
            ms.append(state["exp_avg"])
            vs.append(state["exp_avg_sq"])
            steps.setdefault(int(state["step"]), []).append(name)
        else:
            ms.append(torch.zeros_like(p))
            vs.append(torch.zeros_like(p))
            steps.setdefault(0, []).append(name)
    if len(steps) > 1:
        said = "; ".join(f"{f'step {s}' if s else 'no state (frozen or not updated yet)'}: "
                         f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                         for s, names in sorted(steps.items()))
        raise OptimizerMismatchError(None, f"parameters disagree on the optimizer step ({said}): this file "
                                           "holds one step; CheckpointManager keeps each parameter's own")
    return ms, vs, next(iter(steps)) if steps else 0


def hyperparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """JSON-able param-group settings (everything but the params themselves); a one-element
    tensor setting (``lr=torch.tensor(1e-3)`` for capturable or compiled optimizers) is recorded
    as its number, which is exact for float32 and float64."""
    out = []
    for group in optimizer.param_groups:
        out.append({k: (list(v) if isinstance(v, tuple) else v.item() if isinstance(v, torch.Tensor) else v)
                    for k, v in group.items() if k != "params" and _json_setting(v)})
    return out


def setting_like(live: Any, saved: Any) -> Any:
    """A saved param-group setting in the live one's type: tuples (betas) and one-element
    tensors (a tensor lr) come back as they were."""
    if isinstance(live, tuple):
        return tuple(saved)
    if isinstance(live, torch.Tensor) and not isinstance(saved, (list, dict)):
        return torch.tensor(saved, dtype=live.dtype, device=live.device).reshape(live.shape)
    return saved


def _json_setting(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, tuple, list)) or \
        (isinstance(v, torch.Tensor) and v.numel() == 1)


def chunks(tensors: Iterable[torch.Tensor], stager: staging.Stager | None = None) -> Iterator[Any]:
    """Byte-buffers of each tensor in order, with no full staging copy: host tensors as
    zero-copy views, device tensors through ``stager``'s pair (a fresh one if not given).
    ``tensors`` may be a generator (a cast made per tensor, as the pieces are pulled)."""
    return (stager or staging.Stager()).region(tensors)


def regions(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            stager: staging.Stager | None = None) -> tuple[Any, Any, Any, int, int]:
    """(weights, m, v as chunk iterators, n_params, optimizer step) for ``writer.save``; the
    three share one staging pair, allocated for this save alone (spec/FORMAT.md §5.7.2)."""
    params = list(model.parameters())
    ms, vs, step = moments(model, optimizer)
    n = sum(p.numel() for p in params)
    stager = stager or staging.Stager()
    return chunks(params, stager), chunks(ms, stager), chunks(vs, stager), n, step


def save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int | None = None,
         *, manifest: dict[str, Any] | None = None, **kwargs: Any) -> writer.SaveResult:
    """Save model + optimizer; ``step`` defaults to the optimizer's step."""
    w, m, v, n, opt_step = regions(model, optimizer)
    extra = dict(manifest or {})
    extra.setdefault("layout", layout_of(model))
    extra.setdefault("optimizer", {"type": type(optimizer).__name__, "step": opt_step,
                                   "hyperparams": hyperparams(optimizer)})
    return writer.save(path, opt_step if step is None else step, w, m, v, manifest=extra,
                       n_params=n, **kwargs)


def differing_tensors(source: "str | reader.Checkpoint", model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer) -> list[str]:
    """``REGION:NAME`` of every tensor whose saved bytes differ from its live ``.cpu()`` bytes
    (weights, m, v of an Adam/AdamW optimizer; bf16/fp16 widened to float32 as the save does);
    empty when the file holds exactly what the model and optimizer hold.

    A check independent of the writer's own digest: a staging buffer refilled too early gives a
    file whose blake3 matches its manifest yet whose bytes are not the tensors' (the CPU tests,
    and the GPU check against ``tensor.cpu()``)."""
    opened = isinstance(source, (str, bytes)) or not hasattr(source, "layout")
    ck = reader.open(source) if opened else source
    try:
        if ck.layout is None:
            raise IncompleteResumeStateError(ck.path, "cannot compare with a model: manifest lacks layout")
        ms, vs, _ = moments(model, optimizer)
        differ = []
        for region, tensors in (("weights", list(model.parameters())), ("m", ms), ("v", vs)):
            saved = getattr(ck, region)
            for entry, t in zip(ck.layout, tensors):
                live = t.detach().float().cpu().contiguous().view(-1).numpy()   # bf16/fp16: widened, exactly
                if saved[entry["offset"]:entry["offset"] + live.size].tobytes() != live.tobytes():
                    differ.append(f"{region}:{entry['name']}")
        return differ
    finally:
        if opened:                  # ours to close; a caller's Checkpoint stays open
            ck.close()


def load(source: "str | reader.Checkpoint", model: torch.nn.Module,
         optimizer: torch.optim.Optimizer | None = None, *, verify: bool = True) -> reader.Checkpoint:
    """Copy weights (and m, v, step, hyper-parameters) into ``model``/``optimizer``.

    Given a path, the file is mapped copy-on-write (``torch.from_numpy`` needs writable views),
    names and shapes are checked, and with ``verify`` the whole file is hashed, all before the
    first value is copied: a damaged file never touches the model. (Hashing while copying
    measured at most a few percent faster on two cores, where blake3 and torch's copy each use
    both: benchmarks/load_variants.py. Not worth a damaged file in the model.) An already
    open ``Checkpoint`` is taken as it is; its caller decides whether it was verified. Mapped
    pages are released behind the copy, so a load does not leave the whole file resident.
    """
    opened = isinstance(source, (str, bytes)) or not hasattr(source, "layout")
    ck = reader.open(source, manifest="require", copy_on_write=True) if opened else source
    params = _checked_params(ck, model)
    if opened and verify:
        ck.verify()
    targets = [("weights", params)]
    if optimizer is not None:
        targets += _moment_targets(prepare_optimizer(ck, model, optimizer))
    _copy_regions(ck, targets)
    return ck


def _checked_params(ck: reader.Checkpoint, model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The model's parameters in layout order, after checking names, order and shapes."""
    layout = ck.layout
    if layout is None:
        raise IncompleteResumeStateError(ck.path, "cannot load into a model: manifest lacks layout")
    params = dict(model.named_parameters())
    if [e["name"] for e in layout] != list(params):
        raise LayoutMismatchError(ck.path, "parameter names/order differ from the model's: "
                                       f"file has {len(layout)} tensors, model {len(params)}")
    for entry in layout:
        if list(params[entry["name"]].shape) != entry["shape"]:
            raise LayoutMismatchError(ck.path, f"{entry['name']}: shape {entry['shape']} in the "
                                           f"file, {list(params[entry['name']].shape)} in the model")
    return [params[e["name"]] for e in layout]


def _copy_regions(ck: Any, targets: list[tuple[str, list[torch.Tensor]]]) -> None:
    """Copy each region into its tensors in file order, releasing mapped pages behind the copy
    (the page cache keeps them)."""
    behind = reader.ReleaseBehind(ck) if isinstance(ck, reader.Checkpoint) else None
    lane = behind.lane() if behind is not None else 0
    with torch.no_grad():
        for region, tensors in targets:
            for entry, t in zip(ck.layout, tensors):
                start = fmt.region_offset(region, ck.n_params) + entry["offset"] * fmt.ITEM
                for done in _copy_in_slices(t, _view(getattr(ck, region), entry)):
                    if behind is not None:
                        behind.advance(lane, start + done * fmt.ITEM)
    if behind is not None:
        behind.advance(lane, ck.size)


def _copy_in_slices(target: torch.Tensor, source: torch.Tensor) -> Iterator[int]:
    """Copy ``source`` into ``target``, yielding the elements done after each slice of at most
    ``SLICE`` elements, so the pages behind a large tensor (a 256 MB embedding) are released
    while it is copied: a load's peak RSS is bounded by the slice, not by the largest tensor."""
    n = target.numel()
    if n <= SLICE or not target.is_contiguous():
        target.copy_(source)
        yield n
        return
    flat_target, flat_source = target.view(-1), source.reshape(-1)
    for begin in range(0, n, SLICE):
        flat_target[begin:begin + SLICE].copy_(flat_source[begin:begin + SLICE])
        yield min(n, begin + SLICE)


def _view(region: np.ndarray, entry: dict[str, Any]) -> torch.Tensor:
    """One parameter's values as a tensor: a zero-copy view over a writable (copy-on-write) map,
    a copy over a read-only one. torch has no read-only tensors: a view of a read-only map would
    be a writable alias of pages mapped PROT_READ, and the first in-place write through it (an
    optimizer step on a state tensor that aliases it) would kill the process (spec §8.5)."""
    count = math.prod(entry["shape"])
    piece = region[entry["offset"]:entry["offset"] + count]
    if not piece.flags.writeable:
        piece = piece.copy()        # never alias a read-only map
    return torch.from_numpy(piece).view(entry["shape"])


def load_optimizer(ck: "reader.Checkpoint | Any", model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``ck``: a Checkpoint, or anything with ``layout``, ``manifest``, ``path``, ``m`` and ``v``."""
    _copy_regions(ck, _moment_targets(prepare_optimizer(ck, model, optimizer)))


def _moment_targets(states: list[dict[str, Any]]) -> list[tuple[str, list[torch.Tensor]]]:
    """Where m and v go: each parameter's ``exp_avg`` and ``exp_avg_sq``."""
    return [("m", [st["exp_avg"] for st in states]), ("v", [st["exp_avg_sq"] for st in states])]


def prepare_optimizer(ck: "reader.Checkpoint | Any", model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Set the step and hyper-parameters from the manifest and make sure every parameter has
    Adam state tensors; returns those states in layout order for m and v to be copied into.

    Existing state of the right shape is reused (no fresh pages, no transient copy); a fresh
    optimizer gets uninitialised tensors through ``load_state_dict``, so torch's own rules for
    where ``step`` lives still apply. At step 0 there is no state: Adam creates it lazily,
    exactly as in a fresh run.
    """
    _check_optimizer(optimizer)
    doc = ck.manifest or {}
    opt = doc.get("optimizer")
    if not isinstance(opt, dict) or "step" not in opt or "hyperparams" not in opt:
        raise IncompleteResumeStateError(ck.path, "cannot resume the optimizer: manifest lacks "
                                                  "optimizer.step / optimizer.hyperparams")
    if len(opt["hyperparams"]) != len(optimizer.param_groups):
        raise OptimizerMismatchError(ck.path, f"{len(opt['hyperparams'])} param groups in the manifest, "
                                       f"{len(optimizer.param_groups)} in the optimizer")
    for group, saved in zip(optimizer.param_groups, opt["hyperparams"]):
        for key, value in saved.items():
            group[key] = setting_like(group.get(key), value)
    params = list(model.parameters())
    if not opt["step"] or not _has_state(optimizer, params):
        _fresh_state(optimizer, opt)
    if not opt["step"]:
        return []
    states = [optimizer.state[p] for p in params]
    for st in states:
        st["step"] = torch.tensor(float(opt["step"]), dtype=torch.float32, device=st["step"].device)
    return states


def _has_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    states = [optimizer.state.get(p, {}) for p in params]
    return all("exp_avg" in st and st["exp_avg"].shape == p.shape and st["exp_avg"].dtype == p.dtype
               for st, p in zip(states, params))


def _fresh_state(optimizer: torch.optim.Optimizer, opt: dict[str, Any]) -> None:
    """Replace the optimizer's state with uninitialised Adam state at ``opt['step']`` (or none
    at step 0)."""
    sd = optimizer.state_dict()
    ordered = [p for g in optimizer.param_groups for p in g["params"]]
    sd["state"] = {} if not opt["step"] else {
        index: {"step": torch.tensor(float(opt["step"]), dtype=torch.float32),
                "exp_avg": torch.empty_like(p), "exp_avg_sq": torch.empty_like(p)}
        for index, p in enumerate(ordered)}
    optimizer.load_state_dict(sd)


def versions() -> dict[str, str]:
    """Versions recorded in a manifest, so a resume on other software can be told apart."""
    return {"ckptfmt": ckptfmt.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


__all__ = ["layout_of", "moments", "hyperparams", "chunks", "regions", "save", "load", "differing_tensors",
           "load_optimizer", "prepare_optimizer", "versions", "CheckpointError",
           "IncompleteResumeStateError"]
