"""The reference trainer's own pieces as the checkpoint manager sees them.

The trainer saves and resumes through ``ckptfmt.torch.CheckpointManager`` like any user loop:
its data positions and its bandit are ``state`` objects (``state.data`` and ``state.bandit`` in
the manifest, per rank under ``ranks`` with torchrun), the bandit's generator is a named
generator (``rng.generators.bandit``). What only the trainer knows stays here: a pivot resumes
new data sources without positions and a fresh bandit, and ``upgrade`` reads the manifests the
trainer wrote before it was built on the manager (``data``, ``bandit`` and ``rng.numpy`` at the
top level), so runs started by an earlier release resume bit-exactly.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..torch import rng as rngmod
from .bandit import Bandit
from .data import DataStream, identity


class _Trainer(Protocol):
    data: DataStream
    bandit: Bandit
    sources: dict[str, np.ndarray]
    pivot: bool


class DataState:
    """``state.data``: each source's position, the stream's seed and ctx, and the identity
    (blake3) of every source the run has trained on. The identity is hashed once per set of
    sources (they are bytes, never changed in place): ``state_dict`` runs at every step, for
    the history's state digests (spec/RUN.md §3.9), and hashing the corpus there cost the tiny
    config 2 % of its step."""

    def __init__(self, trainer: _Trainer):
        self.trainer = trainer
        self._identity: tuple[Any, dict[str, Any]] | None = None    # (the sources, their identity)

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        if self._identity is None or self._identity[0] is not t.sources:
            self._identity = (t.sources, identity(t.sources))
        return {**t.data.state(), "identity": {name: dict(i) for name, i in self._identity[1].items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Positions of every configured source; after a pivot a new source starts at 0 (the
        trainer's ``on_restore`` hook has refused a missing one before anything was copied)."""
        self.trainer.data.load_state(state, allow_missing=self.trainer.pivot)


class BanditState:
    """``state.bandit``: arm statistics and phase counters (its RNG is a named generator). A
    pivot keeps only the phase: the trainer then starts a fresh bandit in the next phase."""

    def __init__(self, trainer: _Trainer):
        self.trainer = trainer
        self.saved_phase = 0

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.bandit.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved_phase = state["phase"]
        if not self.trainer.pivot:
            self.trainer.bandit.load_state(state)


def device_refusal(saved: str | None, here: str) -> str | None:
    """Why a resume on ``here`` of a run that trained on ``saved`` (manifest ``run.device``) is
    refused, naming the flags that resolve it; None when the device type is the same (or the
    manifest does not say: the manager still checks the RNGs).

    >>> device_refusal("cuda:0", "cpu")  # doctest: +ELLIPSIS
    'the run trained on cuda:0, this start runs on cpu: resume it where CUDA is available (--device cuda), or pass --allow-device-change to go on on cpu (...)'
    >>> device_refusal("cuda:0", "cuda:1") is None
    True
    """
    if saved is None or saved.split(":")[0] == here.split(":")[0]:
        return None
    where = "resume it where CUDA is available (--device cuda)" if saved.startswith("cuda") \
        else f"pass --device {saved.split(':')[0]}"
    return (f"the run trained on {saved}, this start runs on {here}: {where}, or pass "
            f"--allow-device-change to go on on {here} (not bit-exact: the RNG state of {saved} "
            "cannot be restored there)")


def sidecar_state(step: int, manifest: dict[str, Any]) -> dict[str, Any]:
    """``.state.json`` after a commit: the bandit's state with its RNG (what a pivot archives)."""
    bandit_rng = ((manifest.get("rng") or {}).get("generators") or {}).get("bandit") or {}
    return dict(manifest["state"]["bandit"], step=step, rng=bandit_rng.get("state"))


def upgrade(doc: dict[str, Any]) -> dict[str, Any]:
    """A manifest the trainer wrote before it used the manager, viewed as the manager's.

    Then: ``data``, ``bandit`` and ``rng`` (with ``numpy.NAME`` generator states and
    ``torch_cuda`` as one state per visible device) at the top level and in each ``ranks``
    entry, ``amp.dtype`` beside the scaler. NumPy's global RNG was not recorded, and the trainer
    never draws from it: the view keeps the process's own.
    """
    if "state" in doc or "bandit" not in doc:
        return doc                     # written by the manager (or not the trainer's at all)
    out = {k: v for k, v in doc.items() if k not in ("data", "bandit", "rng", "ranks", "amp")}
    out["state"] = {k: doc[k] for k in ("data", "bandit") if k in doc}
    if "rng" in doc:
        out["rng"] = _upgrade_rng(doc["rng"])
    if "ranks" in doc:
        out["ranks"] = [{"rng": _upgrade_rng(r["rng"]), "state": {"data": r["data"], "bandit": r["bandit"]}}
                        for r in doc["ranks"]]
    if isinstance(doc.get("amp"), dict) and "scaler" in doc["amp"]:
        out["amp"] = {"scaler": doc["amp"]["scaler"]}
    return out


def _upgrade_rng(old: dict[str, Any]) -> dict[str, Any]:
    new = {k: old[k] for k in ("python", "torch_cpu") if k in old}
    new["numpy_global"] = rngmod.rng_state()["numpy_global"]
    if "numpy" in old:
        new["generators"] = {k: {"kind": "numpy", "state": s} for k, s in old["numpy"].items()}
    cuda = old.get("torch_cuda")
    if isinstance(cuda, list) and cuda:
        device = rngmod.cuda_device()
        if device is not None and device < len(cuda):
            new["torch_cuda"] = {"device": device, "state": cuda[device]}
    return new
