"""Conversions of the distributed forms: sharded generations and DCP directories.

Each is verified by going back: a split is consolidated again and must hash like the source;
a consolidation is split again with the same world size and every shard must hash like the
original shard; a DCP export is read back into a .bin that must hash like the source.

A DCP directory ckptfmt wrote is one ``Source`` for every command (``dcp_source``): its arrays
against the blake3 its embedded manifest records of the .bin they make, checked as every form of
ours is (``check.source``), or, from an older ``to_dcp``, unverified and saying so.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

from ... import fingerprint, reader, shards
from ... import format as fmt
from ... import manifest as mf
from ...errors import ConvertError, DestinationExistsError, UnsupportedConversionError
from . import bridge, check
from .torchside import dcp as torch_dcp
from .check import VERIFIED
from .source import ConvertReport, Source, discard, verdict


def _report(src: str, dst: str, src_kind: str, dst_kind: str, step: int, n: int, how: str,
            digest: str | None, checked: str):

    def size(p: str) -> int:
        """The data's bytes, as a .bin's (its manifest not counted): a sharded generation's are its
        shards', whether its manifest or its directory names it."""
        path = Path(p)
        if path.suffix == ".json" and path.with_suffix(".shards").is_dir():
            path = path.with_suffix(".shards")
        if path.is_dir():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return path.stat().st_size
    how = "bytes" if how == "round-trip" else how
    return ConvertReport(src, dst, src_kind, dst_kind, step, n, verdict(checked, how), digest, size(src),
                         size(dst), checked, how)


def _check_bin(src: str) -> str:
    """Verify a .bin source against its manifest before anything is written (spec §10.6)."""
    with reader.open(src, check_name=False) as ck:
        if ck.manifest is None:
            return "unverified: a bare .bin without a manifest"
        ck.verify()
    return VERIFIED


def _manifest_of(src: str) -> Path:
    path = Path(src.rstrip("/"))
    return mf.path_for(path) if path.suffix == shards.SUFFIX else path


def convert_distributed(src: str, dst: str, src_kind: str, dst_kind: str, *, shards: int, verify: bool,
                        groups: "list[list[str]] | None" = None, groups_file: str = "--groups"):
    """Split, consolidate, or go to and from DCP; a .bin source is verified first; ``groups``:
    the param groups' parameter names of a foreign DCP directory's optimizer (``--groups``)."""
    if src_kind == "shards" and dst_kind == "bin":
        return _consolidate(src, dst, verify)
    if src_kind == "bin" and dst_kind == "shards":
        return _split(src, dst, shards, verify)
    if src_kind == "bin" and dst_kind == "dcp":
        return _to_dcp(src, dst, verify)
    if src_kind == "dcp" and dst_kind == "bin":
        return _from_dcp(src, dst, verify, groups, groups_file)
    raise ConvertError(src, f"{src_kind} -> {dst_kind} is not supported: go through .bin")


def _consolidate(src: str, dst: str, verify: bool):
    manifest = _manifest_of(src)
    result = shards.consolidate(manifest, dst)
    doc = mf.read(manifest)
    how = "skipped"
    if verify:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(dst))) as tmp:
            back = mf.read(shards.split(dst, tmp, len(doc["shards"])))
        if [r["blake3"] for r in back["shards"]] != [r["blake3"] for r in doc["shards"]]:
            discard(dst)
            raise ConvertError(dst, "round trip failed: splitting the result again does not reproduce the shards")
        how = "round-trip"
    return _report(str(manifest), dst, "shards", "bin", result.step, result.n_params, how, result.blake3, VERIFIED)


def _split(src: str, run_dir: str, world: int, verify: bool):
    if world < 1:
        raise ConvertError(src, f"--shards must be at least 1, got {world}")
    checked = _check_bin(src)
    with reader.open(src, check_name=False) as ck:
        step, n = ck.step, ck.n_params
    target = Path(run_dir)
    if (target / fmt.manifest_name(step)).exists() or shards.shards_dir(target, step).exists():
        raise DestinationExistsError(str(target), f"already holds generation {step}")
    manifest = shards.split(src, target, world)
    original = fingerprint.of_file(src)
    how = "skipped"
    if verify:
        with tempfile.TemporaryDirectory(dir=str(target)) as tmp:
            back = shards.consolidate(manifest, os.path.join(tmp, fmt.checkpoint_name(step)))
        if back.blake3 != original:
            raise ConvertError(str(manifest), "round trip failed: consolidating the shards does not reproduce the source")
        how = "round-trip"
    return _report(src, str(shards.shards_dir(target, step)), "bin", "shards", step, n, how, original, checked)


def _to_dcp(src: str, dst: str, verify: bool):
    checked = _check_bin(src)
    torch_dcp(dst).to_dcp(src, dst)
    with reader.open(src, check_name=False) as ck:
        step, n = ck.step, ck.n_params
    original = fingerprint.of_file(src)
    how = "skipped"
    if verify:
        with tempfile.TemporaryDirectory() as tmp:
            back = torch_dcp(dst).from_dcp(dst, os.path.join(tmp, fmt.checkpoint_name(step)))
        if back.blake3 != original:
            raise ConvertError(dst, "round trip failed: reading the DCP directory back does not reproduce the source")
        how = "round-trip"
    return _report(src, dst, "bin", "dcp", step, n, how, original, checked)


def dcp_source(path: str, arrays: Any = None) -> Source:
    """A DCP directory ckptfmt wrote (``arrays``: it read already) as the ``Source`` every
    command judges: ``blake3`` the digest its embedded manifest records of the .bin its arrays
    make; where an older ``to_dcp`` recorded none, ``extra["no_digest"]`` says so."""
    dcp = torch_dcp(path)
    arrays = arrays if arrays is not None else dcp.read(path)
    extra: dict[str, Any] = {"origin": "ckptfmt", "manifest": arrays.manifest}
    if arrays.blake3 is None:
        extra["no_digest"] = dcp.NO_DIGEST
    return Source(path, arrays.step, arrays.weights, arrays.m, arrays.v, arrays.manifest.get("layout"),
                  arrays.blake3, extra)


def _from_dcp(src: str, dst: str, verify: bool, groups: "list[list[str]] | None" = None,
              groups_file: str = "--groups"):
    dcp = torch_dcp(src)
    if not dcp.is_ours(src):     # torch.distributed.checkpoint.save's own: a foreign state dict
        report = bridge.import_foreign(src, "pt", dcp.read_foreign(src), dst, verify, groups, groups_file)
        return dataclasses.replace(report, src_format="dcp")
    if groups is not None:
        raise UnsupportedConversionError(groups_file, "--groups names a foreign optimizer's param groups: this "
                                                      "DCP directory was written by ckptfmt and names its own")
    arrays = dcp.read(src)
    _, checked = check.source(dcp_source(src, arrays), "dcp", None)    # before anything is written
    result = dcp.save_bin(arrays, dst)
    if arrays.blake3 is not None and result.blake3 != arrays.blake3:
        discard(dst)
        raise ConvertError(dst, f"converted from {src}, it hashes to {result.blake3}, not to the blake3 the DCP "
                                f"directory records ({arrays.blake3}); removed")
    how = "skipped"
    if verify:
        with tempfile.TemporaryDirectory() as tmp:
            dcp.to_dcp(dst, os.path.join(tmp, "dcp"))
            again = dcp.from_dcp(os.path.join(tmp, "dcp"), os.path.join(tmp, fmt.checkpoint_name(result.step)))
        if again.blake3 != result.blake3:
            discard(dst)
            raise ConvertError(dst, "round trip failed: the result does not survive DCP and back")
        how = "round-trip"
    return _report(src, dst, "dcp", "bin", result.step, result.n_params, how, result.blake3, checked)
