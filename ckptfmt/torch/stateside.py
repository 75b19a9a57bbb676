"""The torch state side (``ckptfmt.run.stateside.StateSide``): a model, its optimizer and the
loop's ``state_dict`` pieces, as ``CheckpointManager`` saves and restores them.

``refuse`` is what the seed layout and the manifest cannot hold (``refusals``, ``ranks``);
``capture`` the three regions' description (``adapter.layout_fields``), the RNGs, the buffers,
the scheduler, scaler and state objects (``state.split``: JSON in the manifest, tensors in the
companion file) and, under torchrun, every rank's RNGs and loop state (``ranks.add_ranks``);
``writer`` the ``Saver`` (asynchronous, or sharded under torchrun); ``choose``, ``plan`` and
``load`` the torch checks and copies of a restore (``restore.Restoring``).
"""
from __future__ import annotations

import weakref
from typing import Any, Mapping

import torch

from ..run.session import Session
from ..run.stateside import Resuming
from . import adapter, loaders, optim, ranks, refusals, rng
from . import digests as digesting
from .distributed import reshard
from .restore import Loop, Restoring
from .saver import Saver
from .state import persistent_buffers, split

__all__ = ["TorchState"]


class TorchState(Restoring):
    """The state of one torch loop: ``model``, ``optimizer``, the optional ``scheduler`` and
    ``scaler``, named ``state`` objects (``state_dict``/``load_state_dict``) and named
    ``generators``; ``async_save`` commits in the background after a snapshot."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                 scaler: Any = None, *, state: Mapping[str, Any] | None = None,
                 generators: Mapping[str, Any] | None = None, async_save: bool = False, digests: bool = False):
        """``digests``: the history's state digests are recorded, and with them the lr each update
        used (a hook on the optimizer from now on, removed once this state side is collected)."""
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.updates = digesting.UpdateLrs(optimizer) if digests else None
        if self.updates is not None:
            weakref.finalize(self, self.updates.handle.remove)
        self.state, self.generators = dict(state or {}), dict(generators or {})
        self.async_save = async_save
        self.collective = ranks.TorchCollective()
        self.rank, self.world = self.collective.rank, self.collective.world
        self.built: tuple[int, ...] = ()      # the parameters' versions when refused (``refuse``)

    def refuse(self) -> None:
        """State objects that cannot give their state back, parameters the layout cannot hold
        exactly, optimizer tensors outside the model, generators whose state JSON cannot hold,
        and under torchrun what a sharded generation cannot hold."""
        refusals.check_state(self.state)
        self.built = refusals.check_params(self.model, self.optimizer)     # the parameters' versions now
        refusals.strict_json({"rng": rng.rng_state(self.generators)})   # a generator JSON cannot hold
        self.rank, self.world = ranks.check_setup(self.model, self.optimizer)

    def writer(self, session: Session) -> Saver:
        return Saver(session.run, asynchronous=self.async_save, sharded=self.world > 1,
                     after_commit=session.after_commit, intent=session.intent)

    def capture(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The manifest's torch fields at ``step`` and the companion's tensors (a collective
        under torchrun: every rank's RNGs and loop state)."""
        reshard(self.model)                 # FSDP2 after a sample: the optimizer's own tensors
        params = list(self.model.parameters())
        opt_step = optim.step_of(params, self.optimizer, step)
        doc: dict[str, Any] = {**adapter.layout_fields(self.model, self.optimizer, opt_step),
                               "rng": rng.rng_state(self.generators)}
        extra: dict[str, Any] = {}
        doc["buffers"], more = split(persistent_buffers(self.model), "buffers")
        extra.update(more)
        for piece, obj in self.pieces():
            doc_key, name = piece.split(".", 1) if "." in piece else (piece, None)
            tree, more = split(loaders.state_of(obj), piece)
            extra.update(more)
            if name is None:
                doc[doc_key] = tree
            else:
                doc.setdefault(doc_key, {})[name] = tree
        if self.scheduler is not None:
            doc["scheduler_type"] = optim.scheduler_type(self.scheduler)    # a resume refuses another class
        ranks.add_ranks(doc, extra)
        return doc, extra

    def commit(self, writer: Saver, step: int, manifest: dict[str, Any], extra: dict[str, Any]) -> None:
        writer.save(step, self.model, self.optimizer, manifest, extra)

    def digests(self, step: int) -> dict[str, Any]:
        """The history's state digests at ``step`` (spec/RUN.md §3.9; ``ckptfmt.torch.digests``)."""
        out = digesting.state_digests(optimizer=self.optimizer, pieces=self.pieces(), generators=self.generators,
                                      scaler=self.scaler, step=step)
        return out if self.updates is None else {**self.updates.fields(), **out}

    def pieces(self) -> list[tuple[str, Any]]:
        """(name in the manifest, object) of every ``state_dict`` piece the loop gave."""
        out = [("scheduler", self.scheduler)] if self.scheduler is not None else []
        if self.scaler is not None:
            out.append(("amp.scaler", self.scaler))
        return out + [(f"state.{name}", obj) for name, obj in self.state.items()]

    def loop(self, at: Resuming) -> Loop:
        """What a restore puts a generation back into, speaking through ``at``."""
        return Loop(at.run, self.model, self.optimizer, tuple(self.pieces()), self.generators,
                    at.rank, at.log, at.event, at.upgrade, at.on_restore)
