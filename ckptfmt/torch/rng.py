"""RNG state a bit-exact resume needs, as JSON (no pickle): Python, NumPy generators, torch.

Torch states are bytes, stored as base64. ``next_draws`` observes what each RNG would draw next
and puts every state back, so the resume-verification protocol can compare two runs' RNGs
without disturbing either.
"""
from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from ..errors import IncompleteResumeStateError

__all__ = ["rng_state", "restore_rng", "next_draws"]


def rng_state(numpy_generators: dict[str, np.random.Generator] | None = None) -> dict[str, Any]:
    """Every RNG that drives training: Python, the named NumPy generators, torch CPU, each CUDA
    device. Torch states are bytes, stored as base64 (no pickle anywhere)."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {k: g.bit_generator.state for k, g in (numpy_generators or {}).items()},
        "torch_cpu": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: dict[str, Any], numpy_generators: dict[str, np.random.Generator] | None = None,
                path: str = "<manifest>") -> None:
    """Put every RNG back as ``rng_state`` recorded it; a missing piece is refused by name
    (``IncompleteResumeStateError``), never silently left as it was."""
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        for name, gen in (numpy_generators or {}).items():
            gen.bit_generator.state = state["numpy"][name]
        torch.set_rng_state(_unb64(state["torch_cpu"]))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = state["torch_cuda"]
            torch.cuda.set_rng_state_all([_unb64(s) for s in cuda])
    except KeyError as exc:
        raise IncompleteResumeStateError(path, f"cannot resume: manifest lacks rng.{exc.args[0]}") from None


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def next_draws(np_rng: np.random.Generator, n: int = 3) -> dict[str, list[float]]:
    """The next ``n`` draws of Python's, ``np_rng``'s and torch's CPU RNG; every state is put
    back, so observing them does not change the run."""
    py, npst, tst = random.getstate(), np_rng.bit_generator.state, torch.get_rng_state()
    draws = {"python": [random.random() for _ in range(n)], "numpy": np_rng.random(n).tolist(),
             "torch": torch.rand(n).tolist()}
    random.setstate(py)
    np_rng.bit_generator.state = npst
    torch.set_rng_state(tst)
    return draws
