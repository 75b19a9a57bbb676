"""Model + Adam/AdamW optimizer <-> the three regions (the only core-adjacent torch module).

weights = parameters in ``model.parameters()`` order, m = ``exp_avg``, v = ``exp_avg_sq``,
step = the optimizer's own step count. Saving streams each tensor's memory straight into the
writer (CPU tensors: zero-copy numpy views; CUDA tensors: one save's pair of pinned staging
buffers, each copy overlapped with writing the piece before: ``staging``), so no full copy of
the model is ever made on the CPU.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from .. import format as fmt
from .. import reader, writer
from ..errors import (CheckpointError, IncompleteResumeStateError, LayoutMismatchError,
                      OptimizerMismatchError, UnsupportedSetupError)
from ..statemap import OPTIMIZERS
from ..version import software_versions
from . import optim, staging
from .state import dtype_name

SLICE = 8 << 20     # elements a load copies between two releases of mapped pages (32 MiB)


def layout_of(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Name, shape and element offset of every parameter, in iterator order (spec §4.2), and
    its dtype where it is not float32 (bfloat16 and float16 are stored widened, exactly).

    Examples:
        >>> import torch
        >>> from ckptfmt.torch import layout_of
        >>> layout_of(torch.nn.Linear(2, 1))
        [{'name': 'weight', 'shape': [1, 2], 'offset': 0}, {'name': 'bias', 'shape': [1], 'offset': 2}]
    """
    out, offset = [], 0
    for name, p in model.named_parameters():
        row: dict[str, Any] = {"name": name, "shape": list(p.shape), "offset": offset}
        if p.dtype != torch.float32:
            row["dtype"] = dtype_name(p.dtype)
        out.append(row)
        offset += p.numel()
    return out


def layout_fields(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """The manifest's fields that say what the three regions hold: ``layout`` (``layout_of``),
    ``optimizer`` (``optim.describe``, recording ``step`` as the optimizer's step) and, where
    weights are tied, ``aliases``. The manager, ``save`` and so every loop on them write these.

    Examples:
        >>> import torch
        >>> from ckptfmt.torch import layout_fields
        >>> model = torch.nn.Linear(2, 1)
        >>> fields = layout_fields(model, torch.optim.AdamW(model.parameters()), step=0)
        >>> sorted(fields), fields["optimizer"]["type"], fields["optimizer"]["step"]
        (['layout', 'optimizer'], 'AdamW', 0)
    """
    fields: dict[str, Any] = {"layout": layout_of(model), "optimizer": optim.describe(model, optimizer, step)}
    tied = optim.aliases(model)
    if tied:
        fields["aliases"] = tied
    return fields


def refuse_unheld(model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """What the three regions and the manifest cannot hold, refused by name before anything is
    written: a parameter not initialized yet (lazy), one the float32 layout cannot hold exactly
    (``refuse_inexact``); of each optimizer, a kind the layout does not hold, a setting no manifest
    can hold, a tensor outside the model.

    Examples:
        >>> import torch
        >>> from ckptfmt.torch import refuse_unheld
        >>> model = torch.nn.Linear(2, 1)
        >>> refuse_unheld(model, [torch.optim.AdamW(model.parameters())])      # nothing to refuse
        >>> refuse_unheld(torch.nn.LazyLinear(2), [])
        Traceback (most recent call last):
        ckptfmt.errors.UnsupportedSetupError: parameter weight is uninitialized (a lazy module such as nn.LazyLinear): ...
    """
    optim.refuse_lazy(model)
    refuse_inexact(model)
    for optimizer in optimizers:
        optim.kind(optimizer)
        optim.settings(optimizer)
        optim.refuse_outsiders(model, optimizer)


def widened(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Each tensor as float32: bfloat16 and float16 widened exactly (one tensor at a time, as
    the writer pulls it), float32 as it is."""
    return (t if t.dtype == torch.float32 else t.detach().float() for t in tensors)


def refuse_inexact(model: torch.nn.Module) -> None:
    """A parameter the float32 layout cannot hold exactly (float64, integers) is refused by name."""
    for name, p in model.named_parameters():
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise UnsupportedSetupError(None, f"parameter {name} is {dtype_name(p.dtype)}: the seed layout "
                                              "holds float32 (bf16 and fp16 widen exactly; float64 would not)")


def _moment_keys(optimizer: torch.optim.Optimizer) -> tuple[str, str | None]:
    """The optimizer's state keys for m and v, from the one table (``optim.kind`` refuses
    optimizers it does not hold)."""
    return OPTIMIZERS[optim.kind(optimizer)]


def moments(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list, list, int]:
    """(m tensors, v tensors, optimizer step) in parameter order (``optim.moments``); zeros
    before the first update, so a step-0 checkpoint is still a complete file. This file holds
    one step: Adam/AdamW parameters that disagree on theirs are refused by name.

    Examples:
        >>> import torch
        >>> from ckptfmt.torch import moments
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> m, v, step = moments(model, opt)                   # before the first update: zeros, step 0
        >>> [t.shape for t in m], step
        ([torch.Size([1, 2]), torch.Size([1])], 0)
    """
    params = list(model.parameters())
    ms, vs, step = optim.moments(params, optimizer, 0)
    if _moment_keys(optimizer)[1] is None:
        return ms, vs, step                 # SGD keeps no step
    steps: dict[int, list[str]] = {}
    for (name, _), taken in zip(model.named_parameters(), optim.param_steps(params, optimizer)):
        steps.setdefault(taken or 0, []).append(name)
    if len(steps) > 1:
        said = "; ".join(f"{f'step {s}' if s else 'no state (frozen or not updated yet)'}: "
                         f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                         for s, names in sorted(steps.items()))
        raise OptimizerMismatchError(None, f"parameters disagree on the optimizer step ({said}): this file "
                                           "holds one step; CheckpointManager keeps each parameter's own")
    return ms, vs, step


def hyperparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """JSON-able param-group settings (everything but the params and their names): NumPy
    scalars and one-element tensors (``lr=torch.tensor(1e-3)`` for capturable or compiled
    optimizers) as their numbers, exact for float32 and float64; anything else a manifest cannot
    hold is refused by name (``optim.settings``, which also says which types to restore).

    Examples:
        >>> import torch
        >>> from ckptfmt.torch import hyperparams
        >>> model = torch.nn.Linear(2, 1)
        >>> groups = hyperparams(torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), momentum=0.9))
        >>> round(groups[0]["lr"], 6), groups[0]["momentum"]
        (0.1, 0.9)
    """
    return optim.settings(optimizer)[0]



def chunks(tensors: Iterable[torch.Tensor], stager: staging.Stager | None = None) -> Iterator[Any]:
    """Byte-buffers of each tensor in order, with no full staging copy: host tensors as
    zero-copy views, device tensors through ``stager``'s pair (a fresh one if not given).
    ``tensors`` may be a generator (a cast made per tensor, as the pieces are pulled).

    Examples:
        >>> import torch
        >>> from ckptfmt.torch import chunks
        >>> [bytes(piece).hex() for piece in chunks([torch.tensor([1.0]), torch.tensor([2.0])])]   # little-endian float32
        ['0000803f', '00000040']
    """
    return (stager or staging.Stager()).region(tensors)


def regions(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            stager: staging.Stager | None = None) -> tuple[Any, Any, Any, int, int]:
    """(weights, m, v as chunk iterators, n_params, optimizer step) for ``writer.save``; the
    three share one staging pair, allocated for this save alone (spec/FORMAT.md §5.7.2).

    Examples:
        >>> import torch
        >>> from ckptfmt.torch import regions
        >>> model = torch.nn.Linear(2, 1)
        >>> weights, m, v, n_params, step = regions(model, torch.optim.AdamW(model.parameters()))
        >>> n_params, step
        (3, 0)
    """
    params = list(model.parameters())
    ms, vs, step = moments(model, optimizer)
    n = sum(p.numel() for p in params)
    stager = stager or staging.Stager()
    return chunks(widened(params), stager), chunks(widened(ms), stager), chunks(widened(vs), stager), n, step


def save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int | None = None,
         *, manifest: dict[str, Any] | None = None, **kwargs: Any) -> writer.SaveResult:
    """Save model + optimizer; ``step`` defaults to the optimizer's step.

    Examples:
        >>> import torch
        >>> import ckptfmt.torch as ct
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> ct.save("step_000001.bin", model, opt).step           # the optimizer's step
        1
    """
    refuse_unheld(model, [optimizer])
    w, m, v, n, opt_step = regions(model, optimizer)
    extra = dict(manifest or {})
    if OPTIMIZERS[optim.kind(optimizer)][1] is None and step is not None:
        opt_step = step                     # SGD keeps no step of its own: the loop's is recorded
    for key, value in layout_fields(model, optimizer, opt_step).items():
        extra.setdefault(key, value)        # the caller's own, where given
    return writer.save(path, opt_step if step is None else step, w, m, v, manifest=extra,
                       n_params=n, **kwargs)


def differing_tensors(source: "str | reader.Checkpoint", model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer) -> list[str]:
    """``REGION:NAME`` of every tensor whose saved bytes differ from its live ``.cpu()`` bytes
    (weights, m, v of an Adam/AdamW optimizer; bf16/fp16 widened to float32 as the save does);
    empty when the file holds exactly what the model and optimizer hold.

    A check independent of the writer's own digest: a staging buffer refilled too early gives a
    file whose blake3 matches its manifest yet whose bytes are not the tensors' (the CPU tests,
    and the GPU check against ``tensor.cpu()``).

    Examples:
        >>> import torch
        >>> import ckptfmt.torch as ct
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> _ = ct.save("step_000002.bin", model, opt, step=2)
        >>> ct.differing_tensors("step_000002.bin", model, opt)
        []
        >>> with torch.no_grad():
        ...     _ = model.bias.add_(1.0)
        >>> ct.differing_tensors("step_000002.bin", model, opt)
        ['weights:bias']
    """
    opened = isinstance(source, (str, bytes)) or not hasattr(source, "layout")
    ck = reader.open(source) if opened else source
    try:
        if ck.layout is None:
            raise IncompleteResumeStateError(ck.path, "cannot compare with a model: manifest lacks layout")
        ms, vs, _ = moments(model, optimizer)
        params = in_layout_order(ck.layout, model)
        if params is None:
            raise LayoutMismatchError(ck.path, "cannot compare with a model: parameter names differ from the model's")
        at = {id(p): i for i, p in enumerate(model.parameters())}     # the moments' order
        ms, vs = ([region[at[id(p)]] for p in params] for region in (ms, vs))
        differ = []
        for region, tensors in (("weights", params), ("m", ms), ("v", vs)):
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

    Examples:
        >>> import torch
        >>> import ckptfmt.torch as ct
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> _ = ct.save("step_000000.bin", model, opt)
        >>> fresh = torch.nn.Linear(2, 1)
        >>> _ = ct.load("step_000000.bin", fresh, torch.optim.AdamW(fresh.parameters()))   # verified first
        >>> torch.equal(fresh.weight, model.weight)
        True
    """
    opened = isinstance(source, (str, bytes)) or not hasattr(source, "layout")
    ck = reader.open(source, manifest="require", copy_on_write=True) if opened else source
    params = _checked_params(ck, model)
    if opened and verify:
        ck.verify()
    targets = [("weights", params)]
    if optimizer is not None:
        targets += _moment_targets(prepare_optimizer(ck, model, optimizer), _moment_keys(optimizer))
    _copy_regions(ck, targets)
    return ck


def _checked_params(ck: reader.Checkpoint, model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The model's parameters in layout order, after checking their names and shapes."""
    layout = ck.layout
    if layout is None:
        raise IncompleteResumeStateError(ck.path, "cannot load into a model: manifest lacks layout")
    params = in_layout_order(layout, model)
    if params is None:
        raise LayoutMismatchError(ck.path, "parameter names differ from the model's: "
                                       + names_apart([e["name"] for e in layout], [n for n, _ in model.named_parameters()]))
    for entry, p in zip(layout, params):
        if list(p.shape) != entry["shape"]:
            raise LayoutMismatchError(ck.path, f"{entry['name']}: shape {entry['shape']} in the "
                                           f"file, {list(p.shape)} in the model")
    return params


def names_apart(saved: list[str], live: list[str]) -> str:
    """What tells two lists of parameter names apart, order aside: the first name each side has
    that the other lacks, with the counts (a name listed twice is named too)."""
    said = [f"{len(saved)} parameters in the checkpoint, {len(live)} in the model"]
    for side, names, other, lacks in (("the checkpoint", saved, set(live), "the model"),
                                      ("the model", live, set(saved), "the checkpoint")):
        extra = [n for n in names if n not in other]
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            said.append(f"{side} has {extra[0]!r}{more}, which {lacks} lacks")
    twice = sorted(n for n, times in Counter(saved).items() if times > 1)
    if twice:
        said.append(f"the checkpoint lists {twice[0]!r} twice")
    return "; ".join(said)


def in_layout_order(layout: list[dict[str, Any]], model: torch.nn.Module) -> list[torch.nn.Parameter] | None:
    """The model's parameters in the order ``layout`` lists them, each found by its name: the
    model's own order for a file it saved, another for a file that lists the same names otherwise
    (a converted safetensors file keeps them sorted, 'bias' before 'weight'); None when the names
    are not the model's."""
    params = dict(model.named_parameters())
    names = [entry["name"] for entry in layout]
    if len(set(names)) != len(names) or sorted(names) != sorted(params):
        return None
    return [params[name] for name in names]


def _copy_regions(ck: Any, targets: list[tuple[str, list[torch.Tensor | None]]]) -> None:
    """Copy each region into its tensors in file order, releasing mapped pages behind the copy
    (the page cache keeps them)."""
    behind = reader.ReleaseBehind(ck) if isinstance(ck, reader.Checkpoint) else None
    lane = behind.lane() if behind is not None else 0
    with torch.no_grad():
        for region, tensors in targets:
            for entry, t in zip(ck.layout, tensors):
                if t is None:               # a parameter without optimizer state
                    continue
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
    """``ck``: a Checkpoint, or anything with ``layout``, ``manifest``, ``path``, ``m`` and ``v``.

    Examples:
        >>> import torch, ckptfmt
        >>> import ckptfmt.torch as ct
        >>> from ckptfmt.torch.adapter import load_optimizer
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> _ = ct.save("step_000003.bin", model, opt, step=3)
        >>> other = torch.optim.AdamW(model.parameters(), lr=0.5)
        >>> load_optimizer(ckptfmt.open("step_000003.bin"), model, other)
        >>> other.param_groups[0]["lr"], torch.equal(other.state[model.bias]["exp_avg"], opt.state[model.bias]["exp_avg"])
        (0.001, True)
    """
    _copy_regions(ck, _moment_targets(prepare_optimizer(ck, model, optimizer), _moment_keys(optimizer)))


def _moment_targets(states: list[dict[str, Any] | None],
                    keys: tuple[str, str | None]) -> list[tuple[str, list[torch.Tensor | None]]]:
    """Where m and v go: each parameter's state under the optimizer's keys (Adam: ``exp_avg``,
    ``exp_avg_sq``; SGD: its ``momentum_buffer``, v stays zero); None: no state to fill."""
    return [(region, [st[key] if st is not None else None for st in states])
            for region, key in zip(("m", "v"), keys) if key is not None]


def prepare_optimizer(ck: "reader.Checkpoint | Any", model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Set the hyper-parameters from the manifest and make sure every parameter the manifest
    says has state (``param_steps``; else every one past step 0) has state tensors at its step;
    returns those states in layout order (None: no state) for m and v to be copied into.

    Existing state of the right shape is reused (no fresh pages, no transient copy); a fresh
    optimizer gets uninitialised tensors through ``load_state_dict``, so torch's own rules for
    where ``step`` lives still apply. At step 0 there is no state: Adam creates it lazily,
    exactly as in a fresh run.

    Examples:
        >>> import torch, ckptfmt
        >>> import ckptfmt.torch as ct
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> _ = ct.save("step_000004.bin", model, opt, step=4)
        >>> fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
        >>> states = ct.prepare_optimizer(ckptfmt.open("step_000004.bin"), model, fresh)
        >>> len(states), fresh.param_groups[0]["lr"]                 # a state per parameter, to copy m and v into
        (2, 0.001)
    """
    keys = _moment_keys(optimizer)
    doc = ck.manifest or {}
    opt = doc.get("optimizer")
    if not isinstance(opt, dict) or "step" not in opt or "hyperparams" not in opt:
        raise IncompleteResumeStateError(ck.path, "cannot resume the optimizer: manifest lacks "
                                                  "optimizer.step / optimizer.hyperparams")
    order = optim.check(optimizer, {"type": optim.kind(optimizer), **opt}, ck.path, optim.names_of(model))
    for group, i in zip(optimizer.param_groups, order):
        group.update(optim.group_settings(group, opt["hyperparams"][i], optim.kinds_of(opt.get("setting_types"), i)))
    params = _checked_params(ck, model)               # param_steps are in the file's order
    steps = opt.get("param_steps")
    if not (isinstance(steps, list) and len(steps) == len(params)):     # one step for every parameter
        steps = [opt["step"] if opt["step"] else None] * len(params)
    listed = {id(p) for group in optimizer.param_groups for p in group["params"]}
    want = {id(p): s for p, s in zip(params, steps) if s is not None and id(p) in listed}
    if not _has_state(optimizer, params, keys, want):
        _fresh_state(optimizer, keys, want)
    states = [optimizer.state[p] if id(p) in want else None for p in params]
    if keys[1] is not None:
        for p, st in zip(params, states):
            if st is not None:
                st["step"] = torch.tensor(float(want[id(p)]), dtype=torch.float32, device=st["step"].device)
    return states


def _has_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], keys: tuple[str, str | None],
               want: dict[int, int]) -> bool:
    """Every parameter that should have state has it in its shape and dtype, and no other has any."""
    def fits(p: torch.Tensor) -> bool:
        found = optimizer.state.get(p, {}).get(keys[0])
        if id(p) not in want:
            return found is None
        return found is not None and found.shape == p.shape and found.dtype == p.dtype
    return all(fits(p) for p in params)


def _fresh_state(optimizer: torch.optim.Optimizer, keys: tuple[str, str | None], want: dict[int, int]) -> None:
    """Replace the optimizer's state with uninitialised state for the parameters in ``want`` (by
    identity, each at its step): Adam's step and two moments, SGD's momentum buffer; the others
    get none, so Adam creates it lazily, exactly as in a fresh run."""
    sd = optimizer.state_dict()
    ordered = [p for g in optimizer.param_groups for p in g["params"]]
    first, second = keys

    def fresh(p: torch.Tensor) -> dict[str, Any]:
        if second is None:
            return {first: torch.empty_like(p)}
        return {"step": torch.tensor(float(want[id(p)]), dtype=torch.float32),
                first: torch.empty_like(p), second: torch.empty_like(p)}
    sd["state"] = {index: fresh(p) for index, p in enumerate(ordered) if id(p) in want}
    optimizer.load_state_dict(sd)


def versions() -> dict[str, str]:
    """Versions recorded in a manifest, so a resume on other software can be told apart.

    Examples:
        >>> from ckptfmt.torch import versions
        >>> sorted(versions())
        ['ckptfmt', 'numpy', 'python', 'torch']
    """
    return software_versions({"torch": torch.__version__})


__all__ = ["layout_of", "layout_fields", "refuse_unheld", "moments", "hyperparams", "chunks", "regions", "save", "load", "differing_tensors",
           "load_optimizer", "prepare_optimizer", "versions", "CheckpointError",
           "IncompleteResumeStateError"]
