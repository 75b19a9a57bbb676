"""Conversion (spec §10) between the seed ``.bin`` and safetensors, torch ``.pt``, ``.npz``, a
standard zstd stream, the byte-plane form, sharded generations and DCP directories, and foreign
checkpoints (a ``torch.save`` of a model and an Adam/AdamW optimizer, a safetensors file of
weights): one module per format.

A conversion trusts nothing (``check``): the source is checked against its own digest before
anything is written, and the result is checked by going back; only when both hold is the
conversion reported as verified. A target extension that disagrees with ``--to`` and an
option that does nothing for the target are refused before anything is read.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import tempfile
from typing import Any

import numpy as np

from ... import fingerprint, fsio, kinds
from ... import format as fmt
from ...errors import (ConvertError, DestinationExistsError, UnsupportedConversionError, UnsupportedFormatError,
                       parse_json)
from ...tensorfile import TensorFile
from ...run import roots
from ...run.lock import writing_file, writing_generations
from . import bin, bridge, check, foreign, hf, npz, planes, pt, safetensors, torchside, zst
from .planes import planes as planes_of, unplanes
from .shards import convert_distributed
from .source import ConvertReport, Source, cast, discard, regions_of, verdict

__all__ = ["FORMATS", "ConvertReport", "Source", "by_name", "cast", "convert", "detect", "load", "open_file", "planes_of",
           "target", "unplanes"]

FORMATS = ("bin", "safetensors", "pt", "npz", "zst", "planes", "torch", "weights", "shards", "dcp")
SUFFIXES = {"bin": (".bin",), "safetensors": (".safetensors",), "weights": (".safetensors",),
            "pt": (".pt", ".pth", ".ckpt"), "torch": (".pt", ".pth", ".ckpt"), "npz": (".npz",), "zst": (".zst",),
            "planes": (".ckz",)}
_CONVERT_LOCAL = "convert reads and writes local files (import URL DEST brings a run at a URL here)"
DISTRIBUTED = ("shards", "dcp")                 # the forms of more than one file
WEIGHTS_ONLY = ("safetensors", "pt", "npz")      # the targets --weights-only and --dtype apply to
READERS = {"bin": bin.load, "safetensors": safetensors.load, "pt": pt.load, "npz": npz.load,
           "zst": zst.load, "planes": planes.load}
WRITERS = {"bin": bin.write, "safetensors": safetensors.write_source, "pt": pt.write,
           "npz": npz.write, "zst": zst.write, "planes": planes.write}


def detect(path: "str | os.PathLike[str]") -> str:
    """The format convert reads ``path`` as: by its content (``ckptfmt.kinds.sniff``) when it
    exists, so ``pytorch_model.bin`` (a torch zip) and a Lightning ``.ckpt`` read as ``pt``;
    by its name when it does not (a destination).

    Examples:
        >>> detect("step_000100.safetensors"), detect("x.pth"), detect("step_000100.json"), detect("a.ckz")
        ('safetensors', 'pt', 'shards', 'planes')
    """
    if not os.path.lexists(path):
        return by_name(path)
    kind = kinds.sniff(path)
    if kind.name == "run":
        raise UnsupportedFormatError(os.fspath(path), "a directory, expected a checkpoint file (or a "
                                                      "DCP directory with its .metadata)")
    return kinds.require(kind, "convert", path).convert


def by_name(path: "str | os.PathLike[str]") -> str:
    """The format a (destination) name says: its suffix; a ``.json`` or ``.shards`` a sharded
    generation.

    Examples:
        >>> from ckptfmt.tools.convert import by_name
        >>> by_name("x.safetensors"), by_name("runs/a/step_000010.json"), by_name("x.pth")
        ('safetensors', 'shards', 'pt')
    """
    name = os.fspath(path).lower().rstrip("/")
    kind = kinds.by_name(path)
    if name.endswith(".json") or (kind is not None and kind.name == "shards"):
        return "shards"
    if kind is not None and kind.convert is not None and kind.name != "safetensors-index":
        return kind.convert
    raise UnsupportedConversionError(os.fspath(path), "unknown format: expected .bin, .safetensors, .pt, "
                                                      ".npz, .zst or .ckz (or pass --to)")


def target(dst: "str | os.PathLike[str]", to: str | None) -> str:
    """The target format: ``to``, refused when DST's extension disagrees with it; else from DST.

    Examples:
        >>> target("x.zst", None), target("x.pt", "torch")
        ('zst', 'torch')
        >>> target("x.safetensors", "zst")
        Traceback (most recent call last):
        ...
        ckptfmt.errors.UnsupportedConversionError: x.safetensors: extension disagrees with --to zst: a zst target is named *.zst
    """
    if to is None:
        return by_name(dst)
    name = os.fspath(dst)
    if to not in FORMATS:
        raise UnsupportedConversionError(name, f"unknown format {to}: choose one of {', '.join(FORMATS)}")
    suffixes = SUFFIXES.get(to)
    if suffixes is None:                     # shards, dcp: a directory
        ext = os.path.splitext(name.rstrip("/"))[1].lower()
        if any(ext in s for s in SUFFIXES.values()):
            raise UnsupportedConversionError(name, f"a {to} target is a directory, not a {ext} file")
        return to
    if not name.lower().endswith(suffixes):
        raise UnsupportedConversionError(name, f"extension disagrees with --to {to}: a {to} target is named "
                                               + " or ".join(f"*{s}" for s in suffixes))
    return to


def check_options(dst: str, kind: str, weights_only: bool, dtype: str | None, shards: int | None) -> None:
    """Refuse options that would do nothing for the target (or cannot be held by it).

    Examples:
        >>> from ckptfmt.tools.convert import check_options
        >>> check_options("x.bin", "bin", True, None, None)
        Traceback (most recent call last):
        ckptfmt.errors.UnsupportedConversionError: x.bin: --weights-only does nothing for a bin target; it applies to safetensors, pt, npz
    """
    if dtype and not weights_only:
        raise UnsupportedConversionError(dst, "--dtype needs --weights-only (a resumable checkpoint stays float32)")
    if weights_only and kind not in WEIGHTS_ONLY:
        raise UnsupportedConversionError(dst, f"--weights-only does nothing for a {kind} target; it applies to "
                                              f"{', '.join(WEIGHTS_ONLY)}")
    if dtype == "bfloat16" and kind == "npz":
        raise UnsupportedConversionError(dst, "numpy has no bfloat16: use .safetensors or .pt for bfloat16")
    if dtype not in (None, "float32", "float16", "bfloat16"):
        raise UnsupportedConversionError(dst, f"unsupported dtype {dtype}: use float32, float16 or bfloat16")
    if shards is not None and kind != "shards":
        raise UnsupportedConversionError(dst, f"--shards does nothing for a {kind} target; it applies to --to shards")


def load(path: str, kind: str | None = None) -> Source:
    """Read any supported single-file format into a ``Source`` (step, regions, layout).

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.convert import convert, load
        >>> w = np.arange(2, dtype=np.float32)
        >>> _ = ckptfmt.save("step_000040.bin", 40, w, w, w)
        >>> _ = convert("step_000040.bin", "forty.npz")
        >>> load("forty.npz").weights.tolist()
        [0.0, 1.0]
    """
    kind = kind or detect(path)
    return READERS[kind](path)


def convert(src: str, dst: str, *, to: str | None = None, weights_only: bool = False,
            dtype: str | None = None, verify: bool = True, overwrite: bool = False,
            progress=None, shards: int | None = None, groups: "str | list[list[str]] | None" = None) -> ConvertReport:
    """Convert ``src`` into ``dst``: check the source against its digest, write, and with
    ``verify`` prove the result by converting back. ``progress`` gets byte counts: the source
    check, the write, then the verification (about the source size each). ``groups``: for a
    foreign ``.pt`` whose optimizer has several param groups without usable ``param_names``,
    each group's parameter names (a JSON file holding a list of lists, or the lists).

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.convert import convert
        >>> z = np.zeros(4, np.float32)
        >>> _ = ckptfmt.save("step_000030.bin", 30, z, z, z)
        >>> convert("step_000030.bin", "step_000030.zst").verified     # proven by converting back
        'round-trip'
    """
    fsio.refuse_url(dst, "the destination", _CONVERT_LOCAL)
    if not os.path.exists(src):
        fsio.refuse_url(src, "the source", _CONVERT_LOCAL)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", src)
    src = os.fspath(kinds.resolve(src))         # a Lightning checkpoint directory: its generation
    src_kind, dst_kind = detect(src), target(dst, to)
    check_options(dst, dst_kind, weights_only, dtype, shards)
    if groups is not None and (src_kind not in ("pt", "hf", "dcp") or dst_kind != "bin"):
        raise UnsupportedConversionError(dst, "--groups names the param groups of a foreign .pt (or a Trainer "
                                              "checkpoint-N, or a DCP directory) converted into a .bin; it does "
                                              "nothing here")
    group_names, groups_file = read_groups(groups)
    if dst_kind != "shards" and os.path.lexists(dst) and not overwrite:
        raise DestinationExistsError(dst, "exists already; refusing to overwrite")
    parent = os.path.dirname(os.path.abspath(dst))
    if dst_kind not in ("shards", "dcp") and not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, "destination directory does not exist", parent)
    into_run = dst_kind == "shards" and not dst.lower().endswith(".json")    # DST is the run directory
    with (writing_generations(dst, "convert") if into_run else writing_file(dst, "convert")):   # RUN.md §4
        report = _dispatch(src, dst, src_kind, dst_kind, weights_only, dtype, verify, progress,
                           shards or 2, group_names, groups_file)
        _record_in_run(dst, into_run, report)
    return report


def _dispatch(src: str, dst: str, src_kind: str, dst_kind: str, weights_only: bool, dtype: str | None,
              verify: bool, progress: Any, shards: int, group_names: Any, groups_file: Any) -> ConvertReport:
    """The conversion itself, by the forms of the source and the destination."""
    if src_kind in DISTRIBUTED and dst_kind not in DISTRIBUTED + ("bin",):
        return _through_bin(src, dst, src_kind, dst_kind, weights_only, dtype, verify, progress)
    if "shards" in (src_kind, dst_kind) or "dcp" in (src_kind, dst_kind):
        return convert_distributed(src, dst, src_kind, dst_kind, shards=shards, verify=verify,
                                   groups=group_names, groups_file=groups_file)
    if dst_kind in ("torch", "weights"):
        return bridge.export_foreign(src, src_kind, dst, dst_kind, verify)
    existed = os.path.lexists(dst)
    try:
        return _convert_file(src, dst, src_kind, dst_kind, weights_only, dtype, verify, progress,
                             group_names, groups_file)
    except BaseException:
        if not existed:
            discard(dst)       # a failed conversion leaves nothing behind (its manifest included)
        raise


def _record_in_run(dst: str, into_run: bool, report: ConvertReport) -> None:
    """A generation converted into a run directory (``--to shards`` into RUN, or a ``step_N.bin``
    beside a run's history) is named in that history: a ``convert`` event with its root digest
    (spec/RUN.md §3.7), so an older record of the step does not make it look swapped in."""
    parsed = fmt.parse_name(os.path.basename(dst))
    if into_run:
        roots.record(dst, "convert", report.step, source=report.src)
    elif parsed == (report.step, "bin"):
        roots.record(os.path.dirname(os.path.abspath(dst)), "convert", report.step, source=report.src)


def _through_bin(src: str, dst: str, src_kind: str, dst_kind: str, weights_only: bool, dtype: str | None,
                 verify: bool, progress) -> ConvertReport:
    """A sharded generation or a DCP directory into a single-file form: joined into a temp
    ``.bin`` first (checked against its digests as a join is), then converted from it and
    proved by going back like any ``.bin``; the report names the real source."""
    existed = os.path.lexists(dst)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(dst))) as tmp:
        joined = os.path.join(tmp, "joined.bin")
        first = convert_distributed(src, joined, src_kind, "bin", shards=2, verify=verify)
        try:
            out = _convert_file(joined, dst, "bin", dst_kind, weights_only, dtype, verify, progress)
        except BaseException:
            if not existed:
                discard(dst)
            raise
    return dataclasses.replace(out, src=first.src, src_format=src_kind, src_bytes=first.src_bytes,
                               source_check=first.source_check)


def read_groups(groups: "str | list[list[str]] | None") -> tuple[list[list[str]] | None, str]:
    """(each param group's parameter names, where they came from) of a ``--groups`` value: a
    JSON file holding a list with one list of state-dict names per group, or the lists.

    Examples:
        >>> import json
        >>> from ckptfmt.tools.convert import read_groups
        >>> _ = open("groups.json", "w").write(json.dumps([["wte.weight"], ["ln_f.weight"]]))
        >>> read_groups("groups.json")
        ([['wte.weight'], ['ln_f.weight']], 'groups.json')
    """
    if groups is None:
        return None, "--groups"
    where, value = "--groups", groups
    if isinstance(groups, (str, os.PathLike)):
        where = os.fspath(groups)
        try:
            with open(where, "rb") as f:
                value = parse_json(f.read(1 << 24).decode("utf-8", "replace"), UnsupportedConversionError, where)
        except OSError as exc:
            raise UnsupportedConversionError(where, f"cannot read the --groups file: {exc.strerror}") from None
    if not (isinstance(value, list) and value and all(isinstance(g, list) and all(isinstance(n, str) for n in g)
                                                      for g in value)):
        raise UnsupportedConversionError(where, "--groups: expected a JSON list with one list of parameter "
                                                'names per param group, e.g. [["wte.weight"], ["ln_f.bias"]]')
    return value, where


def _convert_file(src: str, dst: str, src_kind: str, dst_kind: str, weights_only: bool,
                  dtype: str | None, verify: bool, progress,
                  groups: "list[list[str]] | None" = None, groups_file: str = "--groups") -> ConvertReport:
    """Write one file of ``dst_kind`` from ``src`` (a foreign file into a .bin) and, with
    ``verify``, prove it by going back."""
    if dst_kind in ("torch", "weights"):
        return bridge.export_foreign(src, src_kind, dst, dst_kind, verify)
    if src_kind == "hf":                    # a Trainer checkpoint-N, a sharded save_pretrained directory
        if dst_kind != "bin":
            raise UnsupportedConversionError(src, "a Hugging Face directory converts to .bin only (then from .bin "
                                                  "to any other form)")
        loaded, checked, recorded = hf.load(src)
        return bridge.import_foreign(src, "hf", loaded, dst, verify, groups or recorded,
                                     groups_file if groups else hf.RECORD, checked)
    opened = open_file(src, src_kind)
    if not isinstance(opened, Source):
        if dst_kind != "bin":
            raise UnsupportedConversionError(src, f"a foreign {src_kind} file converts to .bin only (then from "
                                                  ".bin to any other form)")
        return bridge.import_foreign(src, src_kind, opened, dst, verify, groups, groups_file)
    return _convert_source(opened, src_kind, dst, dst_kind, weights_only, dtype, verify, progress)


def open_file(src: str, kind: str) -> Any:
    """A ``Source`` for ckptfmt's forms; the loaded foreign object (a torch object, a
    ``TensorFile``, or the ``State`` of a safetensors index or a foreign .npz) for a foreign file
    (``kind``: the format name of ``detect``).

    Examples:
        >>> import numpy as np, ckptfmt
        >>> from ckptfmt.tools.convert import open_file
        >>> z = np.zeros(2, np.float32)
        >>> _ = ckptfmt.save("step_000050.bin", 50, z, z, z)
        >>> open_file("step_000050.bin", "bin").step
        50
    """
    if kind == "pt":
        ts = torchside.torchsave(src)
        state = ts.read(src)
        ts.require_dict(state, src)
        return pt.load(src, state) if ts.is_ckptfmt(state) else state
    if kind == "safetensors":
        sf = TensorFile(src)
        return safetensors.load(src, sf) if safetensors.is_ckptfmt(sf) else sf
    if kind == "safetensors-index":
        return foreign.index_state(src)
    if kind == "npz" and not foreign.ckptfmt_npz(src):
        return foreign.npz_state(src)
    return load(src, kind)


def _convert_source(source: Source, src_kind: str, dst: str, dst_kind: str, weights_only: bool,
                    dtype: str | None, verify: bool, progress) -> ConvertReport:
    size = os.path.getsize(source.path)
    digest, checked = check.source(source, src_kind, source.extra.get("manifest"), progress)
    source.blake3 = digest or source.blake3
    written = [0]

    def wrote(n: int) -> None:
        written[0] += n
        if progress is not None:
            progress(n)
    WRITERS[dst_kind](source, dst, weights_only, dtype, wrote)
    if progress is not None and written[0] < size:
        progress(size - written[0])            # writers without chunk progress report at the end
    how = "skipped"
    if verify:
        how = _verify(source, dst, dst_kind, weights_only, dtype, digest)
        if progress is not None:
            progress(size)
    return ConvertReport(source.path, dst, src_kind, dst_kind, source.step, source.n_params,
                         verdict(checked, how), digest, size, os.path.getsize(dst), checked, how)


def _verify(source: Source, dst: str, kind: str, weights_only: bool, dtype: str | None,
            original: str | None) -> str:
    """'bytes' when converting back gives the source's .bin bytes (equal blake3), 'values'
    when every region reads back equal; raises (and removes the result) otherwise."""
    if weights_only or kind == "bin" or original is None:
        back = load(dst, kind)
        for region in regions_of(source, weights_only):
            want = cast(getattr(source, region), dtype)[1]
            got = getattr(back, region)
            if not np.array_equal(np.asarray(want).view(np.uint8), np.asarray(got).view(np.uint8)):
                discard(dst)
                raise ConvertError(dst, f"verification failed: region {region} differs after "
                                        "reading the result back")
        if kind == "bin" and original and fingerprint.of_file(dst) != original:
            discard(dst)
            raise ConvertError(dst, "verification failed: blake3 differs from the source's")
        return "bytes" if kind == "bin" and original else "values"
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(dst))) as tmp:
        back_path = os.path.join(tmp, fmt.checkpoint_name(source.step))
        bin.write(load(dst, kind), back_path, False, None)
        got = fingerprint.of_file(back_path)
    if got != original:
        discard(dst)
        raise ConvertError(dst, f"round trip failed: converting back gives blake3 {got}, "
                                f"the source is {original}")
    return "bytes"
