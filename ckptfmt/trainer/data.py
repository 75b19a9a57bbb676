"""A real text corpus that needs no download: what ships with the Python installation.

Three named sources: ``code`` (standard-library source), ``topics`` (pydoc's help topics) and
``docstrings`` (triple-quoted strings of the standard library). Each source is cut into
windows of ctx+1 bytes; an epoch visits them in a permutation drawn from (seed, source, epoch),
so the data position is fully described by (epoch, cursor) per source, which the manifest holds.
"""
from __future__ import annotations

import functools
import os
import re
import sysconfig
from typing import Any

import numpy as np
import torch

from .. import fingerprint
from ..errors import IncompleteResumeStateError

_DOCSTRING = re.compile(rb'"""(.*?)"""', re.S)


def _stdlib_files() -> list[str]:
    lib = sysconfig.get_paths()["stdlib"]
    return sorted(os.path.join(lib, n) for n in os.listdir(lib) if n.endswith(".py"))


@functools.lru_cache(maxsize=4)
def corpus(max_bytes: int) -> dict[str, bytes]:
    """The three sources, each capped at ``max_bytes`` (deterministic for one Python build)."""
    code, docs = bytearray(), bytearray()
    for path in _stdlib_files():
        with open(path, "rb") as f:
            text = f.read()
        if len(code) < max_bytes:
            code += text
        if len(docs) < max_bytes:
            for piece in _DOCSTRING.findall(text):
                docs += piece.strip() + b"\n\n"
        if len(code) >= max_bytes and len(docs) >= max_bytes:
            break
    from pydoc_data.topics import topics  # lazy: 1 MB of help text, read only to build the corpus
    helps = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8", "replace")
    return {"code": bytes(code[:max_bytes]), "topics": helps[:max_bytes], "docstrings": bytes(docs[:max_bytes])}


def identity(sources: dict[str, bytes]) -> dict[str, Any]:
    """Data identity for the manifest: size and blake3 of every source."""
    return {name: {"bytes": len(data), "blake3": fingerprint.of_bytes(data)} for name, data in sources.items()}


class DataStream:
    """Batches of byte windows per source, positioned by (epoch, cursor) per source."""

    def __init__(self, sources: dict[str, bytes], names: tuple[str, ...], ctx: int, seed: int):
        self.ctx, self.seed = ctx, seed
        self.names = names
        self.arrays = {n: np.frombuffer(sources[n], dtype=np.uint8) for n in names}
        self.n_windows = {n: (len(sources[n]) - 1) // ctx for n in names}
        for n, count in self.n_windows.items():
            if count < 1:
                raise ValueError(f"source {n} is too small for ctx {ctx}")
        self.positions = {n: {"epoch": 0, "cursor": 0} for n in names}
        self._perm: dict[str, tuple[int, np.ndarray]] = {}

    def permutation(self, name: str, epoch: int) -> np.ndarray:
        cached = self._perm.get(name)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.seed, self.names.index(name), epoch])
            cached = (epoch, rng.permutation(self.n_windows[name]))
            self._perm[name] = cached
        return cached[1]

    def next_ids(self, name: str, count: int) -> list[int]:
        pos, ids = self.positions[name], []
        while len(ids) < count:
            perm = self.permutation(name, pos["epoch"])
            take = min(count - len(ids), len(perm) - pos["cursor"])
            ids.extend(int(i) for i in perm[pos["cursor"]:pos["cursor"] + take])
            pos["cursor"] += take
            if pos["cursor"] == len(perm):
                pos["epoch"], pos["cursor"] = pos["epoch"] + 1, 0
        return ids

    def batch(self, name: str, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        ids = self.next_ids(name, count)
        arr = self.arrays[name]
        rows = np.stack([arr[i * self.ctx:i * self.ctx + self.ctx + 1] for i in ids]).astype(np.int64)
        t = torch.from_numpy(rows).to(device)
        return t[:, :-1], t[:, 1:], ids

    def state(self) -> dict[str, Any]:
        return {"seed": self.seed, "ctx": self.ctx, "positions": {n: dict(p) for n, p in self.positions.items()},
                "windows": dict(self.n_windows)}

    def load_state(self, state: dict[str, Any], *, allow_missing: bool = False) -> None:
        """Each source's position; a source without one (new at a pivot: ``allow_missing``)
        starts at 0, otherwise ``IncompleteResumeStateError`` names it."""
        missing = self.missing(state)
        if missing and not allow_missing:
            raise IncompleteResumeStateError(None, "cannot resume: " + ", ".join(f"data.positions.{n}" for n in missing)
                                             + " missing")
        for name in self.names:
            if name in state["positions"]:
                self.positions[name] = dict(state["positions"][name])

    def missing(self, state: dict[str, Any]) -> list[str]:
        """Sources of this stream that ``state`` has no position for."""
        return [name for name in self.names if name not in (state.get("positions") or {})]
