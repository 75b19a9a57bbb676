"""Data loaders in a loop's ``state``: where the data stands, as users hold it (spec/RUN.md §8).

A loader that can save its position (torchdata's ``StatefulDataLoader``, or accelerate's prepared
loader built with ``DataLoaderConfiguration(use_stateful_dataloader=True)``) is a state object
like any other. Its restore has one rule more: the iterator that goes on from the saved position
is made when its state is loaded, before the RNGs come back (``restore``'s order), because making
it draws its base seed from torch's RNG, a draw the straight run made at the epoch's start, before
the save; made later, at the loop's ``iter()``, it would shift every draw after it (dropout).

A plain ``DataLoader`` (or accelerate's prepared one without a stateful loader inside) cannot save
its position: given in ``state=``, it is refused when the manager is built, naming the fix. So is a
stateful loader that shuffles through torch's own ``RandomSampler`` (a ``DataLoader(shuffle=True)``
given to accelerate's ``prepare``, a ``sampler=RandomSampler(...)``: it draws its order's seed at
``iter()`` and saves nothing), or whose batch sampler has no state around a shuffling sampler
(accelerate's ``BatchSamplerShard`` under several processes): it would go on by replaying the
epoch's order, whose seed (or generator at the epoch's start) no saved state holds.
"""
from __future__ import annotations

from typing import Any

import torch

FIX = ("use torchdata's StatefulDataLoader (pip install torchdata; same arguments), or with accelerate "
       "Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))")


def _inner(obj: Any) -> Any:
    """The loader that holds the position: accelerate's prepared loader wraps one."""
    return obj.__dict__.get("base_dataloader", obj) if hasattr(obj, "__dict__") else obj


def refuse_plain(name: str, obj: Any) -> None:
    """A ``DataLoader`` in ``state=`` whose position cannot be saved: refused by name, with the fix."""
    inner = _inner(obj)
    if isinstance(inner, torch.utils.data.DataLoader) and not callable(getattr(type(inner), "state_dict", None)):
        raise TypeError(f"state[{name!r}]: a {type(inner).__name__} cannot save its position in the epoch, so "
                        f"a resume would not draw the batches a straight run draws; {FIX}")
    batches = getattr(inner, "batch_sampler", None)
    sampler = getattr(getattr(batches, "batch_sampler", batches), "sampler", None)
    if isinstance(inner, torch.utils.data.DataLoader) and batches is not None \
            and hasattr(sampler, "generator") \
            and (isinstance(sampler, torch.utils.data.RandomSampler) or not _stateful(batches)):
        raise TypeError(f"state[{name!r}]: its {type(batches).__name__} around a shuffling {type(sampler).__name__} "
                        "cannot save the epoch's order, so a resume would not draw the batches a straight run "
                        "draws; give a StatefulDataLoader(shuffle=True) its own sampler (to accelerate's prepare "
                        "too; under several processes accelerate's BatchSamplerShard is not yet resumable)")


def _stateful(batches: Any) -> bool:
    """A batch sampler that saves its place: with ``state_dict``, or torchdata's (its iterator has it)."""
    if callable(getattr(batches, "state_dict", None)):
        return True
    try:
        from torchdata.stateful_dataloader.sampler import BatchSampler
    except ImportError:
        return False
    return isinstance(batches, BatchSampler)


def loaded(obj: Any) -> None:
    """After a loader's ``load_state_dict``: its iterator made now, before the RNGs are restored."""
    inner = _inner(obj)
    if isinstance(inner, torch.utils.data.DataLoader) and callable(getattr(type(inner), "state_dict", None)):
        inner.state_dict()        # StatefulDataLoader: makes the iterator, which the next iter() returns
