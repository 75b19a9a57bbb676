"""torch.distributed.checkpoint interop: ``ckptfmt convert`` to and from a DCP directory
(reached from the tools layer only through ``tools.convert.torchside``, so ``pip install
ckptfmt`` converts every other form without torch).

To DCP: weights under ``model.<name>`` and the Adam state under ``optim.state.<name>.exp_avg`` /
``exp_avg_sq`` / ``step`` and ``optim.param_groups``, the usual keys of a model + optimizer state
dict, so DCP's own ``load`` restores them into a model. ``ckptfmt.step`` and ``ckptfmt.manifest``
(the manifest's extra fields as UTF-8 JSON bytes in a uint8 tensor) make the way back exact.
From DCP: DCP's reader unpickles its own ``.metadata`` file; convert only DCP directories you
trust. The .bin side never unpickles anything. A DCP directory ckptfmt did not write (one of
``torch.distributed.checkpoint.save`` itself) is read whole as the nested state dict it was
saved from and mapped as a foreign ``torch.save`` file is (``read_foreign``).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import warnings
from typing import Any

import numpy as np

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from .. import format as fmt
from .. import manifest as mf
from .. import fsio, reader, seal, writer
from ..errors import ConvertError, parse_json


@contextlib.contextmanager
def _one_process():
    """DCP warns on every save and load that torch.distributed is not initialised and it assumes
    one process: a conversion is one process by design, so the warning says nothing to its user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _layout(ck) -> list[dict[str, Any]]:
    return ck.layout or [{"name": "flat", "shape": [ck.n_params], "offset": 0}]


def _tensors(region: np.ndarray, layout: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for e in layout:
        count = math.prod(e["shape"])
        out[e["name"]] = torch.from_numpy(region[e["offset"]:e["offset"] + count]).view(e["shape"])
    return out


def to_dcp(src: str, dst: str) -> None:
    """Write a .bin (with or without manifest) as a DCP directory."""
    if os.path.exists(dst) and os.listdir(dst):
        raise ConvertError(dst, "DCP destination exists and is not empty")
    ck = reader.open(src, copy_on_write=True, check_name=False)
    with ck:
        layout = _layout(ck)
        extra = {k: v for k, v in (ck.manifest or {}).items() if k not in mf.REQUIRED}
        extra.setdefault("layout", layout)
        opt = (ck.manifest or {}).get("optimizer", {})
        weights, m, v = (_tensors(getattr(ck, r), layout) for r in fmt.REGIONS)
        extra = mf.sealed(extra)                  # its own seal: a flip inside the DCP is damage too
        manifest_bytes = torch.frombuffer(bytearray(json.dumps(extra).encode()), dtype=torch.uint8)
        state = {"model": weights,
                 "optim": {"state": {name: {"exp_avg": m[name], "exp_avg_sq": v[name],
                                            "step": torch.tensor(float(opt.get("step", ck.step)))}
                                     for name in weights},
                           "param_groups": [dict(g, params=list(weights)) for g in opt.get("hyperparams", [{}])]},
                 "ckptfmt": {"step": torch.tensor(ck.step, dtype=torch.int64), "manifest": manifest_bytes}}
        with _one_process():
            dcp.save(state, checkpoint_id=dst)


def _checked(src: str, data: bytes) -> dict:
    """The manifest ``to_dcp`` embedded, its seal checked (§4.7) and dropped (the .bin's manifest
    gets its own). A released ``to_dcp`` copied the source's seal without the fields it leaves
    out: that one cannot be checked, as a manifest before the seal cannot."""
    extra = parse_json(data, ConvertError, src, "the embedded ckptfmt manifest is not valid JSON")
    if not isinstance(extra, dict):
        raise ConvertError(src, "the embedded ckptfmt manifest is not a JSON object")
    record = extra.get(seal.FIELD)
    copied = isinstance(record, dict) and isinstance(record.get("fields"), dict) \
        and bool(set(record["fields"]) - set(extra)) and set(record["fields"]) - set(extra) <= set(mf.REQUIRED)
    if not copied:
        seal.check(src, extra)
    extra.pop(seal.FIELD, None)
    return extra


def is_ours(src: str) -> bool:
    """The DCP directory was written by ``to_dcp`` (it embeds a ckptfmt manifest)."""
    return "ckptfmt.manifest" in _metadata(src)


def _metadata(src: str) -> dict[str, Any]:
    with _reading(src, ".metadata: "):
        return dcp.FileSystemReader(src).read_metadata().state_dict_metadata


@contextlib.contextmanager
def _reading(src: str, what: str = ""):
    """DCP's reader on ``src``, one process: what it raises for a torn directory (a
    ``CheckpointException`` is a ``BaseException``) is one ``ConvertError`` naming it; an entry
    that is not a regular file or a directory (a pipe would block the reader) is refused first."""
    for entry in os.scandir(src):
        mode = os.stat(entry.path).st_mode if os.path.exists(entry.path) else 0
        if mode and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ConvertError(entry.path, f"not a regular file ({fsio.special(mode)}) in a DCP directory")
    try:
        with _one_process():
            yield
    except (Exception, dcp.CheckpointException) as exc:     # what its pickle and its files raise
        if isinstance(exc, ConvertError):
            raise
        raise ConvertError(src, f"not a readable DCP directory: {what}{_cause(exc)}") from None


def _cause(exc: BaseException) -> str:
    """One line for what DCP raised: the first rank's own exception where DCP wraps them all
    (its ``CheckpointException``, a ``BaseException``, prints every rank's traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))[0]       # (the exception, its stack) of each rank
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def read_foreign(src: str) -> dict[str, Any]:
    """A DCP directory written by anything as the nested state dict it was saved from (what
    torch's own ``dcp_to_torch_save`` reads), with DCP's spelling of an optimizer made torch's:
    an ``optim`` entry is the ``optimizer``, and its ``state`` keys, strings in DCP, are the
    parameter indices they were, unless its param groups list names (a state keyed by parameter
    name, as ``torch.distributed.checkpoint.state_dict`` keys it: a name may be all digits)."""
    _metadata(src)
    state: dict[str, Any] = {}
    with _reading(src):
        _load_state_dict(state, storage_reader=dcp.FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    if isinstance(state.get("optim"), dict) and "optimizer" not in state:
        state["optimizer"] = state.pop("optim")
    opt = state.get("optimizer")
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    by_name = isinstance(groups, list) and any(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               and any(isinstance(p, str) for p in g["params"]) for g in groups)
    if isinstance(opt, dict) and isinstance(opt.get("state"), dict) and not by_name:
        opt["state"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in opt["state"].items()}
    return state


def from_dcp(src: str, dst: str) -> writer.SaveResult:
    """Read a DCP directory written by ``to_dcp`` (or any with model/optim keys and a layout)
    into arrays, then save a .bin and its manifest."""
    meta = _metadata(src)
    if "ckptfmt.manifest" not in meta:
        raise ConvertError(src, "not written by ckptfmt: no ckptfmt.manifest entry (its layout is needed)")
    head = {"ckptfmt": {"step": torch.tensor(0, dtype=torch.int64),
                        "manifest": torch.zeros(meta["ckptfmt.manifest"].size, dtype=torch.uint8)}}
    with _reading(src):
        dcp.load(head, checkpoint_id=src)
    extra = _checked(src, bytes(head["ckptfmt"]["manifest"].tolist()))
    layout = extra["layout"]
    n = sum(math.prod(e["shape"]) for e in layout)
    regions = {r: np.empty(n, dtype=fmt.DTYPE) for r in fmt.REGIONS}
    w, m, v = (_tensors(regions[r], layout) for r in fmt.REGIONS)
    state = {"model": w, "optim": {"state": {k: {"exp_avg": m[k], "exp_avg_sq": v[k]} for k in w}}}
    with _reading(src):
        dcp.load(state, checkpoint_id=src)
    if extra.get("layout") == [{"name": "flat", "shape": [n], "offset": 0}]:
        extra.pop("layout")
    return writer.save(dst, int(head["ckptfmt"]["step"]), regions["weights"], regions["m"], regions["v"],
                       manifest=extra)
