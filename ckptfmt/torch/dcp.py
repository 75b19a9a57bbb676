"""torch.distributed.checkpoint interop: ``ckptfmt convert`` to and from a DCP directory
(reached from the tools layer only through ``tools.convert.torchside``, so ``pip install
ckptfmt`` converts every other form without torch).

To DCP: weights under ``model.<name>`` and the Adam state under ``optim.state.<name>.exp_avg`` /
``exp_avg_sq`` / ``step`` and ``optim.param_groups``, the usual keys of a model + optimizer state
dict, so DCP's own ``load`` restores them into a model. ``ckptfmt.step`` and ``ckptfmt.manifest``
(the manifest's extra fields as UTF-8 JSON bytes in a uint8 tensor) make the way back exact.
The embedded manifest records, under ``dcp``, the blake3 and size of the ``.bin`` the arrays
make (spec/FORMAT.md §11.6); its seal covers that record, so the arrays read back and hashed as a
``.bin`` (``fingerprint.of_regions``, nothing written) are checked against it. A directory of an
older ``to_dcp`` has no such record: its arrays carry no digest (``NO_DIGEST``).
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
from dataclasses import dataclass
from typing import Any

import numpy as np

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from .. import format as fmt
from .. import manifest as mf
from .. import fsio, reader, seal, writer
from ..errors import ConvertError, ManifestSealError, parse_json

FIELD = "dcp"        # the embedded manifest's record of the .bin the arrays make: bin_blake3, bin_size
NO_DIGEST = "written by an older ckptfmt: its arrays carry no digest"


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
    """Write a .bin (with or without manifest) as a DCP directory; its embedded manifest records
    the blake3 and size of that .bin (``FIELD``), the .bin the arrays make."""
    if os.path.exists(dst) and os.listdir(dst):
        raise ConvertError(dst, "DCP destination exists and is not empty")
    ck = reader.open(src, copy_on_write=True, check_name=False)
    with ck:
        layout = _layout(ck)
        extra = {k: v for k, v in (ck.manifest or {}).items() if k not in mf.REQUIRED}
        extra.setdefault("layout", layout)
        extra[FIELD] = {"bin_blake3": ck.fingerprint(), "bin_size": ck.size}   # the bytes the tensors view
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
    elif FIELD in extra:                 # no released to_dcp wrote it: added outside the copied seal
        raise ManifestSealError(src, f"field '{FIELD}' is not covered by the embedded manifest's seal: the "
                                     "manifest was damaged or edited after it was written")
    extra.pop(seal.FIELD, None)
    return extra


def _recorded(src: str, extra: dict, n: int) -> dict[str, Any] | None:
    """What ``to_dcp`` recorded of the .bin the arrays make (None: an older ``to_dcp``), its
    shape checked and its size against the ``n`` parameters the layout holds."""
    record = extra.pop(FIELD, None)
    if record is None:
        return None
    if not (isinstance(record, dict) and mf.is_digest(record.get("bin_blake3"))
            and type(record.get("bin_size")) is int):
        raise ConvertError(src, f"the embedded ckptfmt manifest's field '{FIELD}' is malformed: expected "
                                "bin_blake3 (64 hex digits) and bin_size (an integer)")
    if record["bin_size"] != fmt.file_size(n):
        raise ConvertError(src, f"the embedded ckptfmt manifest records a .bin of {record['bin_size']} bytes, "
                                f"its layout's {n} parameters make one of {fmt.file_size(n)}")
    return record


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


@dataclass
class Arrays:
    """A DCP directory ``to_dcp`` wrote, read back: the step, the three regions, the manifest
    its .bin gets (the embedded one: its seal checked and dropped, ``layout`` kept, ``FIELD``
    taken out) and ``recorded``, that field (None: written by an older ``to_dcp``)."""
    step: int
    weights: np.ndarray
    m: np.ndarray
    v: np.ndarray
    manifest: dict[str, Any]
    recorded: dict[str, Any] | None

    @property
    def blake3(self) -> str | None:
        """The blake3 ``to_dcp`` recorded of the .bin the arrays make (None: it recorded none)."""
        return self.recorded["bin_blake3"] if self.recorded else None


def read(src: str) -> Arrays:
    """Read a DCP directory written by ``to_dcp`` (or any with model/optim keys and a layout)
    into arrays; nothing is written and nothing hashed (``fingerprint.of_regions`` hashes them)."""
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
    recorded = _recorded(src, extra, n)
    regions = {r: np.empty(n, dtype=fmt.DTYPE) for r in fmt.REGIONS}
    w, m, v = (_tensors(regions[r], layout) for r in fmt.REGIONS)
    state = {"model": w, "optim": {"state": {k: {"exp_avg": m[k], "exp_avg_sq": v[k]} for k in w}}}
    with _reading(src):
        dcp.load(state, checkpoint_id=src)
    return Arrays(int(head["ckptfmt"]["step"]), regions["weights"], regions["m"], regions["v"], extra, recorded)


def save_bin(arrays: Arrays, dst: str) -> writer.SaveResult:
    """Save the arrays as a .bin and its manifest (the .bin's own: ``FIELD`` is not kept)."""
    extra = dict(arrays.manifest)
    if extra.get("layout") == [{"name": "flat", "shape": [arrays.weights.size], "offset": 0}]:
        extra.pop("layout")
    return writer.save(dst, arrays.step, arrays.weights, arrays.m, arrays.v, manifest=extra)


def from_dcp(src: str, dst: str) -> writer.SaveResult:
    """Read a DCP directory written by ``to_dcp`` into arrays, then save a .bin and its manifest."""
    return save_bin(read(src), dst)
