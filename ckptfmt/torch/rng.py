"""RNG state a bit-exact resume needs, as JSON (no pickle): Python, NumPy generators, torch.

One pair: ``rng_state(generators)`` is what a manifest's ``rng`` holds (the manager's, the mini
trainer's), ``restore_rng(state, generators)`` puts it back. Torch states are bytes, stored as
base64. ``next_draws`` observes what each RNG would draw next and puts every state back, so the
resume-verification protocol can compare two runs' RNGs without disturbing either.
"""
from __future__ import annotations

import base64
import random
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import IncompleteResumeStateError

__all__ = ["rng_state", "restore_rng", "next_draws", "device_changes", "device_change_problem"]

PIECES = ("python", "numpy_global", "torch_cpu")     # every process has these; torch_cuda with CUDA


def rng_state(generators: "dict[str, Any] | None" = None) -> dict[str, Any]:
    """Every RNG a training loop draws from, as JSON (what a manifest's ``rng`` holds): Python's,
    NumPy's global one, each named generator (``numpy.random.Generator`` or ``torch.Generator``),
    torch's CPU RNG and the CUDA RNG of the device in use (only that device: another machine may
    have fewer GPUs). Torch states are bytes, stored as base64 (no pickle anywhere).

    Examples:
        >>> import torch
        >>> from ckptfmt.torch import restore_rng, rng_state
        >>> saved = rng_state()
        >>> sorted(saved)
        ['generators', 'numpy_global', 'python', 'torch_cpu']
        >>> first = torch.rand(2)
        >>> restore_rng(saved)
        >>> torch.equal(torch.rand(2), first)                       # the same draws again
        True
    """
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": _python_state(),
        "numpy_global": {"name": name, "keys": keys.tolist(), "pos": pos, "has_gauss": has_gauss,
                         "cached_gaussian": cached},
        "torch_cpu": _b64(torch.get_rng_state()),
        "generators": {k: _generator_state(g) for k, g in (generators or {}).items()},
    }
    device = cuda_device()
    if device is not None:
        out["torch_cuda"] = {"device": device, "state": _b64(torch.cuda.get_rng_state(device))}
    return out


def restore_rng(state: dict[str, Any], generators: "dict[str, Any] | None" = None,
                path: str = "<manifest>", *, skip: "set[str] | frozenset[str]" = frozenset()) -> None:
    """Put every RNG back as ``rng_state`` recorded it, except the pieces named in ``skip``
    ('python', 'numpy_global', 'torch_cpu', 'torch_cuda', 'generators.NAME'). A piece the loop
    has but ``state`` lacks is refused by name (``IncompleteResumeStateError``), never silently
    left as it was. ``state`` may also have the shape the mini trainer wrote before (``numpy``
    holding the named NumPy generators, ``torch_cuda`` a list of every device's state, no
    ``numpy_global``): it is read as that shape held it.

    Examples:
        >>> import numpy as np
        >>> from ckptfmt.torch import restore_rng, rng_state
        >>> noise = np.random.default_rng(0)
        >>> saved = rng_state({"noise": noise})
        >>> before = noise.random()
        >>> restore_rng(saved, {"noise": noise})
        >>> noise.random() == before
        True
        >>> restore_rng(saved, {"noise": noise, "other": np.random.default_rng(1)})
        Traceback (most recent call last):
        ckptfmt.errors.IncompleteResumeStateError: <manifest>: ...other...
    """
    state, old = _current_shape(state)
    skip = set(skip) | ({"numpy_global"} if old else set())    # never recorded in that shape

    def need(key: str) -> Any:
        if key not in state:
            raise IncompleteResumeStateError(path, f"cannot resume: manifest lacks rng.{key}")
        return state[key]
    if "python" not in skip:
        _set_python_state(need("python"))
    if "numpy_global" not in skip:
        g = need("numpy_global")
        np.random.set_state((g["name"], np.array(g["keys"], dtype=np.uint32), g["pos"], g["has_gauss"],
                             g["cached_gaussian"]))
    if "torch_cpu" not in skip:
        torch.set_rng_state(_unb64(need("torch_cpu")))
    device = cuda_device()
    if "torch_cuda" not in skip and device is not None:
        torch.cuda.set_rng_state(_unb64(need("torch_cuda")["state"]), device)
    saved = state.get("generators", {})
    for name, gen in (generators or {}).items():
        if f"generators.{name}" in skip:
            continue
        if name not in saved:
            raise IncompleteResumeStateError(path, f"cannot resume: manifest lacks rng.generators.{name}")
        if isinstance(gen, np.random.Generator):
            gen.bit_generator.state = saved[name]["state"]
        else:
            gen.set_state(_unb64(saved[name]["state"]))


def missing(saved: dict[str, Any], generators: "Mapping[str, Any]", path: str = "<manifest>",
            exempt: "set[str] | frozenset[str]" = frozenset()) -> tuple[list[str], list[str]]:
    """(pieces ``restore_rng`` needs from ``saved`` for this process and these generators that it
    lacks, such as 'python' or 'generators.NAME'; 'rng.generators.NAME' of each saved generator
    not given), ``exempt`` pieces left out. A generator saved as another kind (numpy vs torch) is
    refused here (``IncompleteResumeStateError``), not half-way through a restore."""
    keys = list(PIECES) + [f"generators.{g}" for g in generators]
    if cuda_device() is not None:
        keys.append("torch_cuda")
    lacks = []
    for key in [k for k in keys if k not in exempt]:
        name = key.split(".", 1)[1] if key.startswith("generators.") else None
        if (key not in saved) if name is None else (name not in saved.get("generators", {})):
            lacks.append(key)
        elif name is not None:
            kind = "numpy" if isinstance(generators[name], np.random.Generator) else "torch"
            if saved["generators"][name].get("kind", kind) != kind:
                raise IncompleteResumeStateError(path, f"cannot resume: rng.generators.{name} was a "
                                                       f"{saved['generators'][name]['kind']} generator, "
                                                       f"the loop gives a {kind} one")
    return lacks, [f"rng.generators.{g}" for g in saved.get("generators", {}) if g not in generators]


def _current_shape(state: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(``state`` in ``rng_state``'s shape, whether it had the mini trainer's earlier one)."""
    if "numpy" not in state and not isinstance(state.get("torch_cuda"), list):
        return state, False
    out = {k: state[k] for k in ("python", "torch_cpu") if k in state}
    out["generators"] = {k: {"kind": "numpy", "state": s} for k, s in (state.get("numpy") or {}).items()}
    cuda, device = state.get("torch_cuda"), cuda_device()
    if isinstance(cuda, list) and device is not None and device < len(cuda):
        out["torch_cuda"] = {"device": device, "state": cuda[device]}
    return out, True


def _python_state() -> dict[str, Any]:
    """Python's ``random`` state as JSON (the same shape in the trainer's and the manager's)."""
    version, internal, gauss = random.getstate()
    return {"version": version, "state": list(internal), "gauss_next": gauss}


def _set_python_state(py: dict[str, Any]) -> None:
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def next_draws(generators: dict[str, Any] | None = None, n: int = 3, *,
               numpy_global: bool = True) -> dict[str, list[float]]:
    """The next ``n`` draws of Python's and torch's CPU RNG, NumPy's global one (unless the loop
    neither uses nor restores it: ``numpy_global=False``) and each named generator; every state
    is put back, so observing them changes nothing (what resume verification compares).

    Examples:
        >>> import torch
        >>> from ckptfmt.torch import next_draws
        >>> seen = next_draws(n=2)
        >>> sorted(seen), next_draws(n=2) == seen                   # observing draws nothing
        (['numpy_global', 'python', 'torch'], True)
    """
    py, npst, tst = random.getstate(), np.random.get_state(), torch.get_rng_state()
    out = {"python": [random.random() for _ in range(n)], "torch": torch.rand(n).tolist()}
    if numpy_global:
        out["numpy_global"] = np.random.random(n).tolist()
    random.setstate(py)
    np.random.set_state(npst)
    torch.set_rng_state(tst)
    for name, gen in (generators or {}).items():
        if isinstance(gen, np.random.Generator):
            saved = gen.bit_generator.state
            out[name] = gen.random(n).tolist()
            gen.bit_generator.state = saved
        else:
            saved = gen.get_state()
            out[name] = torch.rand(n, generator=gen, device=gen.device).tolist()
            gen.set_state(saved)
    return out


def cuda_device() -> int | None:
    """The CUDA device in use (its RNG is the one a resume needs), None when CUDA is unused."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def _generator_state(gen: Any) -> dict[str, Any]:
    if isinstance(gen, np.random.Generator):
        return {"kind": "numpy", "state": gen.bit_generator.state}
    if isinstance(gen, torch.Generator):
        return {"kind": "torch", "device": str(gen.device), "state": _b64(gen.get_state())}
    raise TypeError(f"generators: {type(gen).__name__} is neither a numpy Generator nor a torch Generator")


def device_changes(saved: dict[str, Any], live_cuda: int | None,
                   live_generators: "dict[str, str] | None" = None) -> list[tuple[str, str, str]]:
    """(rng piece, device it was saved on, device here) of each RNG state that a change of
    device type leaves without a counterpart; empty when the types agree (cuda:0 -> cuda:1 is
    no change: the state goes to the device in use).

    ``saved`` is a manifest's ``rng`` (as ``rng_state`` wrote it), ``live_cuda`` the CUDA device in
    use here (``cuda_device()``), ``live_generators`` each torch generator's device here.

    Examples:
        >>> device_changes({"torch_cuda": {"device": 0, "state": ""}}, None)
        [('torch_cuda', 'cuda:0', 'cpu')]
        >>> device_changes({"generators": {"g": {"kind": "torch", "device": "cpu"}}}, 1, {"g": "cuda:1"})
        [('torch_cuda', 'cpu', 'cuda:1'), ('generators.g', 'cpu', 'cuda:1')]
    """
    moved = []
    cuda = saved.get("torch_cuda")
    if cuda is not None and live_cuda is None:
        index = cuda.get("device") if isinstance(cuda, dict) else None
        moved.append(("torch_cuda", "cuda" if index is None else f"cuda:{index}", "cpu"))
    elif cuda is None and live_cuda is not None:
        moved.append(("torch_cuda", "cpu", f"cuda:{live_cuda}"))
    for name, here in (live_generators or {}).items():
        entry = (saved.get("generators") or {}).get(name) or {}
        there = entry.get("device", "cpu")
        if entry.get("kind") == "torch" and there.split(":")[0] != here.split(":")[0]:
            moved.append((f"generators.{name}", there, here))
    return moved


def device_change_problem(moved: list[tuple[str, str, str]]) -> str:
    """One line naming what a device change leaves behind, and the option that accepts it.

    Examples:
        >>> device_change_problem([("torch_cuda", "cpu", "cuda:0")])  # doctest: +ELLIPSIS
        'cannot resume on another device type: the checkpoint was saved without CUDA (it has no rng.torch_cuda) and this process uses cuda:0 (...)'
    """
    said = []
    for piece, there, here in moved:
        if piece == "torch_cuda" and here == "cpu":
            said.append(f"it was saved on {there} and this process uses no CUDA device, so its "
                        "rng.torch_cuda cannot be restored")
        elif piece == "torch_cuda":
            said.append(f"the checkpoint was saved without CUDA (it has no rng.torch_cuda) and this "
                        f"process uses {here}")
        else:
            said.append(f"rng.{piece} was saved on {there}, the loop gives it on {here}")
    return ("cannot resume on another device type: " + "; ".join(said)
            + " (restore(allow_device_change=True) goes on with those RNGs as this process has them;"
              " the run then does not continue bit-exactly)")
