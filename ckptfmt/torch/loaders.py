"""Data loaders in a loop's ``state``: where the data stands, as users hold it (spec/RUN.md §8).

A loader that can save its position (torchdata's ``StatefulDataLoader``, or accelerate's prepared
loader built with ``DataLoaderConfiguration(use_stateful_dataloader=True)``) is a state object
like any other. Its restore has one rule more: the iterator that goes on from the saved position
is made when its state is loaded, before the RNGs come back (``restore``'s order), because making
it draws its base seed from torch's RNG, a draw the straight run made at the epoch's start, before
the save; made later, at the loop's ``iter()``, it would shift every draw after it (dropout).

A position is a count of batches: torchdata goes on by fast-forwarding that many through a new
pass over the batch sampler, unless the sampler saves its own place (torchdata's shuffling
``RandomSampler`` saves its generator as the epoch began). The new pass draws the saved epoch's
order only if the order can be made again: accelerate's ``SeedableRandomSampler``
(``DataLoaderConfiguration(use_seedable_sampler=True)``) seeds each pass with its seed plus the
epoch, so the manager saves those two beside the prepared loader's own state (``SEEDED``) and
sets them back before the loader goes on. That is what makes accelerate's batch sharding under
several processes (``BatchSamplerShard``, which keeps no state) resumable mid-epoch.

A plain ``DataLoader`` (or accelerate's prepared one without a stateful loader inside) cannot save
its position: given in ``state=``, it is refused when the manager is built, naming the fix. So is
a stateful loader whose order comes from a generator that no saved state holds as the epoch
began: torch's own ``RandomSampler`` (it draws its order's seed at ``iter()`` and saves nothing),
or any shuffling sampler under a batch sampler without state (accelerate's ``BatchSamplerShard``
around torchdata's ``RandomSampler``), unless it is a seedable sampler in accelerate's loader.
"""
from __future__ import annotations

from typing import Any

import torch

FIX = ("use torchdata's StatefulDataLoader (the extra ckptfmt[data]; same arguments), or with accelerate "
       "Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)), and for a "
       "shuffling loader use_seedable_sampler=True too")
SEEDABLE = ("with accelerate, give prepare a DataLoader(shuffle=True) and DataLoaderConfiguration("
            "use_stateful_dataloader=True, use_seedable_sampler=True): its order is a seed and an epoch, "
            "which the manager saves")
SEEDED = "seedable_sampler"      # the key, beside the prepared loader's own state, of its sampler's seed and epoch


def _inner(obj: Any) -> Any:
    """The loader that holds the position: accelerate's prepared loader wraps one."""
    return obj.__dict__.get("base_dataloader", obj) if hasattr(obj, "__dict__") else obj


def _prepared(obj: Any) -> bool:
    """accelerate's prepared loader: a wrapper around the loader that iterates, whose
    ``set_epoch`` is what each of its passes starts with."""
    return _inner(obj) is not obj and callable(getattr(obj, "set_epoch", None))


def _samplers(inner: Any) -> tuple[Any, Any]:
    """(batch sampler, the sampler inside it, or inside the one it shards)."""
    batches = getattr(inner, "batch_sampler", None)
    return batches, getattr(getattr(batches, "batch_sampler", batches), "sampler", None)


def _seedable(sampler: Any) -> bool:
    """A sampler whose order is its seed and epoch (accelerate's ``SeedableRandomSampler`` seeds
    each pass with ``initial_seed + epoch``), known by what it has."""
    return isinstance(getattr(sampler, "initial_seed", None), int) \
        and isinstance(getattr(sampler, "epoch", None), int) and callable(getattr(sampler, "set_epoch", None))


def _seeded(obj: Any) -> Any:
    """The seedable sampler of accelerate's prepared loader, or None."""
    sampler = _samplers(_inner(obj))[1] if _prepared(obj) else None
    return sampler if _seedable(sampler) else None


def refuse_plain(name: str, obj: Any) -> None:
    """A ``DataLoader`` in ``state=`` whose position cannot be saved: refused by name, with the fix."""
    inner = _inner(obj)
    if not isinstance(inner, torch.utils.data.DataLoader):
        return
    if not callable(getattr(type(inner), "state_dict", None)):
        raise TypeError(f"state[{name!r}]: a {type(inner).__name__} cannot save its position in the epoch, so "
                        f"a resume would not draw the batches a straight run draws; {FIX}")
    batches, sampler = _samplers(inner)
    if batches is None or not hasattr(sampler, "generator") or _seeded(obj) is not None:
        return
    if isinstance(sampler, torch.utils.data.RandomSampler) or not _stateful(batches):
        fix = SEEDABLE if _prepared(obj) else "give the StatefulDataLoader shuffle=True instead (its own sampler " \
                                              "saves its generator)"
        raise TypeError(f"state[{name!r}]: its {type(batches).__name__} around a shuffling {type(sampler).__name__} "
                        "cannot save the epoch's order, so a resume would not draw the batches a straight run "
                        f"draws; {fix}")


def _stateful(batches: Any) -> bool:
    """A batch sampler that saves its place: with ``state_dict``, or torchdata's (its iterator has it)."""
    if callable(getattr(batches, "state_dict", None)):
        return True
    try:
        from torchdata.stateful_dataloader.sampler import BatchSampler
    except ImportError:
        return False
    return isinstance(batches, BatchSampler)


def state_of(obj: Any) -> Any:
    """What the manager saves of a state object: its ``state_dict``; for accelerate's prepared
    loader with a seedable sampler, also that sampler's seed and the epoch it is in (``SEEDED``).
    The sampler's epoch, not the loader's count of passes: the sampler moves on to the next epoch
    when its pass ends, which the loader's one-batch look-ahead reaches with the last batch still
    to be trained on, so a save at that batch goes on, as the straight run does, with the next epoch."""
    tree = obj.state_dict()
    sampler = _seeded(obj)
    if sampler is None:
        return tree
    return {**tree, SEEDED: {"seed": sampler.initial_seed, "epoch": sampler.epoch}}


def load(obj: Any, tree: Any) -> None:
    """A state object takes what ``state_of`` saved: accelerate's prepared loader its sampler's
    seed and epoch too, set before its next pass makes the saved epoch's order again. A loader
    whose seedable sampler the saved state lacks (or the reverse) is refused: the order of the
    epoch it goes on in would not be the saved one."""
    sampler = _seeded(obj)
    saved = tree.get(SEEDED) if isinstance(tree, dict) else None
    if (sampler is None) != (saved is None):
        raise ValueError("the saved loader state " + ("has no seedable sampler's seed and epoch (saved without "
                                                      "use_seedable_sampler=True?)" if saved is None else
                                                      "holds a seedable sampler's seed and epoch, and this "
                                                      "loader has no seedable sampler"))
    if sampler is None:
        obj.load_state_dict(tree)
        return
    obj.load_state_dict({k: v for k, v in tree.items() if k != SEEDED})
    sampler.initial_seed = saved["seed"]
    obj.set_epoch(saved["epoch"])            # its passes start with set_epoch(its count of passes)


def loaded(obj: Any) -> None:
    """After a loader's ``load_state_dict``: its iterator made now, before the RNGs are restored."""
    inner = _inner(obj)
    if isinstance(inner, torch.utils.data.DataLoader) and callable(getattr(type(inner), "state_dict", None)):
        inner.state_dict()        # StatefulDataLoader: makes the iterator, which the next iter() returns
