"""Foreign checkpoints through ``convert`` (spec §10.7): a ``torch.save`` of a model and an
Adam, AdamW or SGD optimizer, or a safetensors file of weights, into a committed ``.bin``
(``import_foreign``), and a committed ``.bin`` back out as either (``export_foreign``:
``--to torch``, ``--to weights``). The mapping is ``ckptfmt.statemap`` (and, for torch objects,
``ckptfmt.torch.torchsave``).

A foreign file carries no digest, so its source check is "unverified"; what is proven is the
round trip: the ``.bin`` just written (blake3 and companion verified) is turned back into the
foreign form in memory and compared with what was loaded, tensor by tensor, bit for bit, with
every key, setting and value beside them. The other way, the source ``.bin`` is verified
against its manifest before anything is written, and the written file is read back and compared.
"""
from __future__ import annotations

import os
from typing import Any

from ... import fsio, statemap
from ...errors import ConvertError, UnsupportedConversionError
from ...statemap import State
from ...tensorfile import TensorFile
from . import safetensors
from .check import VERIFIED
from .source import ConvertReport, discard, verdict
from .torchside import torchsave

UNVERIFIED = "unverified: a foreign file carries no digest of its own"


def import_foreign(src: str, kind: str, loaded: Any, dst: str, verify: bool,
                   groups: "list[list[str]] | None" = None, groups_file: str = "--groups",
                   checked: str = UNVERIFIED) -> ConvertReport:
    """``loaded`` (what ``torch.load`` gave, the ``TensorFile``, the ``State`` of another weight
    file, or a Hugging Face directory as ``convert.hf.load`` gave it: kind ``hf``) as a committed
    ``.bin``; ``groups``: each param
    group's parameter names, from the ``--groups`` file; ``checked``: how the source was checked."""
    if kind not in ("pt", "hf") and groups is not None:
        raise UnsupportedConversionError(groups_file, "--groups names an optimizer's param groups: a "
                                                      "safetensors file has no optimizer")
    state = torchsave(src).to_state(loaded, src, groups, groups_file) if kind in ("pt", "hf") \
        else loaded if isinstance(loaded, State) else safetensors.foreign_state(src, loaded)
    result = statemap.write_bin(state, dst, src)
    how = "skipped"
    if verify:
        where = _difference(kind, loaded, state, statemap.read_bin(dst), src)
        if where is not None:
            discard(dst)
            raise ConvertError(dst, f"round trip failed: {where} differs after converting back")
        how = "bytes"
    said = verdict("manifest" if checked.startswith("verified") else checked, how)   # a record: its digests
    return ConvertReport(src, dst, kind, "bin", result.step, result.n_params, said, result.blake3, fsio.tree_size(src),
                         result.size, checked, how)


def _difference(kind: str, loaded: Any, state: State, back: State, src: str) -> str | None:
    if kind in ("pt", "hf"):
        ts = torchsave(src)
        return ts.difference(loaded, ts.from_state(back, src))
    return _tensors_difference(state, back)


def _tensors_difference(a: State, b: State) -> str | None:
    """Where two weight files' tensors (name, dtype, shape, bytes) or metadata first differ."""
    ta, tb = safetensors.tensors_of(a), safetensors.tensors_of(b)
    if [t[:3] for t in ta] != [t[:3] for t in tb]:
        return "the list of tensors (names, dtypes, shapes)"
    for (name, _, _, x), (_, _, _, y) in zip(ta, tb):
        if x.tobytes() != y.tobytes():
            return f"tensor {name}"
    if (a.imported.get("metadata") or {}) != (b.imported.get("metadata") or {}):
        return "the metadata"
    return None


def export_foreign(src: str, src_kind: str, dst: str, dst_kind: str, verify: bool) -> ConvertReport:
    """A committed ``.bin`` as a ``torch.save`` checkpoint (``torch``) or safetensors weights."""
    if src_kind != "bin":
        raise UnsupportedConversionError(src, f"--to {dst_kind} reads a committed .bin; convert to .bin first")
    state = statemap.read_bin(src)          # blake3 of file and companion checked: nothing written before
    written = None
    if dst_kind == "torch":
        ts = torchsave(dst)
        written = ts.from_state(state, dst)
        ts.save(written, dst)
    else:
        safetensors.write_weights(state, dst)
    how = "skipped"
    if verify:
        where = _read_back_difference(dst, dst_kind, state, written)
        if where is not None:
            discard(dst)
            raise ConvertError(dst, f"verification failed: {where} differs after reading the result back")
        how = "values"
    n = sum(int(e.data.size) for e in statemap.split(state, src)[0])
    step = state.optimizer.step if state.optimizer else 0
    return ConvertReport(src, dst, "bin", dst_kind, step, n, verdict(VERIFIED, how), None,
                         os.path.getsize(src), os.path.getsize(dst), VERIFIED, how)


def _read_back_difference(dst: str, kind: str, state: State, written: Any) -> str | None:
    if kind == "torch":
        ts = torchsave(dst)
        return ts.difference(written, ts.read(dst))
    return _tensors_difference(state, safetensors.foreign_state(dst, TensorFile(dst)))
